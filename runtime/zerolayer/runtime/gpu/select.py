"""Which GPU source ``gpu.source: auto`` means on this machine: NVML when the process has NVIDIA
GPUs, else the CPU source. The simulated source is never chosen here: only a config names it.

"Has GPUs" is two facts: NVIDIA's container runtime has not hidden the devices
(``NVIDIA_VISIBLE_DEVICES`` unset, or naming devices rather than ``void``/``none``/empty), and
the driver's NVML library loads. The variable alone is not enough: CUDA base images set it to
``all`` even where no GPU or driver is present. Pure functions over an environment and a loader,
so the choice is testable without a GPU.
"""

from __future__ import annotations

import ctypes
from typing import Callable, Mapping

NVML_LIBRARY = "libnvidia-ml.so.1"  # what nvidia-ml-py loads on Linux; the container toolkit mounts it
HIDDEN = ("", "void", "none")  # NVIDIA container runtime values that give the container no GPU


def devices_hidden(environ: Mapping[str, str]) -> bool:
    """True when ``NVIDIA_VISIBLE_DEVICES`` says this container gets no GPU."""
    value = environ.get("NVIDIA_VISIBLE_DEVICES")
    return value is not None and value.strip().lower() in HIDDEN


def nvml_loadable(load: Callable[[str], object] = ctypes.CDLL) -> bool:
    """Whether the NVML library (driver side, not the Python binding) can be loaded."""
    try:
        load(NVML_LIBRARY)
    except OSError:
        return False
    return True


def choose_source(environ: Mapping[str, str], loadable: Callable[[], bool] = nvml_loadable) -> tuple[str, str]:
    """``("nvml" | "cpu", why)`` for this process. ``loadable`` is only called when the devices
    are not hidden (loading a driver library has side effects worth skipping)."""
    if devices_hidden(environ):
        return "cpu", f"NVIDIA_VISIBLE_DEVICES={environ['NVIDIA_VISIBLE_DEVICES']!r} gives this container no GPU"
    if not loadable():
        return "cpu", f"{NVML_LIBRARY} does not load (no NVIDIA driver here)"
    return "nvml", f"{NVML_LIBRARY} loads and NVIDIA_VISIBLE_DEVICES does not hide the GPUs"
