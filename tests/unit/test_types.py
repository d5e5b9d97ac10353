"""mypy passes on the checkout itself (no copy step, no install) for every package in ``CHECKED``.

The list grows as packages are made clean; a package leaves it only with a reason in the commit.
Settings are pyproject.toml's ``[tool.mypy]``: the namespace portions are mypy's path.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1].parent

CHECKED = (
    "zerolayer.contract",
    "zerolayer.gpumap",
    # every component portion, whole (issue 26)
    "zerolayer.client",
    "zerolayer.bpf",
    "zerolayer.operator",
    "zerolayer.runtime",
)

pytestmark = pytest.mark.timeout(600)


def test_mypy_passes_on_the_checked_packages():
    import importlib.util

    if importlib.util.find_spec("mypy") is None:
        pytest.fail("mypy is not installed (it is in the test extra: pip install -e '.[test]')")
    args = [sys.executable, "-m", "mypy", "--no-incremental"]
    for package in CHECKED:
        args += ["-p", package]
    out = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=540)
    assert out.returncode == 0, out.stdout + out.stderr
