"""Issue 25 on the kwok fleet, runtimes as local processes (tests/e2e/fleet_rig.py): a model change of an
InferenceFleet with ``rollout: {maxSurge: 1, maxUnavailable: 0}`` surges. The new InferenceNode is placed
on a spare Node while the old one serves; the old one is deleted only after the new one is Ready (the
API server's own timestamps say so); two streams started on the old runtime before the change, one from
the official Anthropic SDK (HTTP/1.1) and one from zerolayer's own SDK (HTTP/2, through httpx), are still
running when its InferenceNode is deleted and complete (the runtime drains on SIGTERM, as a pod does, and
sends its HTTP/2 GOAWAY only once a connection's streams have ended: docs/runtime.md, "Drain").
"""

from __future__ import annotations

import datetime
import json
import threading
import time

import pytest

from tests.e2e.fleet_rig import PACE, FleetRig, fleet_doc
from tests.e2e.operator_harness import new_run_id

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]
# At the rig's pace (20 tokens/s) 500 tokens take 25 s: longer than the surge takes here (the old
# InferenceNode went 5 s after the change), and what is left after that fits the 60 s drain the fleet
# grants and the supervisor's 30 s wait for a stopped runtime (a pod's grace period).
STREAM_TOKENS = 500


@pytest.fixture
def rig(cluster, tmp_path):
    cluster.wait_established("inferencefleets.zerolayer.io")
    rig = FleetRig(cluster, new_run_id(), tmp_path)
    # The rig's runtimes answer 40 tokens at most; this test's stream needs a longer answer, same pace.
    rig.supervisor.config.write_text(json.dumps({"engine": {**PACE, "output_tokens": 4 * STREAM_TOKENS}}))
    rig.up()
    try:
        yield rig
    finally:
        rig.down()


def when(text: str | None) -> float | None:
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp() if text else None


def ready_since(inode: dict) -> float | None:
    found = next((c for c in (inode.get("status") or {}).get("conditions") or () if c["type"] == "Ready"), {})
    return when(found.get("lastTransitionTime")) if found.get("status") == "True" else None


class Stream:
    """One streamed request to one runtime in a thread: its end, stop reason and token count. ``sdk`` is
    ``"anthropic"`` (the official SDK over HTTP/1.1, as its users connect) or ``"zerolayer"`` (this
    project's SDK, HTTP/2 prior knowledge through httpx, retries off so a cut stream shows)."""

    def __init__(self, url: str, key: str, model: str, sdk: str = "anthropic") -> None:
        self.url, self.key, self.model, self.sdk, self.first_token = url, key, model, sdk, threading.Event()
        self.stop_reason, self.output_tokens, self.error, self.ended = None, None, None, None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            if self.sdk == "zerolayer":
                self._zerolayer()
            else:
                self._anthropic()
        except Exception as exc:  # noqa: BLE001 - reported by the test
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.ended = time.time()
            self.first_token.set()

    def _anthropic(self) -> None:
        import anthropic

        with anthropic.Anthropic(base_url=self.url, api_key=self.key, max_retries=0, timeout=120) as client:
            with client.messages.stream(model=self.model, max_tokens=STREAM_TOKENS,
                                        messages=[{"role": "user", "content": "a long answer"}]) as stream:
                for event in stream:
                    if event.type == "content_block_delta":
                        self.first_token.set()
                final = stream.get_final_message()
        self.stop_reason, self.output_tokens = final.stop_reason, final.usage.output_tokens

    def _zerolayer(self) -> None:
        from zerolayer.client import Client

        with Client(api_key=self.key, base_url=self.url, max_retries=0, timeout=120, deadline=120) as client:
            stream = client.messages.create(model=self.model, max_tokens=STREAM_TOKENS, stream=True,
                                            messages=[{"role": "user", "content": "a long answer"}])
            with stream:
                for event in stream:
                    if event.get("type") == "content_block_delta":
                        self.first_token.set()
                    elif event.get("type") == "message_delta":
                        self.stop_reason = event["delta"]["stop_reason"]
                        self.output_tokens = event["usage"]["output_tokens"]


