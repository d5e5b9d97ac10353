"""The fixed seed of the ``ci`` profile (tests/fuzz/conftest.py), off under ``explore``.

Hypothesis' own ``derandomize`` would also fix the seed, but it turns the example database off,
and the corpus would then never be replayed.
"""

from __future__ import annotations

import os
from typing import Callable, TypeVar

from hypothesis import seed

F = TypeVar("F", bound=Callable[..., object])
CI_SEED = 20261203


def reproducible(test: F) -> F:
    """Fix the test's seed under the ``ci`` profile; leave it random under ``explore``."""
    if os.environ.get("ZEROLAYER_FUZZ_PROFILE", "ci") == "ci":
        return seed(CI_SEED)(test)
    return test
