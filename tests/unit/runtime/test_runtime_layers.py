"""The runtime's own layers (docs/runtime.md): checked on the source so a stray import fails here.

server -> app -> scheduler -> engine adapters -> types; the protocol cores know nothing of the
application; wire-API formatting knows nothing of sockets or scheduling; nothing imports the operator.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

RUNTIME = pathlib.Path(__file__).resolve().parents[3] / "runtime" / "zerolayer" / "runtime"
UPPER = ("zerolayer.runtime.serving.server", "zerolayer.runtime.serving.app", "zerolayer.runtime.serving.transport",
         "zerolayer.runtime.cli", "zerolayer.runtime.config", "zerolayer.runtime.node.incluster")

ALLOWED_ONLY = {
    # package -> the only zerolayer modules it may import
    # zerolayer_h2core: the protocol layer's own compiled half (native/h2core, protocol/h2native.py)
    "protocol": ("zerolayer.contract", "zerolayer.runtime.protocol", "zerolayer.runtime.limits",
                 "zerolayer.runtime.errors", "zerolayer_h2core"),
    # zerolayer.prefix is core and imports nothing of ours: engines record the prefixes they served;
    # zerolayer.engine_prefixes (imports only zerolayer.prefix): or the prefixes vLLM's KV events say it holds.
    "engine": ("zerolayer.runtime.engine", "zerolayer.runtime.errors", "zerolayer.prefix",
               "zerolayer.engine_prefixes"),
    "api": ("zerolayer.contract", "zerolayer.runtime.api", "zerolayer.runtime.engine.base",
            "zerolayer.runtime.errors"),
}


def imports(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return {n for n in names if n.startswith("zerolayer")}


@pytest.mark.parametrize("package", sorted(ALLOWED_ONLY))
def test_lower_layers_import_nothing_above_them(package):
    files = sorted((RUNTIME / package).glob("*.py"))
    assert files
    for path in files:
        bad = [n for n in imports(path) if not n.startswith(ALLOWED_ONLY[package])]
        assert not bad, f"{path.relative_to(RUNTIME.parent)} imports {bad}"


def test_no_runtime_module_imports_the_operator():
    for path in RUNTIME.rglob("*.py"):
        bad = [n for n in imports(path) if n.startswith("zerolayer.operator")]
        assert not bad, f"{path.relative_to(RUNTIME.parent)} imports {bad}"


@pytest.mark.parametrize("module", ["serving/headers.py", "tenants.py", "serving/metrics.py", "limits.py", "errors.py"])
def test_helpers_stay_below_the_server(module):
    bad = [n for n in imports(RUNTIME / module) if n.startswith(UPPER)]
    assert not bad, f"runtime/{module} imports {bad}"
