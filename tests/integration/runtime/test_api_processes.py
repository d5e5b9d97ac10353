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
import threading
import time

import httpx
import yaml

import pytest
from apiprocs_helpers import BODY, KEY, REPO, Node, chat_counts, free_port, post, serve_until_both, write_config

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
        serve_until_both(node)  # sequential requests on new connections reach each process
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
@pytest.mark.timeout(180)
def test_exact_balance_gives_each_process_one_of_two_http2_clients(tmp_path) -> None:
    """Two HTTP/2 clients, each keeping one connection for all its requests (as the SDK and the official
    SDKs with http2=True do): with ``server.connection_balance: exact`` (the default) the parent hands
    the second connection to the process without one, every time; with the kernel's SO_REUSEPORT hash
    both land on one process half the time, so this fails there about once in two runs."""
    port = free_port()
    node = Node(write_config(tmp_path, {"kind": "synthetic", "output_tokens": 4}, port), port, 2)
    try:
        for round_ in range(3):
            clients = [httpx.Client(http1=False, http2=True, timeout=60) for _ in range(2)]
            try:
                for client in clients:
                    for _ in range(5):
                        response = client.post(node.url + "/v1/chat/completions", json=BODY,
                                               headers={"authorization": f"Bearer {KEY}"})
                        assert response.status_code == 200 and response.http_version == "HTTP/2"
                before = chat_counts(node.metrics())
            finally:
                for client in clients:
                    client.close()
            assert before == {"0": 5.0 * (round_ + 1), "1": 5.0 * (round_ + 1)}, before
            # the closed connections are counted out before the next round's are handed over
            time.sleep(0.3)
    finally:
        assert node.stop() == 0, node.output()


def _stream_until_preempted(url: str, words: int, ended: dict[int, float]) -> None:
    """A low-priority stream on a connection of its own; the moment its GPU_OOM error event arrives."""
    body = {**BODY, "stream": True, "max_tokens": 4000,
            "messages": [{"role": "user", "content": " ".join(["word"] * words)}]}
    headers = {"authorization": f"Bearer {KEY}", "x-zerolayer-priority": "low"}
    with httpx.Client(http1=False, http2=True, timeout=60) as client:
        with client.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if '"GPU_OOM"' in line:
                    ended[words] = time.monotonic()
                    return


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_memory_pressure_sheds_the_node_s_largest_streams_first(tmp_path) -> None:
    """Four low-priority streams on two API processes, process 0 holding the two largest. Memory then
    stays at 99 % with a budget of one preemption per sample: the node sheds them largest first (350,
    250, 150, 50 prompt words), one per sample. Each process shedding its own would cut 350 and 150
    in the first sample, and 150 would end before 250."""
    port = free_port()
    scenario = tmp_path / "pressure.yaml"
    scenario.write_text(yaml.safe_dump({"at_end": "hold", "gpus": [{"steps": [
        {"memory": 0.5, "samples": 50}, {"memory": 0.99, "samples": 1}]}]}))  # 10 s calm at 200 ms a sample
    config = write_config(tmp_path, {"kind": "synthetic", "output_tokens": 4000, "tokens_per_second": 20}, port,
                          {"gpu": {"source": "simulated", "scenario": str(scenario)},
                           "scheduler": {"max_preemptions_per_tick": 1, "preempt_after_samples": 1}})
    node = Node(config, port, 2)
    ended: dict[int, float] = {}
    try:
        threads = []
        for words in (350, 50, 250, 150):  # connections alternate: process 0 gets 350 and 250
            threads.append(threading.Thread(target=_stream_until_preempted, args=(node.url, words, ended)))
            threads[-1].start()
            time.sleep(0.2)
        for thread in threads:
            thread.join(90)
        assert sorted(ended, key=ended.get) == [350, 250, 150, 50], ended  # all four preempted, in this order
    finally:
        assert node.stop() == 0, node.output()


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_kernel_balance_still_serves_on_every_process(tmp_path) -> None:
    port = free_port()
    config = write_config(tmp_path, {"kind": "synthetic", "output_tokens": 4}, port,
                          {"server": {"connection_balance": "kernel"}})
    node = Node(config, port, 2)
    try:
        assert set(serve_until_both(node)) == {"0", "1"}
    finally:
        assert node.stop() == 0, node.output()


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
    config = write_config(tmp_path, {"kind": "synthetic"}, free_port(), {"server": {"connection_balance": "random"}})
    out = subprocess.run([sys.executable, "-m", "zerolayer.cli", "runtime", "--config", str(config),
                          "--api-processes", "2"], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.returncode == 2 and "server.connection_balance: one of exact, kernel, got 'random'" in out.stderr
