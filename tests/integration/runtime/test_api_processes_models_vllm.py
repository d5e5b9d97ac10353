"""``--api-processes 2`` with several base models (``engines:``) and the real tiny vLLM: one engine core
per model, shared by both API processes, so each process serves every model (docs/api-processes.md)."""

from __future__ import annotations

import hashlib
import time

import yaml
from apiprocs_helpers import BODY, KEY, REPO, Node, chat_counts, free_port, post
from test_api_processes_vllm import descendants
from tests.vllm_marks import require_vllm, vllm_marks

require_vllm()

pytestmark = vllm_marks(timeout=600)
ENGINE = {"kind": "vllm", "max_model_len": 512, "max_num_seqs": 4, "kv_cache_memory_bytes": 32 * 1024 * 1024,
          "enforce_eager": True, "dtype": "float32"}


def answered_by(node: Node, before: dict[str, float]) -> str:
    """The API process whose chat count moved since ``before`` (the count may follow the answer by a moment)."""
    deadline = time.monotonic() + 5
    while True:
        after = chat_counts(node.metrics())
        moved = [p for p in after if after[p] != before.get(p, 0)]
        if moved or time.monotonic() > deadline:
            [process] = moved
            return process
        time.sleep(0.05)


def test_each_api_process_serves_each_model_on_that_model_s_own_engine_core(tmp_path) -> None:
    from zerolayer.runtime.node import tinymodel

    base_a = tinymodel.generate(REPO / ".models" / "tiny-llama")
    base_b = tinymodel.generate(tmp_path / "tiny-b", seed=7, init_std=0.5)
    port = free_port()
    config = tmp_path / "node.yaml"
    config.write_text(yaml.safe_dump({
        "listen": {"host": "127.0.0.1", "port": port},
        "engines": [{**ENGINE, "model_path": str(base_a), "served_name": "tiny-a"},
                    {**ENGINE, "model_path": str(base_b), "served_name": "tiny-b"}],
        "tenants": [{"name": "acme", "keys": [{"sha256": hashlib.sha256(KEY.encode()).hexdigest()}]}],
    }))
    node = Node(config, port, 2, ready_s=420)
    try:
        cores = [pid for pid, comm in descendants(node.proc.pid) if comm.startswith("VLLM::EngineCor")]
        assert len(cores) == 2, descendants(node.proc.pid)  # one per model, not one per model and process
        served: set[tuple[str, str]] = set()
        # A new connection per request, and exact balance sends them round the processes: each model twice in
        # a row reaches both.
        for model in ("tiny-a", "tiny-a", "tiny-b", "tiny-b") * 6:
            before = chat_counts(node.metrics())
            response = post(node.url, {**BODY, "model": model, "max_tokens": 4})
            assert response.status_code == 200, response.text
            assert response.json()["model"] == model
            assert response.json()["usage"]["completion_tokens"] == 4
            served.add((answered_by(node, before), model))
            if len(served) == 4:
                break
        assert served == {("0", "tiny-a"), ("1", "tiny-a"), ("0", "tiny-b"), ("1", "tiny-b")}
    finally:
        status = node.stop()
    assert status == 0, node.output()
    assert not descendants(node.proc.pid)
