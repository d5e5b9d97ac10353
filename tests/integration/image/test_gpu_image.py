"""The GPU image (``--flavour gpu``: the official CUDA vLLM from PyPI), built and run in a throwaway containerd.

Opt-in (``ZEROLAYER_GPU_IMAGE=1``): a cold build downloads ~4 GB of wheels and writes a ~10 GB
engine layer and a ~10 GB archive, and the import unpacks it once more, which CI's disk and time
budget do not carry on every run. There is no GPU here, so what it proves is the image, not CUDA:
vLLM, torch (with its CUDA runtime libraries) and triton import as the pods run them (non-root,
read-only root filesystem, tmpfs /tmp), and the compiler triton needs at run time is there. The
CUDA path itself is bench/gpu_device_check.sh's, where a GPU is lent. Same containerd helpers as
``test_runtime_image.py``; needs root, mmdebstrap, containerd, ctr and runc.
"""

from __future__ import annotations

import os
import pathlib
import shutil

import pytest

from tests.integration.image.test_runtime_image import TOOLS, containerd, run  # noqa: F401 (fixture)
from zerolayer.cluster import image

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(5400),
    pytest.mark.skipif(os.environ.get("ZEROLAYER_GPU_IMAGE") != "1",
                       reason="the GPU image is opt-in (ZEROLAYER_GPU_IMAGE=1): ~25 GB of disk and a long build"),
    pytest.mark.skipif(os.geteuid() != 0, reason="building and running the image needs root"),
    pytest.mark.skipif(any(shutil.which(t) is None for t in TOOLS),
                       reason=f"needs {', '.join(TOOLS)} (apt-get install -y mmdebstrap containerd runc)"),
]

IMPORTS = """
import os, sys, shutil
import torch, triton, vllm
from vllm import LLM, SamplingParams
from vllm.v1.engine.async_llm import AsyncLLM
import zerolayer.version, zerolayer.runtime.engine.vllm_engine, zerolayer.bpf.auditor, zerolayer.bpf._probes, bcc
print("uid", os.getuid(), "python", sys.version.split()[0], "vllm", vllm.__version__, "torch", torch.__version__,
      "cuda", torch.version.cuda, "triton", triton.__version__, "cc", shutil.which("cc") or shutil.which("gcc"),
      "cuda_available", torch.cuda.is_available(), "zerolayer", zerolayer.version.__version__)
"""


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> image.Image:
    sources = image.snapshot_sources(image.repo_root(), tmp_path_factory.mktemp("gpu-image") / "src")
    return image.ensure_image(sources, flavour="gpu")


@pytest.fixture(scope="module")
def ref(built: image.Image, containerd: str) -> str:  # noqa: F811 (the imported fixture)
    from tests.integration.image.test_runtime_image import ctr

    image.import_image(built, containerd)
    listed = ctr(containerd, "images", "ls", "-q").stdout.split()
    matches = [name for name in listed if name.endswith("/" + built.tag) or name == built.tag]
    assert matches, f"{built.tag} not among {listed}"
    return matches[0]


def test_tag_and_flavour(built: image.Image) -> None:
    from zerolayer.version import __version__

    assert built.tag == f"zerolayer/zerolayer:{__version__}-gpu"
    assert [pathlib.Path(layer.tar).name.split("-")[0] for layer in built.layers] == ["gpu", "gpu", "gpu"]


def test_the_official_vllm_torch_and_triton_import_as_the_pod_runs_them(ref: str, containerd: str) -> None:  # noqa: F811
    out = run(containerd, ref, "gpu-imports", "python3", "-c", IMPORTS, timeout=900)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    print(out.stdout.strip().splitlines()[-1])
    words = out.stdout.split()
    value = {words[i]: words[i + 1] for i in range(len(words) - 1)}
    assert value["uid"] == "65532" and value["python"].startswith("3.11.")
    assert value["vllm"] == image.VLLM_GPU.split("==")[1]
    assert value["cuda"] not in ("None", "") and value["cc"] != "None"
    assert value["cuda_available"] == "False"  # no GPU on this machine: the CUDA path is the device check's


def test_entry_point_and_jit_caches_on_tmp(ref: str, containerd: str) -> None:  # noqa: F811
    out = run(containerd, ref, "gpu-entry", "sh", "-c", 'zerolayer --help >/dev/null && echo "$TRITON_HOME"')
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip() == "/tmp"
