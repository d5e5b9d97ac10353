"""Package discovery for the folder-to-namespace mapping (everything else is in pyproject.toml).

Components live in top-level folders (operator/, runtime/, client/) but install under one
namespace, ``zerolayer.*``, so nothing shadows the standard library (a top-level ``operator``
would). setuptools cannot discover packages through a remapping on its own, so we walk the
mapped folders here: any folder with an ``__init__.py`` becomes a package.
"""

import pathlib

from setuptools import Extension, setup

ROOTS = {
    "zerolayer": "zerolayer",
    "zerolayer.operator": "operator",
    "zerolayer.runtime": "runtime",
    "zerolayer.client": "client",
    "zerolayer.bpf": "bpf",
}


def discover() -> list[str]:
    here = pathlib.Path(__file__).parent
    found = []
    for package, folder in ROOTS.items():
        root = here / folder
        for init in sorted(root.rglob("__init__.py")):
            rel = init.parent.relative_to(root)
            found.append(".".join([package, *rel.parts]))
    return found


# The runtime's USDT probe (bpf/_probes.c) needs sys/sdt.h (Debian: systemtap-sdt-dev). Optional:
# without it the install succeeds and the runtime meters through the in-process path only.
PROBES = Extension("zerolayer.bpf._probes", ["bpf/_probes.c"], optional=True)

# Files the code opens next to itself: the auditor's BPF program (bpf/loader.py PROGRAM) and the
# pause sandbox's source (zerolayer/cluster/images.py). Without them a wheel install (the image)
# has no kernel path: seen on a real node, where the auditor crashed reading token_events.bpf.c.
PACKAGE_DATA = {"zerolayer.bpf": ["*.bpf.c"], "zerolayer.cluster": ["pause.c"]}

setup(package_dir=ROOTS, packages=discover(), package_data=PACKAGE_DATA, ext_modules=[PROBES])
