"""The runtimes' load on the API server: N in-cluster runtimes (local processes, synthetic engine), idle and
while tenants churn.

    python bench/runtime_api_load.py [--runtimes 10,25,50] [--tenants 100] [--idle 60] [--churn 60]

For each N: N InferenceNodes, ``--tenants`` TenantQuotas and their entries in ``zl-tenant-keys`` (written
by this script, which plays the operator), then N ``zerolayer runtime --node-name`` processes that
authenticate as one ServiceAccount. A FlowSchema matching only that account makes the API server count
the runtimes' requests apart (``apiserver_flowcontrol_dispatched_requests_total``; a watch counts once,
when it starts). Measured after start-up settles:

- idle: requests/s over ``--idle`` seconds, and by verb and resource (``apiserver_request_total`` for
  the zerolayer resources and Secrets; every client, but nothing else touches them here);
- churn: the same over ``--churn`` seconds while the script changes one tenant per second (create
  a TenantQuota + its key entry, edit a quota, delete one, in turn), and how long the last new
  tenant's key took to be accepted by every runtime;
- the runtime processes' CPU over the idle period.

Before issue 16 a runtime polled (runtime/node/incluster.py at 936c2e1): LIST TenantQuotas and GET the key
Secret every 10 s, GET its InferenceNode every 10 s, and re-LISTed every InferenceNode each 60 s, i.e.
0.33 requests/s per runtime whatever happened; the table shows that figure beside the measured one.
The cluster is reused when running (``ZEROLAYER_STATE``), else brought up and taken down again.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile
import time
import uuid

import httpx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from tests.e2e.runtime_fleet import (RuntimeProcess, api_metrics, dispatched, inference_node,  # noqa: E402
                                     key_entry, requests_by, runtime_identity, tenant_quota)
from zerolayer.cluster.local import LocalCluster  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
POLLING_RPS_PER_RUNTIME = 2 / 10 + 1 / 10 + 1 / 60  # the polling loops this issue removed (see the docstring)
RESOURCES = ("tenantquotas", "inferencenodes", "secrets")


def apply(cluster: LocalCluster, items: list[dict]) -> None:
    for i in range(0, len(items), 200):
        cluster.kubectl("apply", "-f", "-", "--server-side", "--force-conflicts", timeout=600,
                        input=json.dumps({"apiVersion": "v1", "kind": "List", "items": items[i:i + 200]}))


def cpu_seconds(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def delta(after: dict[str, float], before: dict[str, float], seconds: float) -> str:
    rows = {k: (after.get(k, 0) - before.get(k, 0)) / seconds for k in after}
    return ", ".join(f"{k} {v:.3f}" for k, v in sorted(rows.items(), key=lambda kv: -kv[1]) if v > 0) or "none"


def measure(cluster: LocalCluster, n: int, args: argparse.Namespace, run: str, workdir: pathlib.Path) -> dict:
    ns = f"zl-load-{run}-{n}"
    schema = f"zl-load-{run}-{n}"
    cluster.kubectl("create", "namespace", ns)
    kubeconfig = runtime_identity(cluster, ns, schema, workdir)
    nodes = [f"zl-load-{run}-{n}-n{i}" for i in range(n)]
    tenants = [f"ld-{run}-{n}-t{i}" for i in range(args.tenants)]
    entries = {t: key_entry(t, [f"sk-{t}"]) for t in tenants}
    apply(cluster, [inference_node(x, run) for x in nodes]
          + [tenant_quota(t, run, ns, tokensPerMinute=100000, requestsPerMinute=1000) for t in tenants]
          + [{"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
              "metadata": {"name": "zl-tenant-keys", "namespace": ns}, "data": entries}])
    runtimes = [RuntimeProcess(str(kubeconfig), x, ns, workdir) for x in nodes]
    result: dict = {"runtimes": n}
    try:
        before_start = dispatched(api_metrics(cluster), schema)
        started = time.monotonic()
        for r in runtimes:
            r.start()
        for r in runtimes:
            r.wait_serving(600)
        result["start_s"] = time.monotonic() - started
        time.sleep(args.settle)
        pids = [r.proc.pid for r in runtimes if r.proc is not None]
        # idle
        text = api_metrics(cluster)
        result["start_requests"] = dispatched(text, schema) - before_start
        d0, r0, c0, t0 = dispatched(text, schema), requests_by(text, RESOURCES), cpu_seconds(pids), time.monotonic()
        time.sleep(args.idle)
        text = api_metrics(cluster)
        idle_s = time.monotonic() - t0
        d1, r1, c1 = dispatched(text, schema), requests_by(text, RESOURCES), cpu_seconds(pids)
        result.update(idle_rps=(d1 - d0) / idle_s, idle_by=delta(r1, r0, idle_s),
                      idle_cpu=(c1 - c0) / idle_s / n)
        # churn: one tenant change per second
        t1 = time.monotonic()
        step = 0
        while time.monotonic() - t1 < args.churn:
            kind = step % 3
            if kind == 0:  # a new tenant: its TenantQuota and its key entry
                new = f"ld-{run}-{n}-new{step}"
                apply(cluster, [tenant_quota(new, run, ns)])
                cluster.kubectl("patch", "secret", "zl-tenant-keys", "-n", ns, "--type=merge", "-p",
                                json.dumps({"data": {new: key_entry(new, [f"sk-{new}"])}}))
            elif kind == 1:  # an edited quota
                cluster.kubectl("patch", "tenantquota", tenants[step % len(tenants)], "--type=merge", "-p",
                                json.dumps({"spec": {"requestsPerMinute": 1000 + step}}))
            else:  # a deleted quota
                cluster.kubectl("delete", "tenantquota", tenants[-1 - step // 3], "--wait=false")
            step += 1
            time.sleep(max(0.0, t1 + step / args.churn_rate - time.monotonic()))
        text = api_metrics(cluster)
        churn_s = time.monotonic() - t1
        d2, r2 = dispatched(text, schema), requests_by(text, RESOURCES)
        result.update(churn_rps=(d2 - d1) / churn_s, churn_by=delta(r2, r1, churn_s), changes=step)
        # propagation: one more new tenant, then its key on every runtime
        last_new = f"ld-{run}-{n}-last"
        apply(cluster, [tenant_quota(last_new, run, ns)])
        cluster.kubectl("patch", "secret", "zl-tenant-keys", "-n", ns, "--type=merge", "-p",
                        json.dumps({"data": {last_new: key_entry(last_new, [f"sk-{last_new}"])}}))
        created_at = time.monotonic()
        body = json.dumps({"model": "synth", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]})
        seen = []
        for r in runtimes:
            while True:
                code = httpx.post(f"{r.url}/v1/messages", content=body, headers={"x-api-key": f"sk-{last_new}"},
                                  timeout=10).status_code
                if code in (200, 429):  # 429: authenticated, claiming its share of the quota
                    seen.append(time.monotonic() - created_at)
                    break
                time.sleep(0.05)
        result["propagation_s"] = max(seen)
    finally:
        for r in runtimes:  # SIGTERM to all first: they drain in parallel
            if r.proc is not None and r.proc.poll() is None:
                r.proc.terminate()
        for r in runtimes:
            r.stop()
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
        cluster.kubectl("delete", "inferencenodes,tenantquotas", "-l", f"zerolayer.io/fleet-test={run}",
                        "--wait=false", check=False)
        cluster.kubectl("delete", "clusterrolebinding", schema, check=False)
        cluster.kubectl("delete", "flowschema", schema, check=False)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runtimes", default="10,25,50", help="comma-separated fleet sizes")
    ap.add_argument("--tenants", type=int, default=100)
    ap.add_argument("--settle", type=float, default=15.0, help="seconds after the last runtime serves")
    ap.add_argument("--idle", type=float, default=60.0)
    ap.add_argument("--churn", type=float, default=60.0)
    ap.add_argument("--churn-rate", type=float, default=1.0, help="tenant changes per second")
    args = ap.parse_args()
    cluster = LocalCluster(log=lambda m: print(f"[cluster] {m}", flush=True))
    started = cluster.up() == "started"
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f",
                    str(pathlib.Path(__file__).resolve().parents[1] / "crds"))
    run = uuid.uuid4().hex[:5]
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="zl-load-"))
    rows = []
    try:
        for n in (int(x) for x in args.runtimes.split(",")):
            print(f"--- {n} runtimes", flush=True)
            r = measure(cluster, n, args, run, workdir)
            print(r, flush=True)
            rows.append(r)
            write(rows, args)  # after every fleet size: a long run that is cut short keeps what it measured
    finally:
        if started:
            cluster.down(quiet=True)
    return 0


def write(rows: list[dict], args: argparse.Namespace) -> None:
    lines = ["| runtimes | start (s) | start-up requests | idle req/s (all runtimes) | idle req/s per runtime | "
             "polling before (req/s, computed) | churn req/s | churn changes | new tenant on every runtime (s) | "
             "idle CPU per runtime (% core) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['runtimes']} | {r['start_s']:.0f} | {r['start_requests']:.0f} | {r['idle_rps']:.3f} | "
                     f"{r['idle_rps'] / r['runtimes']:.4f} | {POLLING_RPS_PER_RUNTIME * r['runtimes']:.1f} | "
                     f"{r['churn_rps']:.3f} | {r['changes']} | {r['propagation_s']:.2f} | {100 * r['idle_cpu']:.1f} |")
    lines += ["", "By verb and resource (apiserver_request_total, requests/s):", ""]
    for r in rows:
        lines.append(f"- {r['runtimes']} runtimes, idle: {r['idle_by']}")
        lines.append(f"- {r['runtimes']} runtimes, churn: {r['churn_by']}")
    table = "\n".join(lines)
    print("\n" + table, flush=True)
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "runtime_api_load.md"
    out.write_text(f"# Runtimes' API load ({time.strftime('%Y-%m-%d', time.gmtime())}, local control plane, "
                   f"2 CPU cores shared with other work: CPU figures are noisy, request counts are not)\n\n"
                   f"`python bench/runtime_api_load.py --runtimes {args.runtimes} --tenants {args.tenants} "
                   f"--idle {args.idle:g} --churn {args.churn:g} --churn-rate {args.churn_rate:g}`\n\n{table}\n")
    print(f"\nwritten to {out}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
