"""``zerolayer runtime --api-processes N`` as a user runs it: N processes on one port, one admission
view, one vLLM engine core, one metrics page, and a clean stop (docs/api-processes.md).

The synthetic engine holds each admitted stream open (``ttft_ms``) so that a tenant's
``max_concurrent_streams`` is tested while streams are open on both processes; the real tiny vLLM
shows that the processes are clients of one engine core (one ``EngineCore`` process)."""

from __future__ import annotations

import concurrent.futures
import os
import pathlib
import signal
import subprocess
import sys

import pytest
from apiprocs_helpers import REPO, Node, chat_counts, free_port, post, write_config

@pytest.mark.integration
@pytest.mark.timeout(180)
def test_a_tenants_concurrency_holds_across_processes_and_the_node_stops_cleanly(tmp_path) -> None:
    port = free_port()
    config = write_config(tmp_path, {"kind": "synthetic", "output_tokens": 4, "ttft_ms": 1500}, port,
                          max_concurrent_streams=3)
    node = Node(config, port, 2)
    try:
        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            codes = sorted(r.status_code for r in pool.map(lambda _: post(node.url), range(12)))
        assert codes.count(200) == 3 and codes.count(429) == 9, codes  # three streams on the node, not per process
        # Both processes serve: sequential requests on new connections reach each (SO_REUSEPORT hashing).
        for _ in range(60):
            if len(chat_counts(node.metrics())) == 2:
                break
            assert post(node.url).status_code == 200
        page = node.metrics()
        assert set(chat_counts(page)) == {"0", "1"}, page
        assert page.count("# TYPE zerolayer_requests_total counter") == 1  # one family, samples of both processes
        pids = [pid for pid, comm in node.children() if comm.startswith("python")]
        assert len(pids) >= 2
    finally:
        status = node.stop()
    assert status == 0, node.output()
    assert not node.children()


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_one_api_process_dying_stops_the_node(tmp_path) -> None:
    port = free_port()
    node = Node(write_config(tmp_path, {"kind": "synthetic"}, port), port, 2)
    try:
        victim = next(pid for pid, comm in node.children() if comm.startswith("python")
                      and b"spawn_main" in pathlib.Path(f"/proc/{pid}/cmdline").read_bytes())
        os.kill(victim, signal.SIGKILL)
        assert node.proc.wait(60) != 0  # the pod restarts, as vllm serve's does when an API server dies
    finally:
        node.stop()
    assert not node.children()


@pytest.mark.integration
def test_refused_configs_name_the_field(tmp_path) -> None:
    config = write_config(tmp_path, {"kind": "synthetic"}, free_port())
    out = subprocess.run([sys.executable, "-m", "zerolayer.cli", "runtime", "--config", str(config),
                          "--api-processes", "0"], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.returncode == 2 and "server.api_processes: an integer from 1 to 64" in out.stderr
