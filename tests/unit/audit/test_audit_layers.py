"""The audit subsystem's layers (bpf/__init__.py), checked on the source.

cli -> auditor -> (loader, journal, store, billing, kube, clickhouse) -> events, errors. What the
runtime imports (hook, probes) stays light: no bcc, SQLite, Kubernetes or ClickHouse.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

BPF = pathlib.Path(__file__).resolve().parents[3] / "bpf" / "zerolayer" / "bpf"
HEAVY = ("bcc", "sqlite3", "kubernetes", "clickhouse_connect", "prometheus_client", "yaml")


def imports(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("module", ["hook.py", "probes.py", "events.py", "errors.py"])
def test_what_the_runtime_imports_stays_light(module):
    names = imports(BPF / module)
    # "zerolayer.bpf._probes": `import zerolayer.bpf._probes`, the C extension (the package's __init__ imports nothing)
    light = ("zerolayer.bpf.probes", "zerolayer.bpf.events", "zerolayer.bpf.errors", "zerolayer.bpf._probes")
    bad = [n for n in names if n.startswith(HEAVY) or (n.startswith("zerolayer") and n != "zerolayer.bpf"
                                                         and not n.startswith(light))]
    assert not bad, f"bpf/{module} imports {bad}"


@pytest.mark.parametrize("module", ["loader.py", "journal.py", "store.py", "billing.py", "kube.py", "clickhouse.py"])
def test_adapters_import_nothing_above_them(module):
    bad = [n for n in imports(BPF / module) if n.startswith(("zerolayer.bpf.auditor", "zerolayer.bpf.cli",
                                                               "zerolayer.runtime", "zerolayer.operator"))]
    assert not bad, f"bpf/{module} imports {bad}"


def test_nothing_imports_the_operator_or_the_runtime_server():
    for path in BPF.glob("*.py"):
        bad = [n for n in imports(path) if n.startswith("zerolayer.operator") or (
            n.startswith("zerolayer.runtime") and not n.startswith("zerolayer.runtime.gpu"))]
        assert not bad, f"bpf/{path.name} imports {bad}"
