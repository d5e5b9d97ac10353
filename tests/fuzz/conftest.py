"""Hypothesis profiles for the fuzz tier (tests/fuzz, marker ``fuzz``).

``ci`` (the default) is bounded and reproducible: a fixed number of examples per test, no
per-example deadline (a slow CI box must not turn into a flaky failure; ``pytest.mark.timeout``
bounds a hang instead), and a fixed seed per test (:data:`reproducible`). It replays the
committed corpus, ``tests/fuzz/corpus`` (Hypothesis' example database: every failing example a
run found, keyed by test), read-only, so a CI run neither depends on nor changes the working tree.

``explore`` is for a person hunting bugs: random seeds, many more examples, and failures written
back into the corpus, to be committed with the fix::

    ZEROLAYER_FUZZ_PROFILE=explore python3 -m pytest -q tests/fuzz
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import warnings

from hypothesis import HealthCheck, settings
from hypothesis.database import DirectoryBasedExampleDatabase, ReadOnlyDatabase

CORPUS = pathlib.Path(__file__).resolve().parent / "corpus"
PROFILE = os.environ.get("ZEROLAYER_FUZZ_PROFILE", "ci")

_common = dict(deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", max_examples=300, database=ReadOnlyDatabase(DirectoryBasedExampleDatabase(CORPUS)),
                          **_common)
settings.register_profile("explore", max_examples=5000, database=DirectoryBasedExampleDatabase(CORPUS), **_common)
settings.load_profile(PROFILE)

# On a failure Hypothesis' pytest plugin imports its patch writer, which imports libcst where
# installed, which trips a DeprecationWarning in mypy_extensions; warnings are errors here, and that
# one would replace the falsifying example with an INTERNALERROR. Import it once, quietly, now.
with warnings.catch_warnings(), contextlib.suppress(ImportError):
    warnings.simplefilter("ignore", DeprecationWarning)
    import hypothesis.extra._patching  # noqa: F401
