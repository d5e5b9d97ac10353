"""The layers in ``.importlinter`` hold: ``lint-imports`` passes on the checkout as it is, and fails
(naming the contract) when a lower layer imports a higher one.

Each component folder is a portion of the ``zerolayer`` namespace whose path is its import name
(runtime/zerolayer/runtime/ is ``zerolayer.runtime``), so import-linter reads the checkout itself with
the portions on ``PYTHONPATH``: no copy step. The negative case edits a copy.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
CONFIG = REPO / ".importlinter"
PORTIONS = (".", "operator", "runtime", "client", "bpf")  # as setup.py's PORTIONS

pytestmark = pytest.mark.timeout(300)


def lint_imports(root: pathlib.Path) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("lint-imports") or str(pathlib.Path(sys.executable).parent / "lint-imports")
    if not os.path.exists(exe):
        pytest.fail("lint-imports is not installed (pip install import-linter; it is in the test extra)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(root / p) for p in PORTIONS)}
    return subprocess.run([exe, str(CONFIG), "--no-cache"], cwd=root, env=env, capture_output=True, text=True,
                          timeout=240)


def copy_of_checkout(into: pathlib.Path) -> pathlib.Path:
    for portion in PORTIONS:
        source = REPO / portion / "zerolayer"
        shutil.copytree(source, into / portion / "zerolayer", dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    return into


def test_the_import_contracts_are_kept_on_the_checkout():
    result = lint_imports(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert " broken" in result.stdout and "0 broken" in result.stdout


def test_a_protocol_core_importing_the_application_breaks_the_contracts(tmp_path):
    root = copy_of_checkout(tmp_path)
    events = root / "runtime" / "zerolayer" / "runtime" / "protocol" / "events.py"
    events.write_text(events.read_text() + "\nimport zerolayer.runtime.serving.app  # noqa: E402,F401\n")
    result = lint_imports(root)
    assert result.returncode != 0
    assert "The sans-IO protocol core imports nothing of the application BROKEN" in result.stdout
    assert "zerolayer.runtime.protocol.events -> zerolayer.runtime.serving.app" in result.stdout


def test_a_type_only_import_of_the_server_breaks_the_contracts(tmp_path):
    """TYPE_CHECKING imports count: a connection typed with the whole server depends on it."""
    root = copy_of_checkout(tmp_path)
    transport = root / "runtime" / "zerolayer" / "runtime" / "serving" / "transport.py"
    transport.write_text(transport.read_text() + "\nfrom typing import TYPE_CHECKING  # noqa: E402\n"
                         "if TYPE_CHECKING:\n    from zerolayer.runtime.serving.server import RuntimeServer  # noqa: F401\n")
    result = lint_imports(root)
    assert result.returncode != 0
    assert "zerolayer.runtime.serving.transport -> zerolayer.runtime.serving.server" in result.stdout


def test_gossip_importing_defrag_breaks_the_layers(tmp_path):
    """defrag records Events through gossip's Kubernetes wrapper, so gossip may not import defrag (no cycle)."""
    root = copy_of_checkout(tmp_path)
    status = root / "runtime" / "zerolayer" / "runtime" / "gossip" / "status.py"
    status.write_text(status.read_text() + "\nimport zerolayer.runtime.defrag.fragmentation  # noqa: E402,F401\n")
    result = lint_imports(root)
    assert result.returncode != 0
    assert "zerolayer.runtime.gossip.status -> zerolayer.runtime.defrag.fragmentation" in result.stdout
