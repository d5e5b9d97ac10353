"""Review finding 31: the declared dependency ranges admitted releases with known advisories (h11 <
0.16 is affected by CVE-2025-43859, and the runtime serves HTTP/1.1 with h11). The floors now exclude
them, and what is installed satisfies them."""

from __future__ import annotations

import importlib.metadata
import re
import tomllib

import pytest

from tests.conftest import REPO

pytestmark = [pytest.mark.regression]

FLOORS = {"h11": (0, 16), "h2": (4, 3), "aiohttp": (3, 12, 14), "cryptography": (44, 0, 1)}


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def test_declared_floors_exclude_advised_releases():
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    declared = {}
    for dep in deps:
        found = re.match(r"([A-Za-z0-9_.-]+)\s*>=\s*([0-9.]+)", dep)
        if found:
            declared[found.group(1).lower()] = _version(found.group(2))
    for name, floor in FLOORS.items():
        assert name in declared, f"{name} has no lower bound"
        assert declared[name] >= floor, f"{name}>={declared[name]} admits releases below {floor}"


def test_installed_versions_meet_the_floors():
    for name, floor in FLOORS.items():
        assert _version(importlib.metadata.version(name)) >= floor, name
