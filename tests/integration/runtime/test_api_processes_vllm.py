"""``--api-processes 2`` with the real tiny vLLM: the API processes are clients of one engine core
(one ``EngineCore`` process), both generate on it, and the node stops cleanly (docs/api-processes.md)."""

from __future__ import annotations

import subprocess

from apiprocs_helpers import BODY, REPO, Node, chat_counts, free_port, post, write_config
from tests.vllm_marks import require_vllm, vllm_marks

require_vllm()

pytestmark = vllm_marks(timeout=420)


def descendants(pid: int) -> list[tuple[int, str]]:
    out = subprocess.run(["ps", "-eo", "pid,ppid,comm"], capture_output=True, text=True).stdout
    rows = [line.split(None, 2) for line in out.splitlines()[1:]]
    found, frontier = [], {pid}
    while frontier:
        kids = [(int(p), comm) for p, pp, comm in rows if int(pp) in frontier]
        found.extend(kids)
        frontier = {p for p, _ in kids}
    return found


def test_two_api_processes_are_clients_of_one_vllm_engine_core(tmp_path) -> None:
    from zerolayer.runtime.node import tinymodel

    model = tinymodel.generate(REPO / ".models" / "tiny-llama")
    port = free_port()
    engine = {"kind": "vllm", "model_path": str(model), "served_name": "tiny-llama", "max_model_len": 512,
              "max_num_seqs": 8, "kv_cache_memory_bytes": 32 * 1024 * 1024, "enforce_eager": True, "dtype": "float32"}
    node = Node(write_config(tmp_path, engine, port), port, 2, ready_s=300)
    try:
        engines = [pid for pid, comm in descendants(node.proc.pid) if comm.startswith("VLLM::EngineCor")]
        assert len(engines) == 1, descendants(node.proc.pid)  # one engine core, not one per API process
        body = {**BODY, "model": "tiny-llama", "max_tokens": 8}
        for _ in range(60):
            response = post(node.url, body)
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["completion_tokens"] == 8
            if len(chat_counts(node.metrics())) == 2:
                break
        assert set(chat_counts(node.metrics())) == {"0", "1"}  # both processes generated on the shared core
    finally:
        status = node.stop()
    assert status == 0, node.output()
    assert not descendants(node.proc.pid)

