"""What every module that runs the real vLLM engine starts with (integration tier): skip without vLLM,
then its marks."""

from __future__ import annotations

import warnings

import pytest


def require_vllm() -> None:
    """Skip the calling module when vLLM is not installed (the ``engine`` extra). Importing it makes
    torch and vLLM warn about themselves, which is not ours to fix."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        pytest.importorskip("vllm", reason="the vllm engine extra is not installed")


def vllm_marks(timeout: int = 300) -> list:
    """integration + engine markers, a per-test timeout, and the third-party warnings that are not
    ours to fix: import-time deprecations in torch, transformers and vLLM, and vLLM's engine-core
    shutdown leaving its zmq Context to the garbage collector."""
    return [
        pytest.mark.integration, pytest.mark.engine, pytest.mark.timeout(timeout),
        pytest.mark.filterwarnings("ignore::DeprecationWarning:torch"),
        pytest.mark.filterwarnings("ignore::DeprecationWarning:transformers"),
        pytest.mark.filterwarnings("ignore::DeprecationWarning:vllm"),
        pytest.mark.filterwarnings("ignore::FutureWarning:vllm"),
        pytest.mark.filterwarnings("ignore::UserWarning:vllm"),
        pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
    ]
