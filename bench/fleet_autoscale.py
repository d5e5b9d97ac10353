"""The fleet autoscaler's reaction times and its API cost per node per minute while steady, side by side
with a fixed-replica fleet under the same load.

    python bench/fleet_autoscale.py [--steady 60] [--concurrency 12]

On the local kwok control plane (reused when running, ``ZEROLAYER_STATE``), with the runtimes as local
processes and an SDK client as the load (tests/e2e/fleet_rig.py, the same rig as
tests/e2e/test_fleet_autoscale.py):

1. **autoscaled** (min 0, max 3, runningRequests target 4, up window 0 s, down window 20 s): one request
   for a fleet at zero (refused retryably by another runtime, which gossips the demand) -> the first
   InferenceNode, -> the first answer; ``--concurrency`` streams of 2 s -> 3 InferenceNodes, -> 3
   serving; ``--steady`` seconds at 3 under that load; the load stops -> 0 InferenceNodes.
2. **fixed** (replicas 3, no autoscaling): the same load for the same ``--steady`` seconds.

API cost: the operator's own requests (its ``zerolayer_operator_api_requests_total``) during the
steady period, per serving node per minute: those of the fleet reconciler (fleets, Nodes, InferenceNode
creates, deletes and lists) and all of the operator's. Writes bench/results/fleet_autoscale.md.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
import time
import uuid
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from tests.e2e.conftest import E2ECluster  # noqa: E402
from tests.e2e.fleet_rig import FleetRig, LoadClient, fleet_doc, operator_requests  # noqa: E402
from zerolayer.cluster.local import LocalCluster  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
AUTOSCALING = {"minReplicas": 0, "maxReplicas": 3, "metric": "runningRequests", "target": 4,
               "scaleUpStabilizationSeconds": 0, "scaleDownStabilizationSeconds": 20}


def timed(cluster, check, timeout: float, since: float) -> float:
    cluster.wait_for(check, timeout=timeout, interval=0.5)
    return time.monotonic() - since


def steady_cost(cluster, rig: FleetRig, seconds: float, nodes: int) -> tuple[float, float, str]:
    """(fleet reconciler, whole operator) API requests per node per minute over ``seconds``, and the
    operator's requests in that time by verb and resource."""
    fleet0, all0, by0 = rig.fleet_requests(), rig.all_requests(), operator_requests(rig.operator)
    time.sleep(seconds)
    per = 60.0 / seconds / nodes
    by = {k: v - by0.get(k, 0.0) for k, v in operator_requests(rig.operator).items() if v != by0.get(k, 0.0)}
    detail = ", ".join(f"{verb} {res} {n:g}" for (verb, res), n in sorted(by.items())) or "none"
    return (rig.fleet_requests() - fleet0) * per, (rig.all_requests() - all0) * per, detail


def autoscaled(cluster, rig: FleetRig, args) -> dict[str, Any]:
    name, model = f"auto-{rig.run}", f"tiny-{rig.run}"
    cluster.kubectl("apply", "-f", "-", input=json.dumps(fleet_doc(name, rig.run, model, autoscaling=AUTOSCALING,
                                                                   replicas=0)))
    cluster.wait_for(lambda: (rig.fleet(name).get("status") or {}).get("phase") == "Idle", timeout=60)
    load = LoadClient(cluster, rig.key, model, rig.selector, workers=args.concurrency)
    out: dict[str, Any] = {}
    try:
        cluster.wait_for(lambda: rig.other in {n.name for n in load.node_map.nodes()}, timeout=30)
        start = time.monotonic()
        load.concurrency = 1
        out["demand"] = timed(cluster, lambda: rig.members(name), 60, start)
        out["first_answer"] = timed(cluster, lambda: load.outcomes, 150, start)
        start = time.monotonic()
        load.concurrency = args.concurrency
        out["up_created"] = timed(cluster, lambda: len(rig.members(name)) == 3, 90, start)
        out["up_serving"] = timed(cluster, lambda: len(rig.serving(name)) == 3, 150, start)
        time.sleep(5)
        out["fleet_cost"], out["all_cost"], out["detail"] = steady_cost(cluster, rig, args.steady, 3)
        start = time.monotonic()
        load.concurrency = 0
        out["down_zero"] = timed(cluster, lambda: not rig.members(name), 240, start)
    finally:
        load.close()
    out["lost"] = sum(1 for o in load.outcomes if not o.ok)
    out["requests"] = len(load.outcomes)
    return out


