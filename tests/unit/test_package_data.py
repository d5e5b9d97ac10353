"""Every file the installed code opens next to itself ships in the wheel (setup.py PACKAGE_DATA).

The image installs the wheel, not the source tree: a data file left out there is missing only in
the pod (the auditor crashed on a real node reading its BPF program)."""

from __future__ import annotations

import ast
import fnmatch
import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parents[2]


def _package_data() -> dict[str, list[str]]:
    tree = ast.parse((REPO / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "PACKAGE_DATA" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py defines no PACKAGE_DATA")


PORTIONS = (".", "operator", "runtime", "client", "bpf")  # as setup.py's PORTIONS


def test_files_opened_beside_the_code_are_package_data():
    data = _package_data()
    opened = []
    for portion in PORTIONS:
        root = REPO / portion
        for source in (root / "zerolayer").rglob("*.py"):
            for name in re.findall(r"Path\(__file__\)(?:\.resolve\(\))?\.with_name\(\"([^\"]+)\"\)", source.read_text()):
                opened.append((".".join(source.parent.relative_to(root).parts), name, source.parent / name))
    assert opened, "expected at least the auditor's BPF program"
    for package, name, path in opened:
        assert path.exists(), path
        assert any(fnmatch.fnmatch(name, pattern) for pattern in data.get(package, ())), \
            f"{package}/{name} is opened by the code but not in setup.py PACKAGE_DATA"
