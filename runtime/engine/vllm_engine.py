"""vLLM's ``AsyncLLM`` in this process: no hop between the server and the engine.

The engine is started once (vLLM spawns its engine-core processes; ~20 s on a CPU) and
serves every stream. Prompts are rendered with the model's own chat template and
tokenizer; priorities go to vLLM's priority scheduler (lower runs first). Scheduler
readings (KV-cache use, running and waiting requests) arrive every engine step through
a ``StatLoggerBase`` registered at start. vLLM is imported lazily so the rest of the
runtime works without the ``engine`` extra.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any, AsyncIterator, Sequence

from zerolayer.runtime.engine.base import ChatMessage, Delta, EngineStats, Prompt, SamplingOptions
from zerolayer.runtime.errors import EngineError


class VllmEngine:
    kind = "vllm"

    def __init__(
        self,
        model_path: str,
        *,
        served_name: str | None = None,
        max_model_len: int = 2048,
        max_num_seqs: int = 16,
        kv_cache_memory_bytes: int = 256 * 1024 * 1024,
        dtype: str = "float32",
        engine_args: dict[str, Any] | None = None,
    ) -> None:
        self.model_path = model_path
        self.models = (served_name or os.path.basename(os.path.normpath(model_path)),)
        self._args = dict(
            model=model_path,
            served_model_name=self.models[0],
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            dtype=dtype,
            enforce_eager=True,
            scheduling_policy="priority",
        )
        self._args.update(engine_args or {})
        self._llm: Any = None
        self._tokenizer: Any = None
        self._stats = EngineStats(running=0, waiting=0, kv_cache_usage=0.0)

    async def start(self) -> None:
        """Start AsyncLLM. Blocks the loop while vLLM spawns its processes: call before serving."""
        if self._llm is not None:
            return
        try:
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM
            from vllm.v1.metrics.loggers import StatLoggerBase
        except ImportError as exc:
            raise EngineError("the vllm engine needs vLLM installed (pip install 'zerolayer[engine]')") from exc

        engine = self

        class _StatsSink(StatLoggerBase):
            """Receives vLLM's scheduler stats every step; keeps the latest as EngineStats."""

            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                pass

            def record(self, scheduler_stats: Any, iteration_stats: Any, *args: Any, **kwargs: Any) -> None:
                if scheduler_stats is not None:
                    engine._stats = EngineStats(
                        running=scheduler_stats.num_running_reqs,
                        waiting=scheduler_stats.num_waiting_reqs,
                        kv_cache_usage=float(scheduler_stats.kv_cache_usage),
                    )

            def log_engine_initialized(self) -> None:
                pass

        try:
            self._llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**self._args), stat_loggers=[_StatsSink])
            self._tokenizer = self._llm.get_tokenizer()
        except Exception as exc:  # vLLM raises plain RuntimeError/ValueError for bad configs
            raise EngineError(f"vLLM failed to start with model {self.model_path!r}: {exc}") from exc

    async def close(self) -> None:
        if self._llm is not None:
            llm, self._llm = self._llm, None
            llm.shutdown()

    def ready(self) -> bool:
        return self._llm is not None and not self._llm.errored

    async def render(self, model: str, messages: Sequence[ChatMessage]) -> Prompt:
        if self._tokenizer is None:
            raise EngineError("engine not started")
        chat = [{"role": m.role, "content": m.content} for m in messages]
        tokenizer = self._tokenizer

        def _render() -> Prompt:
            text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
            ids = tokenizer.encode(text, add_special_tokens=False)
            return Prompt(text=text, token_ids=tuple(ids))

        try:
            return await asyncio.to_thread(_render)
        except Exception as exc:  # jinja or tokenizer errors on odd input
            raise EngineError(f"chat template failed: {exc}") from exc

    async def generate(
        self, prompt: Prompt, options: SamplingOptions, request_id: str, priority: int
    ) -> AsyncIterator[Delta]:
        if self._llm is None:
            raise EngineError("engine not started")
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            max_tokens=options.max_tokens,
            temperature=options.temperature,
            top_p=options.top_p,
            stop=list(options.stop) or None,
            seed=options.seed,
            output_kind=RequestOutputKind.DELTA,
        )
        try:
            async for out in self._llm.generate(
                {"prompt_token_ids": list(prompt.token_ids)}, params, request_id=request_id, priority=priority
            ):
                completion = out.outputs[0]
                finish = completion.finish_reason if out.finished else None
                yield Delta(completion.text, len(completion.token_ids), finish)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            raise EngineError(f"vLLM request {request_id} failed: {exc}") from exc

    async def abort(self, request_id: str) -> None:
        if self._llm is not None:
            await self._llm.abort(request_id)

    def stats(self) -> EngineStats:
        return self._stats