def fixed(cluster, rig: FleetRig, args) -> dict[str, Any]:
    name, model = f"fixed-{rig.run}", f"fixed-{rig.run}"
    cluster.kubectl("apply", "-f", "-", input=json.dumps(fleet_doc(name, rig.run, model, autoscaling=None,
                                                                   replicas=3)))
    cluster.wait_for(lambda: len(rig.serving(name)) == 3, timeout=180)
    load = LoadClient(cluster, rig.key, model, rig.selector, workers=args.concurrency)
    try:
        cluster.wait_for(lambda: len([n for n in load.node_map.nodes() if n.name in rig.serving(name)]) == 3, 60)
        load.concurrency = args.concurrency
        time.sleep(5)
        fleet_cost, all_cost, detail = steady_cost(cluster, rig, args.steady, 3)
    finally:
        load.close()
    return {"fleet_cost": fleet_cost, "all_cost": all_cost, "detail": detail,
            "lost": sum(1 for o in load.outcomes if not o.ok), "requests": len(load.outcomes)}


def report(a: dict[str, Any], f: dict[str, Any], args, elapsed: float) -> str:
    def s(v: float | None) -> str:
        return "-" if v is None else f"{v:.1f} s"

    rows = [
        ("first request for a fleet at 0 -> its InferenceNode exists", s(a["demand"]), "-"),
        ("first request -> first answer (SDK waiting on MODEL_UNAVAILABLE)", s(a["first_answer"]), "-"),
        (f"load ({args.concurrency} streams) -> 3 InferenceNodes exist", s(a["up_created"]), "-"),
        ("load -> 3 runtimes serving", s(a["up_serving"]), "-"),
        ("load stops -> 0 InferenceNodes (down window 20 s)", s(a["down_zero"]), "-"),
        (f"steady {args.steady:g} s at 3 nodes: fleet reconciler API requests / node / min",
         f"{a['fleet_cost']:.2f}", f"{f['fleet_cost']:.2f}"),
        ("steady: all operator API requests / node / min", f"{a['all_cost']:.2f}", f"{f['all_cost']:.2f}"),
        ("requests sent / lost", f"{a['requests']:g} / {a['lost']:g}", f"{f['requests']:g} / {f['lost']:g}"),
    ]
    width = max(len(r[0]) for r in rows)
    lines = [f"{'':<{width}}  {'autoscaled (0..3)':>18}  {'fixed (3)':>10}"]
    lines += [f"{r[0]:<{width}}  {r[1]:>18}  {r[2]:>10}" for r in rows]
    lines += [f"steady, operator requests by verb and resource: autoscaled: {a['detail']}",
              f"                                                fixed: {f['detail']}"]
    return "\n".join(lines) + f"\n(run took {elapsed:.0f} s)"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steady", type=float, default=60.0)
    ap.add_argument("--concurrency", type=int, default=12)
    args = ap.parse_args()
    local = LocalCluster(log=lambda m: print(f"[cluster] {m}", flush=True))
    started = local.up() == "started"
    repo = pathlib.Path(__file__).resolve().parents[1]
    local.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(repo / "crds"))
    cluster = E2ECluster(local)
    rig = FleetRig(cluster, uuid.uuid4().hex[:6], pathlib.Path(tempfile.mkdtemp(prefix="zl-fa-"))).up()
    t0 = time.monotonic()
    try:
        cluster.wait_for(lambda: rig.other in rig.supervisor.serving_at, timeout=120)
        a = autoscaled(cluster, rig, args)
        f = fixed(cluster, rig, args)
    finally:
        rig.down()
        if started:
            local.down(quiet=True)
    text = report(a, f, args, time.monotonic() - t0)
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "fleet_autoscale.md").write_text(
        "# Fleet autoscaler: reaction times and API cost while steady\n\n"
        f"`python bench/fleet_autoscale.py --steady {args.steady:g} --concurrency {args.concurrency}` on the local "
        "kwok control plane, runtimes as local processes (synthetic engine, 2 s a request), this shared 2-core "
        f"machine, {time.strftime('%Y-%m-%d', time.gmtime())}.\n\n```\n{text}\n```\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
