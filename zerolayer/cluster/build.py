"""Build the local control plane's binaries from Go modules into a cache.

Contract: :func:`ensure_binaries` returns a :class:`Toolchain` whose paths all
exist and are executable. The first call builds (many minutes on two cores);
later calls return at once because the cache directory is keyed by the pinned
versions. Nothing here starts a process other than ``go``.

Why Go modules and not downloads: this environment reaches the Go module proxy
but no release download site, and has no Docker (so no kind). Kubernetes'
``k8s.io/kubernetes`` module replaces its staging modules with local folders,
which ``go build`` cannot follow from the module cache, so we generate a small
module that requires ``k8s.io/kubernetes`` and replaces every staging module with
its published ``v0.<minor>.<patch>`` version.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time
from typing import Callable, ClassVar, TypeVar

from zerolayer.cluster import versions


class BuildError(RuntimeError):
    """A control-plane binary could not be built."""


@dataclasses.dataclass(frozen=True)
class _Binaries:
    """A folder of built binaries: ``names`` are the ones that must be there and executable."""

    bin_dir: pathlib.Path
    names: ClassVar[tuple[str, ...]] = ()

    def path(self, name: str) -> pathlib.Path:
        return self.bin_dir / name

    @property
    def missing(self) -> list[str]:
        return [n for n in self.names if not os.access(self.path(n), os.X_OK)]


_B = TypeVar("_B", bound=_Binaries)


@dataclasses.dataclass(frozen=True)
class Toolchain(_Binaries):
    """Absolute paths of every binary the local control plane uses."""

    names: ClassVar[tuple[str, ...]] = tuple(versions.BINARIES)

    @property
    def kwok_stages(self) -> pathlib.Path:
        """kwok's --config: its options and the lifecycle stages (a new name when their content changes)."""
        return self.bin_dir / "kwok-config-lease.yaml"

    @property
    def missing(self) -> list[str]:
        return super().missing + ([] if self.kwok_stages.exists() else [self.kwok_stages.name])


def cache_root() -> pathlib.Path:
    """Where built binaries live; ``ZEROLAYER_CACHE`` overrides ``~/.cache/zerolayer``."""
    env = os.environ.get("ZEROLAYER_CACHE")
    if env:
        return pathlib.Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = pathlib.Path(xdg) if xdg else pathlib.Path.home() / ".cache"
    return base / "zerolayer"


def toolchain_dir() -> pathlib.Path:
    return cache_root() / f"controlplane-{versions.STAMP}" / "bin"


def node_toolchain_dir() -> pathlib.Path:
    """Real-node binaries (kubelet, kube-proxy, kube-router): a cache of their own, keyed by their versions."""
    return cache_root() / f"node-{versions.NODE_STAMP}" / "bin"


@dataclasses.dataclass(frozen=True)
class NodeToolchain(_Binaries):
    """Absolute paths of the binaries a real node runs (containerd, runc and CNI come from Debian)."""

    names: ClassVar[tuple[str, ...]] = tuple(versions.NODE_BINARIES)


def _go() -> str:
    go = shutil.which("go")
    if not go:
        raise BuildError("the Go toolchain ('go') is not on PATH; it is needed once to build the control plane")
    return go


def _run(cmd: list[str], cwd: pathlib.Path, log) -> None:
    env = dict(os.environ, CGO_ENABLED="0", GOFLAGS="-buildvcs=false", GOTOOLCHAIN="local")
    log(f"$ {' '.join(cmd)}  (in {cwd.name})")
    proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        raise BuildError(f"{' '.join(cmd)} failed in {cwd}:\n{proc.stdout[-4000:]}")


def _kubernetes_replaces(go: str, work: pathlib.Path, log) -> list[str]:
    """Read k8s.io/kubernetes' go.mod and map each ``./staging`` replace to a published version."""
    out = subprocess.run(
        [go, "mod", "download", "-json", f"k8s.io/kubernetes@{versions.KUBERNETES}"],
        cwd=work, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=dict(os.environ, GOTOOLCHAIN="local"),
    )
    if out.returncode != 0:
        raise BuildError(f"cannot download k8s.io/kubernetes {versions.KUBERNETES}: {out.stderr[-2000:]}")
    gomod = re.search(r'"GoMod":\s*"([^"]+)"', out.stdout)
    if not gomod:
        raise BuildError("go mod download did not report k8s.io/kubernetes' go.mod")
    text = pathlib.Path(gomod.group(1)).read_text()
    staging = re.findall(r"^\s*(k8s\.io/[\w.-]+)\s+=>\s+\./staging/", text, re.M)
    if not staging:
        raise BuildError("no staging replaces found in k8s.io/kubernetes' go.mod")
    staging_version = "v0." + versions.KUBERNETES.removeprefix("v1.")
    log(f"replacing {len(staging)} staging modules with {staging_version}")
    return [f"{m} => {m} {staging_version}" for m in staging]


