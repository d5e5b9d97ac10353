"""The publisher thread against a recording sink (a test double of our own StatusSink, no cluster)
and the Kubernetes module against an API server that is not there."""

from __future__ import annotations

import io
import json
import socket
import threading
import time

import pytest

from zerolayer.runtime.gossip import GossipPublisher, GossipSettings, KubeApiError, Load, PrintSink, RecordingSource
from zerolayer.runtime.gossip.kube import NodeApi
from zerolayer.runtime.gpu.simulated import SimulatedGpuSource

pytestmark = pytest.mark.timeout(30)


class RecordingSink:
    """Test double for StatusSink: keeps every patched status; can be told to fail."""

    def __init__(self, spec: dict | None = None) -> None:
        self.spec = spec or {}
        self.patches: list[dict] = []
        self.fail = False
        self.changed = threading.Condition()

    def get(self, name):
        if self.fail:
            raise KubeApiError("test double: API down")
        return {"metadata": {"name": name}, "spec": self.spec}

    def patch_status(self, name, status):
        if self.fail:
            raise KubeApiError("test double: API down")
        with self.changed:
            self.patches.append(dict(status))
            self.changed.notify_all()
        return {"metadata": {"name": name}, "spec": self.spec, "status": status}

    def wait(self, predicate, timeout=10.0):
        with self.changed:
            assert self.changed.wait_for(lambda: predicate(self.patches), timeout), self.patches


def make(sink, source, **kwargs):
    recording = RecordingSource(source)
    publisher = GossipPublisher("node-a", sink, readings=lambda: recording.latest, load=lambda: Load(1, 0, 0.2),
                                endpoint="http://a:8443", sample_seq=lambda: recording.seq, tick_s=0.05, **kwargs)
    recording.on_sample = publisher.notify
    return recording, publisher


def test_nothing_before_the_first_sample_then_first_and_threshold_patches():
    sink = RecordingSink({"gossip": {"heartbeatSeconds": 60, "maxPatchesPerSecond": 100}})
    source = SimulatedGpuSource.constant(0.5)
    recording, publisher = make(sink, source)
    publisher.start()
    try:
        time.sleep(0.2)
        assert sink.patches == []
        recording.sample()
        sink.wait(lambda p: len(p) == 1)
        assert sink.patches[0]["admitting"] is True and sink.patches[0]["endpoint"] == "http://a:8443"
        assert publisher.state.settings.heartbeat_s == 60  # read from the spec
        source.set_memory(0.97)
        recording.sample()
        sink.wait(lambda p: len(p) == 2)
        assert sink.patches[1]["admitting"] is False
        record = publisher.history[-1]
        assert (record.reason, record.admitting, record.sample_seq) == ("admitting", False, 2)
    finally:
        publisher.stop()
    assert sink.patches[-1]["admitting"] is False and sink.patches[-1]["gpusAdmitting"] == "0/1"


def test_api_failures_are_counted_and_gossip_recovers():
    sink = RecordingSink({"gossip": {"heartbeatSeconds": 60, "maxPatchesPerSecond": 100}})
    sink.fail = True
    recording, publisher = make(sink, SimulatedGpuSource.constant(0.5))
    recording.sample()
    publisher.start()
    try:
        deadline = time.monotonic() + 10
        while publisher.failures < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert publisher.failures >= 2 and publisher.running
        assert isinstance(publisher.last_error, KubeApiError)
        sink.fail = False
        sink.wait(lambda p: len(p) >= 1)
    finally:
        publisher.stop(final=False)
    assert publisher.state.failures == 0 and publisher.patches >= 1


def test_print_sink_shows_what_would_be_patched():
    out = io.StringIO()
    source = SimulatedGpuSource.constant(0.3)
    publisher = GossipPublisher("solo", PrintSink(out), readings=source.sample, load=Load,
                                settings=GossipSettings())
    publisher.step()
    line = json.loads(out.getvalue())
    assert line["inferenceNode"] == "solo" and line["wouldPatch"]["status"]["gpusAdmitting"] == "1/1"


def test_node_api_converts_an_absent_api_server_into_kube_api_error(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed when the block ends: nothing listens there
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(f"""
apiVersion: v1
kind: Config
clusters: [{{name: c, cluster: {{server: "http://127.0.0.1:{port}"}}}}]
users: [{{name: u, user: {{token: t}}}}]
contexts: [{{name: x, context: {{cluster: c, user: u}}}}]
current-context: x
""")
    api = NodeApi(kubeconfig=str(kubeconfig), timeout_s=2)
    try:
        with pytest.raises(KubeApiError, match="unreachable") as info:
            api.patch_status("node-a", {"admitting": True})
        assert info.value.status is None
        with pytest.raises(KubeApiError):
            api.get("node-a")
    finally:
        api.close()


def test_node_api_without_configuration_is_a_kube_api_error(tmp_path):
    with pytest.raises(KubeApiError, match="no usable Kubernetes configuration"):
        NodeApi(kubeconfig=str(tmp_path / "missing"))


def test_advertised_endpoint_replaces_the_wildcard_address(monkeypatch):
    from zerolayer.runtime.node.agent import advertised_endpoint

    assert advertised_endpoint("http://127.0.0.1:8443", "127.0.0.1", 8443) == "http://127.0.0.1:8443"
    monkeypatch.setenv("POD_IP", "10.1.2.3")
    assert advertised_endpoint("https://0.0.0.0:8443", "0.0.0.0", 8443) == "https://10.1.2.3:8443"
    monkeypatch.setenv("POD_IP", "fd00::7")
    assert advertised_endpoint("http://:::8443", "::", 8443) == "http://[fd00::7]:8443"
