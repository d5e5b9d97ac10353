"""``prefix_digest: kv_events`` with ``--api-processes 2`` and the real tiny vLLM (docs/api-processes.md,
"Prefix digest from vLLM's KV events"): the parent gives the one engine core ``ipc://`` event sockets,
which vLLM binds, and each API process's subscriber connects to them. Two HTTP/2 clients, each with its
own long system prompt, are served one per process (exact connection balance); each process's record,
fed by the engine's events only, then holds its chat's blocks, and the node's digest is their union.

Before this, the runtime refused the combination at start; with a subscriber in process 0 only,
process 1's record would hold nothing (a byte block is linked to token blocks by the chats its own
process rendered)."""

from __future__ import annotations

import time

import httpx

from apiprocs_helpers import KEY, REPO, Node, chat_counts, free_port, per_process, write_config
from tests.vllm_marks import require_vllm, vllm_marks

require_vllm()

pytestmark = vllm_marks(timeout=420)
MODEL = "tiny-llama"
# ~600 tokens of the tiny tokenizer each: 4 full KV blocks of vLLM's CPU block size (128), 5 byte blocks
SYSTEMS = ["zero layer " * 120, "another prompt for process one " * 40]


def test_each_api_process_s_record_holds_the_blocks_the_engine_stored_for_its_chats(tmp_path) -> None:
    from zerolayer.runtime.node import tinymodel

    model = tinymodel.generate(REPO / ".models" / MODEL)
    port = free_port()
    engine = {"kind": "vllm", "model_path": str(model), "served_name": MODEL, "max_model_len": 1024,
              "max_num_seqs": 4, "kv_cache_memory_bytes": 64 * 1024 * 1024, "enforce_eager": True,
              "dtype": "float32", "prefix_digest": "kv_events"}
    node = Node(write_config(tmp_path, engine, port), port, 2, ready_s=300)
    clients = [httpx.Client(http1=False, http2=True, timeout=60) for _ in SYSTEMS]
    try:
        for client, system in zip(clients, SYSTEMS):  # both connections open: one per process
            body = {"model": MODEL, "max_tokens": 2, "temperature": 0,
                    "messages": [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]}
            response = client.post(f"{node.url}/v1/chat/completions", json=body,
                                   headers={"authorization": f"Bearer {KEY}"})
            assert response.status_code == 200, response.text
            assert response.http_version == "HTTP/2"
        assert chat_counts(node.metrics()) == {"0": 1.0, "1": 1.0}  # each process served one chat
        deadline = time.monotonic() + 30
        while True:
            page = node.metrics()
            blocks = per_process(page, "zerolayer_prefix_digest_blocks")
            if len(blocks) == 2 and min(blocks.values()) >= 2:
                break
            assert time.monotonic() < deadline, f"the engine's events never reached both records: {blocks}"
            time.sleep(0.2)
        # Each record was fed by its own subscriber of the engine core's stream, with nothing missed.
        batches = per_process(page, "zerolayer_kv_events_batches_total")
        assert set(batches) == {"0", "1"} and min(batches.values()) >= 1, batches
        assert per_process(page, "zerolayer_kv_events_missed_total") == {"0": 0.0, "1": 0.0}
    finally:
        for client in clients:
            client.close()
        status = node.stop()
    assert status == 0, node.output()
