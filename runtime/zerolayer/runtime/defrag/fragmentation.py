"""GPU memory fragmentation, defined from what the runtime can measure.

**Definition.** For one GPU and one process's caching allocator::

    fragmentation = (reserved - allocated) / reserved        (0 when reserved == 0)

``reserved`` is the memory the allocator holds from the driver (``torch.cuda.memory_reserved``),
``allocated`` what live tensors use (``torch.cuda.memory_allocated``). The difference is memory
the driver counts as used (NVML reports it) that no tensor holds: cached blocks, split into
pieces too small for the next allocation. It is what SIGUSR1 (``empty_cache``) returns to
the driver, and what only a restart or reset can recover when blocks stay pinned. NVML alone
cannot see it, so NVML readings carry ``fragmentation = None`` and the runtime fills it in.
"""

from __future__ import annotations

import sys


def fragmentation(reserved_bytes: int, allocated_bytes: int) -> float:
    """``(reserved - allocated) / reserved``, clamped to 0..1; 0 when nothing is reserved."""
    if reserved_bytes <= 0:
        return 0.0
    return min(1.0, max(0.0, (reserved_bytes - allocated_bytes) / reserved_bytes))


def allocator_fragmentation() -> dict[int, float]:
    """Fragmentation per CUDA device index from this process's torch allocator.

    Empty when torch is not already imported (it is never imported just for this: that costs
    seconds and memory) or has no CUDA device (the CPU build: nothing to measure).
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return {}
    try:
        if not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return {}
        return {i: fragmentation(torch.cuda.memory_reserved(i), torch.cuda.memory_allocated(i))
                for i in range(torch.cuda.device_count())}
    except (RuntimeError, AssertionError):  # CUDA in a bad state: report nothing rather than fail gossip
        return {}