def test_a_model_change_surges_onto_a_spare_node_and_a_running_stream_completes(cluster, rig):
    name, model = f"roll-{rig.run}", f"tiny-{rig.run}"
    doc = fleet_doc(name, rig.run, model, autoscaling=None, replicas=1)
    doc["spec"]["rollout"] = {"maxSurge": 1, "maxUnavailable": 0}
    doc["spec"]["runtime"]["drainSeconds"] = 60
    cluster.kubectl("apply", "-f", "-", input=json.dumps(doc))

    def inodes() -> dict[str, dict]:
        items = cluster.kubectl_json("get", "inferencenodes", "-l", f"zerolayer.io/fleet={name}")["items"]
        return {x["metadata"]["name"]: x for x in items}

    [old] = cluster.wait_for(lambda: (n := inodes()) and len(n) == 1 and all(map(ready_since, n.values()))
                             and list(n), timeout=120, what="the fleet's first InferenceNode Ready")
    cluster.wait_for(lambda: old in rig.supervisor.serving_at, timeout=60, what="its runtime serving")
    old_node = inodes()[old]["spec"]["nodeName"]

    url = rig.supervisor.runtimes[old].url
    streams = [Stream(url, rig.key, model, "anthropic"), Stream(url, rig.key, model, "zerolayer")]
    for stream in streams:
        stream.thread.start()
    for stream in streams:
        assert stream.first_token.wait(60) and stream.error is None, (stream.sdk, stream.error)

    changed = time.time()
    cluster.kubectl("patch", "inferencefleet", name, "--type=json", "-p", json.dumps(
        [{"op": "replace", "path": "/spec/models/0/source/path", "value": "/none-v2"}]))
    seen: dict[str, dict] = {}
    old_alive = changed  # the last time the old InferenceNode was seen not being deleted

    def rolled() -> bool:
        nonlocal old_alive
        asked, now = time.time(), inodes()
        seen.update(now)
        if old in now and not now[old]["metadata"].get("deletionTimestamp"):
            old_alive = asked
        new = [x for n, x in now.items() if n != old and ready_since(x)]
        return bool(new) and old not in now
    cluster.wait_for(rolled, timeout=180, interval=0.3, what="the new InferenceNode Ready and the old one gone")
    [new] = [n for n in seen if n != old]
    # The deletion came after old_alive (and its deletionTimestamp, when a poll saw one, says when).
    new_ready = ready_since(seen[new])
    old_deleted = when(seen[old]["metadata"].get("deletionTimestamp")) or old_alive
    for stream in streams:
        stream.thread.join(90)

    print(f"\nsurge rollout (maxSurge 1, maxUnavailable 0), seconds after the fleet's model changed:\n"
          f"  new InferenceNode {new} on {seen[new]['spec']['nodeName']} Ready: {new_ready - changed:6.1f}\n"
          f"  old InferenceNode {old} on {old_node} deleted:   {old_deleted - changed:6.1f}\n"
          + "".join(f"  {s.sdk + ' SDK stream started before the change ended:':48}{s.ended - changed:6.1f} "
                    f"({s.output_tokens} tokens, {s.stop_reason}, {s.error or 'no error'})\n" for s in streams))
    assert seen[new]["spec"]["nodeName"] != old_node and seen[new]["spec"]["models"][0]["source"]["path"] == "/none-v2"
    assert new_ready is not None and old_deleted is not None
    assert old_alive >= new_ready  # the old one was still there when the new one was Ready: deleted after
    for stream in streams:
        assert stream.error is None, (stream.sdk, stream.error)
        assert stream.stop_reason == "max_tokens" and stream.output_tokens == STREAM_TOKENS, stream.sdk
        assert stream.ended > old_deleted, stream.sdk  # still streaming when its InferenceNode was deleted


def test_a_fleet_refuses_max_surge_and_max_unavailable_both_zero(cluster, rig):
    doc = fleet_doc(f"zero-{rig.run}", rig.run, f"tiny-{rig.run}", autoscaling=None, replicas=1)
    doc["spec"]["rollout"] = {"maxSurge": 0, "maxUnavailable": 0}
    out = cluster.kubectl("apply", "-f", "-", input=json.dumps(doc), check=False)
    assert out.returncode != 0 and "maxSurge and maxUnavailable cannot both be 0" in out.stderr