def _module(work: pathlib.Path, name: str, requires: list[str], replaces: list[str], main_go: str | None) -> None:
    work.mkdir(parents=True, exist_ok=True)
    lines = [f"module zerolayer.local/{name}", "", f"go {versions.GO_DIRECTIVE}", ""]
    lines += ["require ("] + [f"\t{r}" for r in requires] + [")", ""]
    if replaces:
        lines += ["replace ("] + [f"\t{r}" for r in replaces] + [")", ""]
    (work / "go.mod").write_text("\n".join(lines))
    if main_go is not None:
        (work / "main.go").write_text(main_go)


_ETCD_MAIN = """package main

import (
\t"os"

\t"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
"""

_TOOLS_GO = """//go:build tools

package tools

import (
{imports}
)
"""


def _build_group(go: str, work: pathlib.Path, name: str, requires: list[str], replaces: list[str],
                 packages: dict[str, str], out_dir: pathlib.Path, log, main_go: str | None = None) -> None:
    """Build ``packages`` (binary name -> Go package path) inside one generated module."""
    todo = {b: p for b, p in packages.items() if not os.access(out_dir / b, os.X_OK)}
    if not todo:
        return
    mod_dir = work / name
    _module(mod_dir, name, requires, replaces, main_go)
    imports = "\n".join(f'\t_ "{p}"' for p in todo.values() if p != ".")
    if imports:
        (mod_dir / "tools.go").write_text(_TOOLS_GO.format(imports=imports))
    _run([go, "mod", "tidy", "-e"], mod_dir, log)
    for binary, pkg in todo.items():
        started = time.monotonic()
        tmp = out_dir / f".{binary}.partial"
        _run([go, "build", "-trimpath", "-ldflags=-s -w " + versions.ldflags(binary), "-o", str(tmp), pkg],
             mod_dir, log)
        tmp.rename(out_dir / binary)
        log(f"built {binary} in {time.monotonic() - started:.0f}s")


def _ensure(tc: _B, log: Callable[[str], None] | None, how_long: str,
            build: Callable[[str, pathlib.Path, pathlib.Path, Callable[[str], None]], None]) -> _B:
    """``tc`` once every binary it names is there: ``build(go, work, out_dir, log)`` makes what is missing
    (in a work folder removed after a build that succeeded)."""
    say = log or (lambda msg: print(f"[zerolayer build] {msg}", file=sys.stderr, flush=True))
    if not tc.missing:
        return tc
    go = _go()
    out_dir = tc.bin_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    work = out_dir.parent / "src"
    work.mkdir(parents=True, exist_ok=True)
    say(f"building {', '.join(tc.missing)} into {out_dir} (first time only; {how_long} on 2 cores)")
    build(go, work, out_dir, say)
    missing = tc.missing
    if missing:
        raise BuildError(f"build finished but {missing} are still missing in {out_dir}")
    shutil.rmtree(work, ignore_errors=True)
    return tc


def ensure_binaries(log: Callable[[str], None] | None = None) -> Toolchain:
    """Return the cached toolchain, building whatever is missing first."""
    return _ensure(Toolchain(toolchain_dir()), log, "many minutes", _build_control_plane)


def _build_control_plane(go: str, work: pathlib.Path, out_dir: pathlib.Path, log: Callable[[str], None]) -> None:
    _build_group(
        go, work, "kubernetes", [f"k8s.io/kubernetes {versions.KUBERNETES}"], _kubernetes_replaces(go, work, log),
        {
            "kube-apiserver": "k8s.io/kubernetes/cmd/kube-apiserver",
            "kube-controller-manager": "k8s.io/kubernetes/cmd/kube-controller-manager",
            "kube-scheduler": "k8s.io/kubernetes/cmd/kube-scheduler",
            "kubectl": "k8s.io/kubernetes/cmd/kubectl",
        },
        out_dir, log,
    )
    _build_group(go, work, "etcd", [f"go.etcd.io/etcd/server/v3 {versions.ETCD}"], [],
                 {"etcd": "."}, out_dir, log, main_go=_ETCD_MAIN)
    _build_group(go, work, "kwok", [f"sigs.k8s.io/kwok {versions.KWOK}"], [],
                 {"kwok": "sigs.k8s.io/kwok/cmd/kwok"}, out_dir, log)
    _build_group(go, work, "helm", [f"helm.sh/helm/v3 {versions.HELM}"], [],
                 {"helm": "helm.sh/helm/v3/cmd/helm"}, out_dir, log)
    _build_group(go, work, "h2spec", [f"github.com/summerwind/h2spec {versions.H2SPEC}"], [],
                 {"h2spec": "github.com/summerwind/h2spec/cmd/h2spec"}, out_dir, log)
    stages = Toolchain(out_dir).kwok_stages
    if not stages.exists():
        _write_kwok_stages(go, work, stages, log)


def ensure_node_binaries(log: Callable[[str], None] | None = None) -> NodeToolchain:
    """Return the cached real-node toolchain, building whatever is missing first.

    kubelet and kube-proxy come from the same generated module as the control plane (so a warm Go
    build cache makes them quick); kube-router from its own module. Kept apart from
    :func:`ensure_binaries` so that the kwok-only path never pays for them.
    """
    return _ensure(NodeToolchain(node_toolchain_dir()), log, "minutes", _build_node)


