"""Run a bench against the runtime as committed at one revision, not the working tree.

Several people change the runtime while benches run; a number is only worth keeping if one
can say which code made it. This exports ``REV`` with ``git archive`` into a temporary
folder, lays it out as the ``zerolayer.*`` namespace the editable install maps (top-level
folders ``runtime/``, ``operator/``, ``client/``, ``bpf/`` under ``zerolayer/``), puts it
first on ``PYTHONPATH`` (ahead of the editable install's finder) and runs the command with
``ZEROLAYER_BENCH_REV`` set, which the benches print with their results.

    python bench/runtime_at.py HEAD -- python bench/serving_floor.py
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parent.parent
MAPPED = {"runtime": "runtime", "operator": "operator", "client": "client", "bpf": "bpf"}


def export(rev: str, dest: pathlib.Path) -> str:
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short=10", rev], check=True,
                            capture_output=True, text=True).stdout.strip()
    src = dest / "src"
    src.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", commit], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    package = dest / "py" / "zerolayer"
    shutil.copytree(src / "zerolayer", package)
    for name, folder in MAPPED.items():
        portion = src / folder / "zerolayer" / name  # the layout since the namespace portions
        (package / name).symlink_to(portion if portion.is_dir() else src / folder, target_is_directory=True)
    # The optional USDT extension is built in place, never committed: reuse the working tree's build.
    for built in (REPO / "bpf" / "zerolayer" / "bpf").glob("_probes*.so"):
        shutil.copy(built, package / "bpf" / built.name)
    return commit


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rev", help="git revision of the runtime to measure (e.g. HEAD)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the bench command")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    with tempfile.TemporaryDirectory(prefix="zerolayer-rev-") as tmp:
        commit = export(args.rev, pathlib.Path(tmp))
        path = os.pathsep.join([str(pathlib.Path(tmp, "py")), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        env = {**os.environ, "PYTHONPATH": path, "ZEROLAYER_BENCH_REV": commit}
        return subprocess.run(command, env=env, cwd=REPO).returncode


if __name__ == "__main__":
    sys.exit(main())
