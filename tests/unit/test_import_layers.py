"""The layers in ``.importlinter`` hold: ``lint-imports`` passes on the sources as they are, and
fails (naming the contract) when a lower layer imports a higher one.

setup.py maps the repository's folders (runtime/, operator/, client/, bpf/) onto one installed
namespace, ``zerolayer.*``, which import-linter cannot follow in an editable install: it reads
a package's files from its one directory. So the sources are copied into that layout under a
temporary directory, and ``lint-imports`` runs there on the repository's ``.importlinter``.
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
FOLDERS = {"zerolayer": "zerolayer", "zerolayer/operator": "operator", "zerolayer/runtime": "runtime",
           "zerolayer/client": "client", "zerolayer/bpf": "bpf"}  # as setup.py's ROOTS

pytestmark = pytest.mark.timeout(300)


def installed_layout(into: pathlib.Path) -> pathlib.Path:
    """Copy every ``.py`` file of the mapped folders to where the install puts it."""
    for target, folder in FOLDERS.items():
        for source in (REPO / folder).rglob("*.py"):
            dest = into / target / source.relative_to(REPO / folder)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, dest)
    return into


def lint_imports(root: pathlib.Path) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("lint-imports") or str(pathlib.Path(sys.executable).parent / "lint-imports")
    if not os.path.exists(exe):
        pytest.fail("lint-imports is not installed (pip install import-linter; it is in the test extra)")
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([exe, str(CONFIG), "--no-cache"], cwd=root, env=env, capture_output=True, text=True,
                          timeout=240)


def test_the_import_contracts_are_kept(tmp_path):
    result = lint_imports(installed_layout(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert " broken" in result.stdout and "0 broken" in result.stdout


def test_a_protocol_core_importing_the_application_breaks_the_contracts(tmp_path):
    root = installed_layout(tmp_path)
    events = root / "zerolayer" / "runtime" / "protocol" / "events.py"
    events.write_text(events.read_text() + "\nimport zerolayer.runtime.app  # noqa: E402,F401\n")
    result = lint_imports(root)
    assert result.returncode != 0
    assert "The sans-IO protocol core imports nothing of the application BROKEN" in result.stdout
    assert "zerolayer.runtime.protocol.events -> zerolayer.runtime.app" in result.stdout
