"""``zerolayer cluster up|down|status|kubeconfig|env``: the local control plane."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

from typing import TYPE_CHECKING

from zerolayer.cluster.build import BuildError

if TYPE_CHECKING:
    from zerolayer.cluster.local import LocalCluster

# zerolayer.cluster.local is imported when a `cluster` action runs, not when the CLI builds its parser: its
# PKI needs `cryptography`, which `zerolayer defragd` or `zerolayer map` on a GPU node must not need.


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("cluster", help="a real local Kubernetes control plane with fake GPU nodes (no Docker)",
                       description="Build (once, cached) and run etcd, kube-apiserver, kube-controller-manager, "
                                   "kube-scheduler and kwok on 127.0.0.1, with fake GPU nodes.")
    csub = p.add_subparsers(dest="cluster_command", metavar="ACTION", required=True)
    up = csub.add_parser("up", help="start (or reuse) the local control plane and wait until nodes are Ready")
    up.add_argument("--nodes", type=int, default=3, help="fake GPU nodes to create (default 3; 0 is allowed with --real-nodes)")
    up.add_argument("--real-nodes", type=int, default=0, metavar="N",
                    help="also run N real nodes (kubelet + containerd, pods run for real; root only; default 0)")
    up.add_argument("--timeout", type=float, default=180, help="seconds to wait for Ready nodes")
    up.set_defaults(handler=_up)
    csub.add_parser("down", help="stop every process `up` started and remove its state").set_defaults(handler=_down)
    st = csub.add_parser("status", help="show the components and whether the API server is ready")
    st.add_argument("-o", "--output", choices=["table", "json"], default="table")
    st.set_defaults(handler=_status)
    csub.add_parser("kubeconfig", help="print the admin kubeconfig path").set_defaults(handler=_kubeconfig)
    imp = csub.add_parser("import-image", help="import an OCI or docker-archive tarball into the real nodes")
    imp.add_argument("archive", help="image tarball (e.g. from hack/build-image.sh)")
    imp.set_defaults(handler=_import_image)
    csub.add_parser("env", help="print shell exports: KUBECONFIG and a PATH with the matching kubectl and helm"
                    ).set_defaults(handler=_env)


def _guard(fn):
    def wrapper(args):
        from zerolayer.cluster.local import ClusterError
        try:
            return fn(args)
        except (ClusterError, BuildError) as exc:
            print(f"zerolayer cluster: {exc}", file=sys.stderr)
            return 1
    return wrapper


def _local():  # type: ignore[no-untyped-def]
    from zerolayer.cluster import local
    return local


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@_guard
def _up(args) -> int:
    if args.real_nodes < 0:
        raise _local().ClusterError("--real-nodes must be 0 or more")
    if args.nodes < 0 or args.nodes + args.real_nodes < 1:
        raise _local().ClusterError("--nodes must be at least 1 (or 0 with --real-nodes)")
    _local().LocalCluster(log=_log).up(nodes=args.nodes, timeout=args.timeout, real_nodes=args.real_nodes)
    return 0


@_guard
def _down(args) -> int:
    _local().LocalCluster(log=_log).down()
    return 0


@_guard
def _status(args) -> int:
    st = _local().LocalCluster(log=_log).status()
    if args.output == "json":
        print(json.dumps(st, indent=2))
    elif not st["components"]:
        print("no local cluster (run `zerolayer cluster up`)")
    else:
        print(f"API server  {st['api_server']}  {'ready' if st['running'] else 'NOT READY'}")
        print(f"kubeconfig  {st['kubeconfig']}")
        print(f"{'COMPONENT':<26}{'PID':>8}  {'PORT':>6}  STATE")
        for c in st["components"]:
            print(f"{c['name']:<26}{c['pid']:>8}  {c['port']:>6}  {'running' if c['alive'] else 'stopped'}")
        for n in st.get("real_nodes", []):
            print(f"real node   {n['name']}  InternalIP {n['node_ip']}:{n['kubelet_port']}  pods {n['pod_cidr']}  "
                  f"containerd {n['socket']}")
    return 0 if st["running"] else 3


def _require_state(cluster: LocalCluster) -> dict:
    st = cluster.state()
    if st is None:
        raise _local().ClusterError("no local cluster (run `zerolayer cluster up`)")
    return st


@_guard
def _import_image(args) -> int:
    for name in _local().LocalCluster(log=_log).import_image(args.archive):
        print(name)
    return 0


@_guard
def _kubeconfig(args) -> int:
    print(_require_state(_local().LocalCluster(log=_log))["kubeconfig"])
    return 0


@_guard
def _env(args) -> int:
    st = _require_state(_local().LocalCluster(log=_log))
    path = f"{st['bin_dir']}{os.pathsep}{os.environ.get('PATH', '')}"
    print(f"export KUBECONFIG={shlex.quote(st['kubeconfig'])}")
    print(f"export PATH={shlex.quote(path)}")
    return 0
