"""The fleet-wide quota bound and billing across nodes: 3 in-cluster runtimes, 50 concurrent clients, one tenant.

    python bench/fleet_quota.py [--clients 50] [--duration 90] [--tokens-per-minute 6000]
                                [--requests-per-minute 600] [--max-tokens 32]

Each runtime (local process, synthetic engine) journals its token events (``--audit-spool``,
``--audit-journal``) and has its own auditor (journal source, its own store, ``--tenant-quotas``,
``--node-name``) that publishes usage into ``TenantQuota.status.usage.nodes.<node>``. ``--clients``
threads send requests round-robin over the runtimes as fast as they are admitted (a refused client
waits ``retry-after-ms``, at most 1 s). Halfway through, runtime 0 is restarted (SIGTERM, started
again) while the window is open. Reported:

- the tokens served (the responses' usage) and the requests served in the worst 60-second window
  against the limits (a request is admitted between send and answer: the worst window is reported
  counting each request at its send time and at its answer time), the latency, the split per
  runtime, and what per-node quotas would allow (3 x the limit);
- refusals by reason;
- billed tokens: ``status.usage`` (the fleet sum of the per-node entries) against the tokens served,
  per node and in total, once the auditors have published.

The cluster is reused when running (``ZEROLAYER_STATE``), else brought up and taken down again.
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import subprocess
import sys
import tempfile
import threading
import time
import uuid

import httpx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from tests.e2e.runtime_fleet import (RuntimeProcess, inference_node, key_entry, keys_secret,  # noqa: E402
                                     tenant_quota)
from zerolayer.cluster.local import LocalCluster  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def worst_window(events: list[tuple[float, int]], window: float = 60.0) -> int:
    """The largest sum of amounts over events inside any ``window`` seconds."""
    events = sorted(events)
    best = total = lo = 0
    for t, amount in events:
        total += amount
        while t - events[lo][0] >= window:
            total -= events[lo][1]
            lo += 1
        best = max(best, total)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--duration", type=float, default=90.0)
    ap.add_argument("--tokens-per-minute", type=int, default=6000)
    ap.add_argument("--requests-per-minute", type=int, default=600)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()

    cluster = LocalCluster(log=lambda m: print(f"[cluster] {m}", flush=True))
    started = cluster.up() == "started"
    repo = pathlib.Path(__file__).resolve().parents[1]
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(repo / "crds"))
    run = uuid.uuid4().hex[:5]
    ns, tenant, key = f"zl-fq-{run}", f"fq-{run}", f"sk-fq-{run}"
    nodes = [f"zl-fq-{run}-n{i}" for i in range(3)]
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="zl-fq-"))
    kubeconfig = str(cluster.kubeconfig)
    cluster.kubectl("create", "namespace", ns)
    docs = [inference_node(n, run) for n in nodes] + [
        tenant_quota(tenant, run, ns, tokensPerMinute=args.tokens_per_minute,
                     requestsPerMinute=args.requests_per_minute, prices={"inputPer1kTokens": "0.01",
                                                                        "outputPer1kTokens": "0.02"}),
        keys_secret(ns, {tenant: key_entry(tenant, [key])})]
    cluster.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}))
    spools = [workdir / f"spool-{i}" for i in range(3)]
    runtimes, auditors = [], []
    for i, n in enumerate(nodes):
        spools[i].mkdir()
        runtimes.append(RuntimeProcess(kubeconfig, n, ns, workdir,
                                       extra=["--audit-spool", str(spools[i]), "--audit-journal"]))
        auditors.append(subprocess.Popen(
            [sys.executable, "-m", "zerolayer.cli", "auditor", "--source", "journal", "--spool", str(spools[i]),
             "--db", str(workdir / f"audit-{i}.db"), "--tenant-quotas", "--node-name", n, "--status-interval", "2",
             "--kubeconfig", kubeconfig, "--log-level", "WARNING"],
            stdout=subprocess.DEVNULL, stderr=open(workdir / f"auditor-{i}.log", "w")))
    body = json.dumps({"model": "synth", "max_tokens": args.max_tokens,
                       "messages": [{"role": "user", "content": "count the tokens of the fleet"}]})
    served: list[tuple[float, int, int, float]] = []  # (sent at, runtime, tokens, answered at)
    refused: collections.Counter[str] = collections.Counter()
    lock = threading.Lock()
    stop = threading.Event()

    def client(i: int) -> None:
        with httpx.Client(timeout=30) as http:
            n = 0
            while not stop.is_set():
                index = (i + n) % 3
                n += 1
                sent = time.monotonic()
                try:
                    resp = http.post(f"{runtimes[index].url}/v1/messages", content=body, headers={"x-api-key": key})
                except httpx.HTTPError:
                    with lock:
                        refused["connection"] += 1
                    stop.wait(0.2)
                    continue
                if resp.status_code == 200:
                    usage = resp.json()["usage"]
                    with lock:
                        served.append((sent, index, usage["input_tokens"] + usage["output_tokens"],
                                       time.monotonic()))
                else:
                    reason = resp.headers.get("x-zerolayer-reason") or str(resp.status_code)
                    try:
                        reason = resp.json()["error"].get("code", reason)
                    except (ValueError, KeyError, AttributeError):
                        pass
                    with lock:
                        refused[f"{resp.status_code} {reason}"] += 1
                    stop.wait(min(1.0, float(resp.headers.get("retry-after-ms", "200")) / 1000))

    rows: list[tuple[str, str]] = []
    try:
        for r in runtimes:
            r.start()
        for r in runtimes:
            r.wait_serving(300)
        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.clients)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        time.sleep(args.duration / 2)
        runtimes[0].stop()  # a rolling restart mid-window
        runtimes[0].start()
        runtimes[0].wait_serving(300)
        restarted_at = time.monotonic() - t0
        time.sleep(max(0.0, args.duration - (time.monotonic() - t0)))
        stop.set()
        for t in threads:
            t.join(60)
        elapsed = time.monotonic() - t0
        served_tokens = sum(x[2] for x in served)
        latencies = sorted(x[3] - x[0] for x in served)
        # billing: wait until the auditors' published sum stops moving (or 90 s)
        billed, per_node, stable_since, last = 0, {}, time.monotonic(), None
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            quota = json.loads(cluster.kubectl("get", "tenantquota", tenant, "-o", "json").stdout)
            usage = (quota.get("status") or {}).get("usage") or {}
            billed = int(usage.get("inputTokensTotal", 0)) + int(usage.get("outputTokensTotal", 0))
            per_node = {n: int(e.get("inputTokensTotal", 0)) + int(e.get("outputTokensTotal", 0))
                        for n, e in (usage.get("nodes") or {}).items()}
            if billed != last:
                last, stable_since = billed, time.monotonic()
            if billed == served_tokens or time.monotonic() - stable_since > 20:
                break
            time.sleep(1)
        claims = ((quota.get("status") or {}).get("fleetQuota") or {}).get("nodes") or {}
        # Admission happens between send and answer: count each request at both ends and report both.
        by_send = worst_window([(t, tok) for t, _, tok, _ in served])
        by_answer = worst_window([(a, tok) for _, _, tok, a in served])
        requests_by_send = worst_window([(t, 1) for t, _, _, _ in served])
        requests_by_answer = worst_window([(a, 1) for _, _, _, a in served])
        per_runtime = collections.Counter()
        for _, idx, tok, _ in served:
            per_runtime[nodes[idx]] += tok
        rows = [
            ("clients, runtimes, duration", f"{args.clients}, 3, {elapsed:.0f} s (runtime 0 restarted at "
                                            f"{restarted_at:.0f} s)"),
            ("limit: tokens / requests per minute", f"{args.tokens_per_minute} / {args.requests_per_minute}"),
            ("worst 60-s window: tokens served", f"{by_send} by send time, {by_answer} by answer time "
                                                 f"({max(by_send, by_answer) / args.tokens_per_minute:.3f} of the "
                                                 f"limit at most; per-node quotas would allow "
                                                 f"{3 * args.tokens_per_minute})"),
            ("worst 60-s window: requests served", f"{requests_by_send} by send time, {requests_by_answer} by "
                                                   f"answer time (limit {args.requests_per_minute})"),
            ("request latency p50 / p99 (s)", f"{latencies[len(latencies) // 2]:.2f} / "
                                              f"{latencies[int(len(latencies) * 0.99)]:.2f}"),
            ("tokens served in total", f"{served_tokens} in {len(served)} requests "
                                       f"over {elapsed:.0f} s (a sliding window lets a run longer than one window exceed the limit in total)"),
            ("served per runtime (tokens)", ", ".join(f"{n}: {per_runtime[n]}" for n in nodes)),
            ("refused", ", ".join(f"{k}: {v}" for k, v in refused.most_common()) or "none"),
            ("billed tokens (status.usage fleet sum)", f"{billed} ({'equal to' if billed == served_tokens else 'NOT equal to'}"
                                                      f" served {served_tokens})"),
            ("billed per node (status.usage.nodes)", ", ".join(f"{n}: {per_node.get(n, 0)}" for n in nodes)),
            ("claims at the end (status.fleetQuota)", ", ".join(f"{n}: {c.get('tokens', 0)} tokens/"
                                                               f"{c.get('requests', 0)} requests"
                                                               for n, c in sorted(claims.items()))),
        ]
    finally:
        stop.set()
        for r in runtimes:
            r.stop()
        for a in auditors:
            a.terminate()
            try:
                a.wait(30)
            except subprocess.TimeoutExpired:
                a.kill()
        cluster.kubectl("delete", "tenantquota", tenant, "--wait=false", check=False)
        cluster.kubectl("delete", "inferencenodes", *nodes, "--wait=false", check=False)
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
        if started:
            cluster.down(quiet=True)
    width = max(len(k) for k, _ in rows)
    table = "| measure | value |\n|---|---|\n" + "\n".join(f"| {k.ljust(width)} | {v} |" for k, v in rows)
    print("\n" + table)
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "fleet_quota.md"
    out.write_text(f"# Fleet-wide quota and billing across nodes ({time.strftime('%Y-%m-%d', time.gmtime())}, local "
                   f"control plane, 2 CPU cores shared with other work)\n\n`python bench/fleet_quota.py --clients "
                   f"{args.clients} --duration {args.duration:g} --tokens-per-minute {args.tokens_per_minute} "
                   f"--requests-per-minute {args.requests_per_minute} --max-tokens {args.max_tokens}`\n\n{table}\n")
    print(f"\nwritten to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
