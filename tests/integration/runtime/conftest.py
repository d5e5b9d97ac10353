"""Fixtures for the runtime's integration tier (helpers live in runtime_helpers.py beside this file)."""

from __future__ import annotations

import pathlib
import sys
from typing import AsyncIterator

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))

from runtime_helpers import start_runtime  # noqa: E402

from zerolayer.runtime.engine.synthetic import SyntheticEngine  # noqa: E402
from zerolayer.runtime.serving.server import RuntimeServer  # noqa: E402


@pytest.fixture
async def runtime() -> AsyncIterator[RuntimeServer]:
    async with start_runtime() as server:
        yield server


@pytest.fixture
async def slow_runtime() -> AsyncIterator[RuntimeServer]:
    """Streams that last ~2 s (200 tokens at 100/s), sampled every 50 ms."""
    engine = SyntheticEngine(output_tokens=200, tokens_per_second=100)
    async with start_runtime(engine=engine, sample_interval_s=0.05) as server:
        yield server
