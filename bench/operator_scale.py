"""Operator at scale on the local control plane: N InferenceNodes on N kwok GPU nodes and M TenantQuotas.

    python bench/operator_scale.py [--nodes 200] [--tenants 1000] [--resync 10800] [--idle 120]

Measures, for one ``zerolayer operator`` process started before the objects are created:

- time until every InferenceNode and TenantQuota is Ready (the runtimes' heartbeats are written
  by this script as soon as each InferenceNode exists: kwok pods are records, not processes);
- API requests the operator made, counted by the API server itself: the operator runs as its own
  ServiceAccount and a FlowSchema matching only that account makes API Priority and Fairness
  count its requests (``apiserver_flowcontrol_dispatched_requests_total``), kopf's watches and
  patches included; beside it, the operator's own counter by verb (its /metrics);
- the same counts over an idle period after convergence (watches re-opened, the leader's Lease
  renewals; there are no per-object timers any more, and the one full resync is hours away);
- the operator's CPU seconds and peak RSS (/proc).

The comparison it names: requests per object against the floor of a create-only operator
(one write per child, per label and per status; the floor formula is kept as in the first
version of this bench, 6 children per InferenceNode, so the ratios compare, and the floor with
the 8 children an InferenceNode really has is printed beside it). The operator runs with leader
election on, as the chart runs it: its Lease renewals are in every count. The cluster is reused when
running (and everything the script created is deleted at the end), else brought up for the run and
taken down after it. ``--profile PATH`` records the operator with py-spy while idle.
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time
import uuid

import yaml

from zerolayer.cluster.local import LocalCluster, node_manifest

API = "zerolayer.io/v1alpha1"
RESULTS = pathlib.Path(__file__).resolve().parent / "results"
_DISPATCHED = re.compile(r'^apiserver_flowcontrol_dispatched_requests_total\{(?P<l>[^}]*)\} (?P<v>\S+)$')
_OURS = re.compile(r'^zerolayer_operator_api_requests_total\{(?P<l>[^}]*)\} (?P<v>\S+)$')


def kubectl_apply(cluster: LocalCluster, items: list[dict], chunk: int = 200, after=None) -> None:
    """Apply ``items`` in chunks; ``after(chunk)`` runs once each chunk exists."""
    for i in range(0, len(items), chunk):
        cluster.kubectl("apply", "-f", "-", "--server-side", "--force-conflicts", timeout=600,
                        input=json.dumps({"apiVersion": "v1", "kind": "List", "items": items[i:i + chunk]}))
        if after is not None:
            after(items[i:i + chunk])


def dispatched(cluster: LocalCluster, schema: str) -> float:
    text = cluster.kubectl("get", "--raw", "/metrics").stdout
    return sum(float(m.group("v")) for line in text.splitlines()
               if (m := _DISPATCHED.match(line)) and f'flow_schema="{schema}"' in m.group("l"))


def own_requests(port: int) -> dict[tuple[str, str], float]:
    """The operator's own client's requests so far, by (verb, resource)."""
    import urllib.request
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    counts: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        if m := _OURS.match(line):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group("l")))
            key = (labels["verb"], labels["resource"])
            counts[key] = counts.get(key, 0) + float(m.group("v"))
    return counts


def by_verb(counts: dict[tuple[str, str], float]) -> dict[str, float]:
    out: dict[str, float] = {}
    for (verb, _), n in counts.items():
        out[verb] = out.get(verb, 0) + n
    return out


def proc_usage(pid: int) -> tuple[float, float]:
    """(CPU seconds, peak RSS MiB) of a process."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    hwm = next(l for l in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines() if l.startswith("VmHWM"))
    return cpu, int(hwm.split()[1]) / 1024


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def report(rows: list[tuple[str, str]], args: argparse.Namespace) -> None:
    width = max(len(k) for k, _ in rows)
    table = "\n".join(f"| {k.ljust(width)} | {v} |" for k, v in rows)
    print("\n" + table, flush=True)
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"operator_scale_{args.nodes}n_{args.tenants}t.md"
    out.write_text(f"# Operator scale ({time.strftime('%Y-%m-%d', time.gmtime())}, local control plane, 2 shared CPU "
                   f"cores)\n\n`python bench/operator_scale.py --nodes {args.nodes} --tenants {args.tenants} "
                   f"--resync {args.resync:g} --idle {args.idle:g}`\n\n| measure | value |\n|---|---|\n{table}\n")
    print(f"\nwritten to {out}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=200)
    ap.add_argument("--tenants", type=int, default=1000)
    ap.add_argument("--resync", type=float, default=10800.0, help="operator --resync-seconds (the full resync)")
    ap.add_argument("--idle", type=float, default=120.0, help="seconds to count requests after convergence")
    ap.add_argument("--timeout", type=float, default=1200.0)
    ap.add_argument("--profile", metavar="PATH", help="py-spy the operator while idle (collapsed stacks to PATH)")
    args = ap.parse_args()

    cluster = LocalCluster(log=lambda m: print(f"[cluster] {m}", flush=True))
    started = cluster.up() == "started"
    run = uuid.uuid4().hex[:6]
    ns, label = f"zl-bench-{run}", f"zerolayer.io/bench={run}"
    sa, schema = "zl-bench-operator", f"zl-bench-operator-{run}"
    node_names = [f"zl-bench-{run}-n{i}" for i in range(args.nodes)]
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="zl-bench-"))
    operator = None
    rows: list[tuple[str, str]] = []
    try:
        cluster.kubectl("apply", "--server-side", "-f", str(pathlib.Path(__file__).resolve().parents[1] / "crds"))
        cluster.kubectl("create", "namespace", ns)
        kubectl_apply(cluster, [node_manifest(n) for n in node_names])
        # The operator's own identity, so the API server can count its requests apart.
        cluster.kubectl("create", "serviceaccount", sa, "-n", ns)
        cluster.kubectl("create", "clusterrolebinding", schema, "--clusterrole=cluster-admin",
                        f"--serviceaccount={ns}:{sa}")
        kubectl_apply(cluster, [{
            "apiVersion": "flowcontrol.apiserver.k8s.io/v1", "kind": "FlowSchema", "metadata": {"name": schema},
            "spec": {"priorityLevelConfiguration": {"name": "workload-high"}, "matchingPrecedence": 500,
                     "distinguisherMethod": {"type": "ByUser"},
                     "rules": [{"subjects": [{"kind": "ServiceAccount", "serviceAccount": {"name": sa, "namespace": ns}}],
                                "resourceRules": [{"verbs": ["*"], "apiGroups": ["*"], "resources": ["*"],
                                                   "clusterScope": True, "namespaces": ["*"]}],
                                "nonResourceRules": [{"verbs": ["*"], "nonResourceURLs": ["*"]}]}]}}])
        token = cluster.kubectl("create", "token", sa, "-n", ns, "--duration=4h").stdout.strip()
        admin = yaml.safe_load(pathlib.Path(cluster.kubeconfig).read_text())
        admin["users"] = [{"name": sa, "user": {"token": token}}]
        for ctx in admin["contexts"]:
            ctx["context"]["user"] = sa
        kubeconfig = workdir / "operator.kubeconfig"
        kubeconfig.write_text(yaml.safe_dump(admin))

        metrics_port = free_port()
        log = open(workdir / "operator.log", "w")
        operator = subprocess.Popen(
            [sys.executable, "-m", "zerolayer.cli", "operator", "--kubeconfig", str(kubeconfig),
             "--runtime-namespace", ns, "--selector", label, "--resync-seconds", str(args.resync),
             "--health-port", "0", "--metrics-port", str(metrics_port), "--log-level", "warning"],
            stdout=log, stderr=subprocess.STDOUT,
            env=dict(os.environ, ZEROLAYER_RUNTIME_RESOURCES='{"requests": {"cpu": "10m", "memory": "16Mi"}}'))
        time.sleep(3)
        base = dispatched(cluster, schema)
        t0 = time.monotonic()

        key, value = label.split("=")
        secrets = [{"apiVersion": "v1", "kind": "Secret", "metadata": {"name": f"t{i}-keys", "namespace": ns},
                    "data": {"api-keys": base64.b64encode(f"key-{i}\n".encode()).decode()}}
                   for i in range(args.tenants)]
        tenants = [{"apiVersion": API, "kind": "TenantQuota", "metadata": {"name": f"t{i}-{run}", "labels": {key: value}},
                    "spec": {"tenant": f"t{i}-{run}", "apiKeySecretRef": {"name": f"t{i}-keys", "namespace": ns},
                             "namespaces": [f"team-{i}"], "tokensPerMinute": 1000, "requestsPerMinute": 60}}
                   for i in range(args.tenants)]
        inodes = [{"apiVersion": API, "kind": "InferenceNode", "metadata": {"name": f"{n}-inode", "labels": {key: value}},
                   "spec": {"nodeName": n, "models": [{"name": "tiny", "source": {"path": "/models/tiny"}}],
                            "gossip": {"heartbeatSeconds": 10, "staleAfterSeconds": 86400}}}
                  for n in node_names]
        # The runtimes' first heartbeats, written as soon as each chunk of InferenceNodes exists (a
        # runtime heartbeats seconds after its pod starts). One client for all of them: a kubectl
        # process per heartbeat cost ~0.4 s of CPU each, minutes of the shared cores at 1,000 nodes.
        from kubernetes import client as k8s
        from zerolayer import kubeaccess
        custom = k8s.CustomObjectsApi(kubeaccess.api_client(str(cluster.kubeconfig)))
        group, version = API.split("/")

        def beat(name: str) -> None:
            now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            custom.patch_cluster_custom_object_status(group, version, "inferencenodes", name,
                                                      {"status": {"lastHeartbeat": now}})

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            beats: list[concurrent.futures.Future] = []
            kubectl_apply(cluster, secrets + inodes + tenants, after=lambda chunk: beats.extend(
                pool.submit(beat, d["metadata"]["name"]) for d in chunk if d["kind"] == "InferenceNode"))
            created = time.monotonic() - t0
            at_created = dispatched(cluster, schema) - base
            for done in beats:
                done.result()

        def ready_counts() -> tuple[int, int]:
            counts = []
            for plural in ("inferencenodes", "tenantquotas"):
                items = json.loads(cluster.kubectl("get", plural, "-l", label, "-o", "json", timeout=300).stdout)["items"]
                counts.append(sum(1 for o in items for c in (o.get("status") or {}).get("conditions") or ()
                                  if c["type"] == "Ready" and c["status"] == "True"))
            return counts[0], counts[1]

        deadline = t0 + args.timeout
        progress_at, last = time.monotonic(), None
        while time.monotonic() < deadline:
            if operator.poll() is not None:
                raise SystemExit(f"the operator exited ({operator.returncode}); see {workdir / 'operator.log'}")
            ready = ready_counts()
            if ready != last:
                progress_at, last = time.monotonic(), ready
            elif time.monotonic() - progress_at > 180:
                print(f"no progress for 180 s: reporting what was reached; see {workdir / 'operator.log'}",
                      file=sys.stderr, flush=True)
                break
            print(f"  t={time.monotonic() - t0:6.1f}s ready InferenceNodes {ready[0]}/{args.nodes}, "
                  f"TenantQuotas {ready[1]}/{args.tenants}", flush=True)
            if ready == (args.nodes, args.tenants):
                break
            time.sleep(5)
        converged = time.monotonic() - t0
        if ready != (args.nodes, args.tenants):
            print("did not converge before --timeout", file=sys.stderr)
        total = dispatched(cluster, schema) - base
        cpu, rss = proc_usage(operator.pid)
        own = own_requests(metrics_port)

        idle_base, own_base = dispatched(cluster, schema), sum(own.values())
        cpu_base = cpu
        spy = subprocess.Popen(["py-spy", "record", "-p", str(operator.pid), "-d", str(int(args.idle)), "-r", "100",
                                "--format", "raw", "--nonblocking", "-o", args.profile],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) if args.profile else None
        time.sleep(args.idle)
        if spy is not None:
            spy.wait(timeout=60)
        idle = dispatched(cluster, schema) - idle_base
        own_after = own_requests(metrics_port)
        own_idle = sum(own_after.values()) - own_base
        idle_kinds = {k: n - own.get(k, 0) for k, n in own_after.items() if n - own.get(k, 0) > 0}
        cpu_idle = proc_usage(operator.pid)[0] - cpu_base

        objects = args.nodes + args.tenants
        floor = args.nodes * (6 + 1 + 2) + args.tenants * (3 + 1)  # children + label + ~status writes
        floor8 = args.nodes * (8 + 1 + 2) + args.tenants * (3 + 1)  # with the 8 children really made
        full_read = args.nodes * 8 + args.tenants * 4  # GETs of one reconcile per object
        rows = [
            ("objects", f"{args.nodes} InferenceNodes on {args.nodes} kwok nodes + {args.tenants} TenantQuotas"),
            ("created by kubectl in", f"{created:.1f} s"),
            ("time until all Ready", f"{converged:.1f} s ({objects / converged:.1f} objects/s)"
                                     if ready == (args.nodes, args.tenants) else
                                     f"NOT ALL READY: {ready[0]}/{args.nodes} InferenceNodes, {ready[1]}/{args.tenants} "
                                     f"TenantQuotas when the bench stopped waiting at {converged:.0f} s"),
            ("Ready after the last object was created", f"{converged - created:.1f} s (first heartbeats written as each chunk was created)"),
            ("API requests to converge (API server count)", f"{total:.0f} ({total / objects:.1f} per object; "
                                                            f"{total / floor:.2f}x the write floor {floor}; "
                                                            f"{total / floor8:.2f}x {floor8} with 8 children)"),
            ("  of which while kubectl was still creating", f"{at_created:.0f}"),
            ("  of which the operator's own client", ", ".join(f"{k} {v:.0f}" for k, v in sorted(by_verb(own).items()))),
            ("  the same by verb and resource", ", ".join(f"{v} {r} {n:.0f}" for (v, r), n in sorted(own.items()))),
            ("  of which kopf (API server count less own client)", f"{total - sum(own.values()):.0f} (its watches, "
                                                                    "finalizer patches, retry touches)"),
            (f"API requests while idle, {args.idle:.0f} s", f"{idle:.0f} ({idle / args.idle:.3f}/s; own client "
                                                            f"{own_idle:.0f}; the full resync, one read of every "
                                                            f"object per {args.resync:.0f} s, would add "
                                                            f"{full_read / args.resync:.3f}/s)"),
            ("  own client while idle, by verb and resource", ", ".join(f"{v} {r} {n:.0f}" for (v, r), n
                                                                        in sorted(idle_kinds.items())) or "none"),
            ("operator CPU to converge", f"{cpu:.1f} s ({cpu / converged * 100:.0f}% of one core)"),
            ("operator CPU while idle", f"{cpu_idle:.2f} s ({cpu_idle / args.idle * 100:.2f}% of one core)"),
            ("operator peak RSS", f"{rss:.0f} MiB"),
            ("full resync interval", f"{args.resync:.0f} s (+ up to 20 % jitter); no per-object timers"),
        ]
        report(rows, args)  # before cleanup, which can take minutes on a loaded machine
    finally:
        if operator is not None and started:
            # The cluster goes away with everything in it: no object-by-object cleanup.
            operator.terminate()
            operator.wait(timeout=60)
        elif operator is not None:
            try:
                print("cleaning up (the operator's finalizers run) ...", flush=True)
                cluster.kubectl("delete", "inferencenodes,tenantquotas", "-l", label, "--wait=false", check=False,
                                timeout=900)
                deadline = time.monotonic() + 600
                while time.monotonic() < deadline and cluster.kubectl(
                        "get", "inferencenodes,tenantquotas", "-l", label, "-o", "name", check=False,
                        timeout=300).stdout.strip():
                    time.sleep(5)
            finally:
                operator.terminate()
                operator.wait(timeout=60)
        def quietly(*argv: str) -> str:
            try:
                return cluster.kubectl(*argv, check=False, timeout=600).stdout
            except subprocess.TimeoutExpired:
                print(f"cleanup: kubectl {' '.join(argv[:3])} timed out", file=sys.stderr)
                return ""
        for obj in ([] if started else quietly("get", "inferencenodes,tenantquotas", "-l", label, "-o", "name").split()):
            quietly("patch", obj, "--type=merge", "-p", '{"metadata":{"finalizers":null}}')
        if started:
            cluster.down(quiet=True)
        else:
            quietly("delete", "flowschema", schema, "--ignore-not-found")
            quietly("delete", "clusterrolebinding", schema, "--ignore-not-found")
            quietly("delete", "node", *node_names, "--wait=false")
            quietly("delete", "namespace", ns, "--wait=false")

    return 0


if __name__ == "__main__":
    sys.exit(main())
