"""Packages and the USDT probe extension (everything else is in pyproject.toml).

Each component's folder is a portion of the ``zerolayer`` namespace package (PEP 420) whose path is its
import name: ``runtime/zerolayer/runtime/`` is ``zerolayer.runtime``, ``operator/zerolayer/operator/`` is
``zerolayer.operator``, and the core is ``zerolayer/`` at the root. Nothing shadows the standard library
(a top-level ``operator`` package would), and every standard tool (import-linter, mypy, coverage, IDEs)
reads the checkout with ``PORTIONS`` on its path: no mapping, no copy step.
"""

import pathlib

from setuptools import Extension, find_namespace_packages, setup

# The folders whose ``zerolayer/`` each holds one portion of the namespace ("." holds the core).
PORTIONS = (".", "operator", "runtime", "client", "bpf")


def discover() -> tuple[list[str], dict[str, str]]:
    """Every package under ``zerolayer`` in each portion, and the folder each one is read from."""
    here = pathlib.Path(__file__).parent
    packages: list[str] = []
    package_dir: dict[str, str] = {}
    for portion in PORTIONS:
        for name in find_namespace_packages(where=str(here / portion), include=["zerolayer", "zerolayer.*"]):
            if portion == "." and name.split(".")[1:2] and name.split(".")[1] in PORTIONS:
                continue  # zerolayer/ at the root holds only the core
            if name == "zerolayer" and portion != ".":
                continue
            if any(part == "__pycache__" for part in name.split(".")):
                continue
            packages.append(name)
            package_dir[name] = str(pathlib.PurePosixPath(portion, *name.split("."))).removeprefix("./")
    return packages, package_dir


PACKAGES, PACKAGE_DIR = discover()

# The runtime's USDT probe (bpf/zerolayer/bpf/_probes.c) needs sys/sdt.h (Debian: systemtap-sdt-dev).
# Optional: without it the install succeeds and the runtime meters through the in-process path only.
PROBES = Extension("zerolayer.bpf._probes", ["bpf/zerolayer/bpf/_probes.c"], optional=True)

# Files the code opens next to itself: the auditor's BPF program (zerolayer.bpf.loader PROGRAM) and the
# pause sandbox's source (zerolayer/cluster/images.py). Without them a wheel install (the image)
# has no kernel path: seen on a real node, where the auditor crashed reading token_events.bpf.c.
PACKAGE_DATA = {"zerolayer.bpf": ["*.bpf.c"], "zerolayer.cluster": ["pause.c"]}

setup(packages=PACKAGES, package_dir=PACKAGE_DIR, package_data=PACKAGE_DATA, ext_modules=[PROBES])
