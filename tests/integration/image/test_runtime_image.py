"""The runtime image, built (or taken from the cache) and run in a throwaway containerd.

Builds with :func:`zerolayer.cluster.image.ensure_image` (a cold build takes many minutes; a warm
one returns at once), imports the archive with ``ctr -n k8s.io images import`` into a containerd
whose root, state and socket live under the test's temporary directory, and runs the image with
``ctr run``: as the image's non-root user, read-only root filesystem, a tmpfs on /tmp (as the
operator's pods have). Needs root, mmdebstrap, containerd, ctr and runc.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import time
from collections.abc import Iterator

import pytest

from zerolayer.cluster import image

TOOLS = ("mmdebstrap", "containerd", "ctr", "runc")
pytestmark = [
    pytest.mark.integration,
    pytest.mark.engine,
    pytest.mark.timeout(3600),  # a cold build: Debian, ~1.5 GB of wheels, the layers
    pytest.mark.skipif(os.geteuid() != 0, reason="building and running the image needs root"),
    pytest.mark.skipif(any(shutil.which(t) is None for t in TOOLS),
                       reason=f"needs {', '.join(TOOLS)} (apt-get install -y mmdebstrap containerd runc)"),
]

# One generation by the real engine in the container, as the pods run it: offline, eager.
GENERATE = """
import os
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from zerolayer.runtime.node import tinymodel
tinymodel.generate("/tmp/model")
from vllm import LLM, SamplingParams
# float32 as the model was written, as every other real-engine test asks: vLLM's CPU default (auto ->
# bfloat16) died with SIGILL (exit 132) in its first forward pass on a Xeon listing amx_bf16 and
# avx512_bf16, on the host as in the container (docs/image.md).
llm = LLM(model="/tmp/model", kv_cache_memory_bytes=64 << 20, enforce_eager=True, max_model_len=256, dtype="float32")
out = llm.generate(["hello"], SamplingParams(max_tokens=8, ignore_eos=True))
print("GENERATED", len(out[0].outputs[0].token_ids))
"""


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """This checkout's sources, frozen: others editing the tree cannot move the key mid-module."""
    return image.snapshot_sources(image.repo_root(), tmp_path_factory.mktemp("image") / "src")


@pytest.fixture(scope="module")
def built(sources: pathlib.Path) -> image.Image:
    return image.ensure_image(sources)


@pytest.fixture(scope="module")
def containerd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A containerd for this module alone (no CRI); yields its socket."""
    # Short path: the socket's path must fit in sun_path (108 bytes).
    root = pathlib.Path(tmp_path_factory.mktemp("ctrd"))
    socket = root / "containerd.sock"
    config = root / "config.toml"
    config.write_text(
        f'version = 2\nroot = "{root / "root"}"\nstate = "{root / "state"}"\n'
        'disabled_plugins = ["io.containerd.grpc.v1.cri"]\n'
        f'[grpc]\n  address = "{socket}"\n'
    )
    log = open(root / "containerd.log", "w")
    proc = subprocess.Popen(["containerd", "--config", str(config)], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while not socket.exists():
            assert proc.poll() is None, (root / "containerd.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "containerd did not open its socket within 30 s"
            time.sleep(0.1)
        yield str(socket)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
        # Snapshots are overlay mounts only while a container runs (`ctr run --rm` removes them).
        subprocess.run(["umount", "--recursive", "--quiet", str(root / "state")], check=False)
        shutil.rmtree(root, ignore_errors=True)


def ctr(socket: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ctr", "--address", socket, "--namespace", "k8s.io", *args],
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def ref(built: image.Image, containerd: str) -> str:
    """The imported image's reference, as containerd names it."""
    image.import_image(built, containerd)
    listed = ctr(containerd, "images", "ls", "-q").stdout.split()
    matches = [name for name in listed if name.endswith("/" + built.tag) or name == built.tag]
    assert matches, f"{built.tag} not among {listed}"
    return matches[0]


def run(socket: str, ref: str, name: str, *argv: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """``ctr run --rm`` like the pods: image user, read-only root, tmpfs /tmp, no network."""
    return ctr(socket, "run", "--rm", "--read-only",
               "--mount", "type=tmpfs,src=tmpfs,dst=/tmp,options=rw:nosuid:nodev:mode=1777",
               ref, name, *argv, timeout=timeout)


def test_tag_and_archive(built: image.Image) -> None:
    from zerolayer.version import __version__

    assert built.tag == f"zerolayer/zerolayer:{__version__}-cpu"
    assert built.archive.is_file() and built.archive.parent == image.images_dir()


def test_a_warm_call_returns_at_once(built: image.Image, sources: pathlib.Path) -> None:
    started = time.monotonic()
    again = image.ensure_image(sources)
    assert again.archive == built.archive
    assert time.monotonic() - started < 5


def test_imports_everything_the_pod_needs_as_non_root(ref: str, containerd: str) -> None:
    out = run(containerd, ref, "imports", "python3", "-c",
              "import os, sys, zerolayer.version, zerolayer.runtime.serving.server, zerolayer.operator, zerolayer.bpf.auditor, "
              "zerolayer.bpf._probes, bcc, vllm, torch; "
              "print('uid', os.getuid(), 'python', sys.version.split()[0], 'vllm', vllm.__version__, "
              "'torch', torch.__version__, 'zerolayer', zerolayer.version.__version__)")
    assert out.returncode == 0, out.stdout + out.stderr
    words = out.stdout.split()
    assert words[words.index("uid") + 1] == "65532"
    assert words[words.index("python") + 1].startswith("3.11.")
    assert words[words.index("vllm") + 1] == image.install_engine.VLLM.split("==")[1]


def test_the_native_http2_core_is_in_the_image(ref: str, containerd: str) -> None:
    """``server.core: native`` works in a pod: the compiled core imports and the config accepts it."""
    out = run(containerd, ref, "native", "python3", "-c",
              "import zerolayer_h2core; from zerolayer.runtime.protocol import h2native; "
              "from zerolayer.runtime.config import parse_server_core; "
              "print('core', parse_server_core({'core': 'native'}), zerolayer_h2core.__name__)")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "core native zerolayer_h2core" in out.stdout


def test_entry_point_is_zerolayer(ref: str, containerd: str) -> None:
    out = run(containerd, ref, "entry", "zerolayer", "--help")
    assert out.returncode == 0, out.stdout + out.stderr
    for command in ("runtime", "operator", "auditor", "defragd"):
        assert command in out.stdout


def test_the_engine_generates_in_the_container(ref: str, containerd: str) -> None:
    out = run(containerd, ref, "generate", "python3", "-c", GENERATE, timeout=900)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    assert "GENERATED 8" in out.stdout
