"""Layers go one way (STYLE.md): server -> scheduler -> engine adapters -> types; the GPU layer
imports nothing above it. Checked on the source, so a stray import fails here, not in review."""

from __future__ import annotations

import ast
import pathlib

import pytest

RUNTIME = pathlib.Path(__file__).resolve().parents[3] / "runtime" / "zerolayer" / "runtime"

# package -> zerolayer.runtime.* modules it must never import
FORBIDDEN = {
    "gpu": ("zerolayer.runtime.scheduler", "zerolayer.runtime.serving.server", "zerolayer.runtime.serving.app",
            "zerolayer.runtime.serving.transport", "zerolayer.runtime.engine", "zerolayer.runtime.protocol"),
    "scheduler": ("zerolayer.runtime.serving.server", "zerolayer.runtime.serving.app", "zerolayer.runtime.serving.transport",
                  "zerolayer.runtime.protocol", "zerolayer.runtime.engine", "zerolayer.operator"),
}


def imports(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_layering(package):
    files = sorted((RUNTIME / package).glob("*.py"))
    assert files
    for path in files:
        bad = [n for n in imports(path) if n.startswith(FORBIDDEN[package])]
        assert not bad, f"{path.relative_to(RUNTIME.parent)} imports {bad} (above its layer)"
