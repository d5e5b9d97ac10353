"""The vLLM engine's per-request hand-offs between threads (docs/benchmarks.md section 13).

Chat templates render in a pool as large as vLLM's own renderer pool, not in asyncio's default
executor; the token ids go to ``AsyncLLM.generate`` as a rendered ``TokensInput``, which vLLM checks
on the event loop instead of sending through its renderer's thread. Nothing here starts vLLM."""

from __future__ import annotations

import asyncio
import threading

import pytest

from zerolayer.runtime.engine.base import ChatMessage, Prompt
from zerolayer.runtime.engine.vllm_engine import VllmEngine, engine_input, render_pool

pytest.importorskip("vllm")


def test_render_pool_has_vllms_renderer_worker_count():
    assert render_pool({})._max_workers == 1  # vLLM's renderer_num_workers default
    assert render_pool({"renderer_num_workers": None})._max_workers == 1
    assert render_pool({"renderer_num_workers": 3})._max_workers == 3


def test_engine_input_is_a_rendered_tokens_input_vllm_takes_on_the_loop():
    made = engine_input(Prompt(text="hi", token_ids=(5, 6, 7), model="m"))
    # "type" is what AsyncLLM.generate looks for in input it need not render in its thread pool
    # (vllm/v1/engine/async_llm.py)
    assert made == {"type": "token", "prompt_token_ids": [5, 6, 7]}


class _Tokenizer:
    """Records the threads the template ran in."""

    chat_template = "{{ messages }}"

    def __init__(self) -> None:
        self.threads: set[str] = set()

    def apply_chat_template(self, chat, **kwargs) -> str:
        self.threads.add(threading.current_thread().name)
        return "rendered"

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [1, 2, 3]


async def test_concurrent_renders_share_the_one_render_thread():
    engine = VllmEngine("/models/m", served_name="m")
    engine._tokenizer = tokenizer = _Tokenizer()
    engine._render_pool = render_pool({})
    try:
        prompts = await asyncio.gather(*(engine.render("m", [ChatMessage("user", f"q{i}")]) for i in range(16)))
    finally:
        engine._render_pool.shutdown(wait=True)
    assert {p.token_ids for p in prompts} == {(1, 2, 3)}
    assert len(tokenizer.threads) == 1
    assert next(iter(tokenizer.threads)).startswith("zerolayer-render")