def _build_node(go: str, work: pathlib.Path, out_dir: pathlib.Path, log: Callable[[str], None]) -> None:
    _build_group(
        go, work, "kubernetes", [f"k8s.io/kubernetes {versions.KUBERNETES}"], _kubernetes_replaces(go, work, log),
        {"kubelet": "k8s.io/kubernetes/cmd/kubelet", "kube-proxy": "k8s.io/kubernetes/cmd/kube-proxy"},
        out_dir, log,
    )
    _build_group(go, work, "kube-router", [f"github.com/cloudnativelabs/kube-router/v2 {versions.KUBE_ROUTER}"], [],
                 {"kube-router": "github.com/cloudnativelabs/kube-router/v2/cmd/kube-router"}, out_dir, log)


def jaeger_dir() -> pathlib.Path:
    """Jaeger, the tracing tests' OTLP receiver: a cache of its own, so the control plane's never rebuilds for it."""
    return cache_root() / f"tracing-{versions.JAEGER_STAMP}" / "bin"


@dataclasses.dataclass(frozen=True)
class JaegerToolchain(_Binaries):
    """Jaeger v2's single binary (``cmd/jaeger``)."""

    names: ClassVar[tuple[str, ...]] = ("jaeger",)


def ensure_jaeger(log: Callable[[str], None] | None = None) -> JaegerToolchain:
    """Return the cached Jaeger, building it first if missing (about 10 minutes cold on 2 cores)."""
    return _ensure(JaegerToolchain(jaeger_dir()), log, "about 10 minutes", _build_jaeger)


def _build_jaeger(go: str, work: pathlib.Path, out_dir: pathlib.Path, log: Callable[[str], None]) -> None:
    module = f"github.com/jaegertracing/jaeger@{versions.JAEGER}"
    _build_group(go, work, "jaeger", [module.replace("@", " ")], _module_replaces(go, work, module),
                 {"jaeger": "github.com/jaegertracing/jaeger/cmd/jaeger"}, out_dir, log)


def _module_replaces(go: str, work: pathlib.Path, module: str) -> list[str]:
    """The version replaces of ``module``'s own go.mod (a dependency's replaces do not apply to a module
    that requires it, so the generated module repeats them)."""
    out = subprocess.run([go, "mod", "download", "-json", module], cwd=work, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=dict(os.environ, GOTOOLCHAIN="local"))
    gomod = re.search(r'"GoMod":\s*"([^"]+)"', out.stdout)
    if out.returncode != 0 or not gomod:
        raise BuildError(f"cannot download {module}: {out.stderr[-2000:]}")
    text = pathlib.Path(gomod.group(1)).read_text()
    return [f"{old} => {new} {version}" for old, new, version in
            re.findall(r"^(?:replace\s+|\t)(\S+)\s+=>\s+(\S+)\s+(v\S+)\s*$", text, re.M)]


# kwok ships its lifecycle stages as YAML in its module (kwokctl embeds them); the plain kwok
# binary needs them in a config file. Fake nodes heartbeat as kubelets do: a Lease renewed every
# 10 s (duration 40 s), the Node status rewritten only every 10-20 min. Rewriting every Node's status
# every 10-15 s (the node-heartbeat stage) is 80 writes/s at 1,000 nodes, each sent to every Node
# watcher; with kwok's default 4 workers the heartbeats fell up to 73 s behind on 2 loaded cores and
# the controller manager marked nodes NotReady in waves (and their pods not ready with them).
_KWOK_STAGE_FILES = (
    "kustomize/stage/node/fast/node-initialize.yaml",
    "kustomize/stage/node/heartbeat-with-lease/node-heartbeat-with-lease.yaml",
    "kustomize/stage/pod/fast/pod-ready.yaml",
    "kustomize/stage/pod/fast/pod-complete.yaml",
    "kustomize/stage/pod/fast/pod-delete.yaml",
)

_KWOK_OPTIONS = """apiVersion: config.kwok.x-k8s.io/v1alpha1
kind: KwokConfiguration
options:
  nodeLeaseDurationSeconds: 40
  nodeLeaseParallelism: 16
  nodePlayStageParallelism: 16
  podPlayStageParallelism: 16
"""


def _write_kwok_stages(go: str, work: pathlib.Path, dest: pathlib.Path, log) -> None:
    out = subprocess.run([go, "mod", "download", "-json", f"sigs.k8s.io/kwok@{versions.KWOK}"], cwd=work,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, GOTOOLCHAIN="local"))
    found = re.search(r'"Dir":\s*"([^"]+)"', out.stdout)
    if out.returncode != 0 or not found:
        raise BuildError(f"cannot download sigs.k8s.io/kwok {versions.KWOK}: {out.stderr[-2000:]}")
    root = pathlib.Path(found.group(1))
    docs = [_KWOK_OPTIONS] + [(root / rel).read_text() for rel in _KWOK_STAGE_FILES]
    dest.write_text("---\n".join(docs))
    log(f"wrote kwok stages to {dest}")
