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
import dataclasses
import logging
import os
import subprocess
import sys
from typing import Any, AsyncIterator, ClassVar, Mapping, Sequence

from zerolayer.runtime.engine.base import ChatMessage, Delta, EngineStats, InputRejected, Prompt, SamplingOptions
from zerolayer.runtime.errors import ConfigError, EngineError

log = logging.getLogger(__name__)

# The reaper: a tiny process that outlives the runtime by a moment. It reads "pid starttime"
# lines on stdin; end of file means the runtime is gone (the kernel closes the pipe whatever
# killed it), and it then SIGKILLs the listed processes still alive with the same start time.
_REAPER = r"""
import os, signal, sys
for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(sig, signal.SIG_IGN)  # a group signal must not take the reaper before the runtime
def started(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except OSError:
        return None
listed = [line.split() for line in sys.stdin if line.strip()]
if listed and listed[-1] == ["release"]:  # a clean stop: the engine ended its processes itself
    listed = []
for pid, start in listed:
    if started(pid) == start:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except OSError:
            pass
"""


def _start_time(pid: int) -> str | None:
    """Field 22 of /proc/PID/stat (start time in clock ticks): a pid and its start time name one process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except OSError:
        return None


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` now (read from /proc); empty where /proc is absent."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            out.append(child)
            todo.append(child)
    return out


class ChildReaper:
    """Kills the engine's processes when this process dies, however it dies (SIGKILL included).

    vLLM starts its engine core (and that its workers) as separate processes that keep running,
    holding their memory, when the runtime is killed without a chance to shut them down: nothing
    in them watches the runtime. :meth:`watch` lists this process's descendants to a reaper
    process through a pipe; the kernel closes the pipe when this process ends, and the reaper
    then SIGKILLs every listed process still alive (matched by pid and start time, so a reused pid
    is never hit). :meth:`close` (a clean stop) releases them unkilled. Processes started after :meth:`watch` are not covered: call it once the
    engine is up, passing what existed before it started (a process another thread started in
    that window would be listed too). On a clean shutdown the engine has already stopped them and the reaper finds
    nothing to kill. Linux (/proc) only; elsewhere it does nothing.
    """

    def __init__(self) -> None:
        self._process: subprocess.Popen[bytes] | None = None

    def watch(self, existing: set[int] = frozenset()) -> list[int]:  # type: ignore[assignment]
        """Hand this process's descendants, less ``existing`` (those that were there before the engine
        started: never ours to kill), to a (new) reaper; returns their pids."""
        mine = {self._process.pid} if self._process is not None else set()
        # multiprocessing's resource tracker serves this whole process (vLLM merely started it
        # first): killing it would make the next engine start warn, and it ends on its own.
        from multiprocessing import resource_tracker

        tracker = getattr(resource_tracker._resource_tracker, "_pid", None)
        pids = [p for p in descendants(os.getpid()) if p not in existing and p not in mine and p != tracker]
        lines = [f"{pid} {start}\n" for pid in pids if (start := _start_time(pid)) is not None]
        if not lines:
            return []
        self.close()
        try:
            self._process = subprocess.Popen([sys.executable, "-c", _REAPER], stdin=subprocess.PIPE,
                                             stdout=subprocess.DEVNULL, close_fds=True)
            assert self._process.stdin is not None
            self._process.stdin.write("".join(lines).encode())
            self._process.stdin.flush()  # stays open: its end of file is the signal
        except OSError as exc:
            log.warning("cannot start the engine-process reaper (%s): vLLM's processes will outlive a "
                        "killed runtime", exc)
            self._process = None
            return []
        return [int(line.split()[0]) for line in lines]

    def close(self) -> None:
        """End the reaper without killing anything: the engine stopped its processes itself."""
        process, self._process = self._process, None
        if process is not None:
            assert process.stdin is not None
            try:
                process.stdin.write(b"release\n")
                process.stdin.close()
            except OSError:  # the reaper is already gone
                pass
            process.wait()


def _is_template_error(exc: BaseException) -> bool:
    """jinja2's TemplateError (``raise_exception`` in a chat template) or text that cannot be encoded."""
    if isinstance(exc, UnicodeError):
        return True
    try:
        from jinja2.exceptions import TemplateError
    except ImportError:  # no jinja2, so no template could have raised one
        return False
    return isinstance(exc, TemplateError)


@dataclasses.dataclass(frozen=True)
class VllmSettings:
    """The engine settings zerolayer types itself, and the arguments passed through as they are.

    Every default targets a GPU node; ``None`` means "not set here":

    - ``dtype``: ``"auto"`` (the model's own dtype, half precision for float32 checkpoints);
    - ``enforce_eager``: False, so vLLM captures CUDA graphs; True only when asked;
    - ``tensor_parallel_size``: 1 (in a cluster the node's ``runtime.gpus``, see incluster.py);
    - ``kv_cache_memory_bytes``: unset, so ``gpu_memory_utilization`` (default
      :data:`DEFAULT_GPU_MEMORY_UTILIZATION`) sizes the KV cache; a fixed size replaces the
      fraction (vLLM then ignores the fraction, so setting both is refused);
    - ``max_model_len``: the model's own limit; ``max_num_seqs``, ``max_num_batched_tokens``,
      ``enable_prefix_caching``, ``quantization``: vLLM's own defaults.

    ``engine_args`` go to ``AsyncEngineArgs`` unchanged (their names are checked against vLLM's
    by the config layer, zerolayer/engine_args.py); one that a typed setting also sets is refused.
    CPU test configs set ``kv_cache_memory_bytes``, ``enforce_eager`` and ``dtype`` themselves.
    """

    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float | None = None
    dtype: str | None = None
    enforce_eager: bool | None = None
    tensor_parallel_size: int | None = None
    quantization: str | None = None
    enable_prefix_caching: bool | None = None
    engine_args: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    DEFAULT_GPU_MEMORY_UTILIZATION: ClassVar[float] = 0.9
    TYPED: ClassVar[tuple[str, ...]] = (
        "max_model_len", "max_num_seqs", "max_num_batched_tokens", "kv_cache_memory_bytes", "gpu_memory_utilization",
        "dtype", "enforce_eager", "tensor_parallel_size", "quantization", "enable_prefix_caching")

    def __post_init__(self) -> None:
        both = sorted(set(self.typed()) & set(self.engine_args))
        if both:
            raise ConfigError(f"engine_args {', '.join(both)}: also set as typed settings; set each in one place")
        if self.kv_cache_memory_bytes is not None and self.gpu_memory_utilization is not None:
            raise ConfigError("kv_cache_memory_bytes and gpu_memory_utilization: set one (a fixed KV-cache size "
                              "makes vLLM ignore the memory fraction)")

    def typed(self) -> dict[str, Any]:
        """The typed settings given (not None), by vLLM argument name."""
        return {name: getattr(self, name) for name in self.TYPED if getattr(self, name) is not None}

    def vllm_args(self, model: str, served_name: str) -> dict[str, Any]:
        """The keyword arguments of ``AsyncEngineArgs`` these settings stand for."""
        args: dict[str, Any] = dict(
            model=model,
            served_model_name=served_name,
            dtype="auto",
            enforce_eager=False,
            tensor_parallel_size=1,
            scheduling_policy="priority",  # the micro-scheduler's priorities go to vLLM's priority queue
        )
        passed = self.engine_args
        if "kv_cache_memory_bytes" not in passed and "gpu_memory_utilization" not in passed:
            if self.kv_cache_memory_bytes is None:
                args["gpu_memory_utilization"] = self.DEFAULT_GPU_MEMORY_UTILIZATION
        args.update(self.typed())
        args.update(passed)
        return args


class VllmEngine:
    """vLLM's ``AsyncLLM`` serving one model. ``settings`` (or the same fields as keywords, see
    :class:`VllmSettings`) say how; with neither, the GPU defaults apply."""

    kind = "vllm"

    def __init__(self, model_path: str, *, served_name: str | None = None, settings: VllmSettings | None = None,
                 **knobs: Any) -> None:
        if settings is not None and knobs:
            raise TypeError("give settings or keyword settings, not both")
        self.model_path = model_path
        self.models = (served_name or os.path.basename(os.path.normpath(model_path)),)
        self.settings = settings if settings is not None else VllmSettings(**knobs)
        self._args = self.settings.vllm_args(model_path, self.models[0])
        self._llm: Any = None
        self._tokenizer: Any = None
        self._stats = EngineStats(running=0, waiting=0, kv_cache_usage=0.0)
        self._reaper = ChildReaper()

    @property
    def max_model_len(self) -> int | None:
        """The context length the server refuses prompts at (400): vLLM's resolved value once
        started (the model's own limit unless set), the configured one before; None if unknown."""
        model_config = getattr(getattr(self._llm, "vllm_config", None), "model_config", None)
        resolved = getattr(model_config, "max_model_len", None)
        if resolved:
            return int(resolved)
        configured = self._args.get("max_model_len")
        return int(configured) if configured else None

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

        before = set(descendants(os.getpid()))
        try:
            self._llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**self._args), stat_loggers=[_StatsSink])
            self._tokenizer = self._llm.get_tokenizer()
        except Exception as exc:  # vLLM raises plain RuntimeError/ValueError for bad configs
            raise EngineError(f"vLLM failed to start with model {self.model_path!r}: {exc}") from exc
        self._reaper.watch(before)  # vLLM's processes now exist: they die with this one, even on SIGKILL

    async def close(self) -> None:
        if self._llm is not None:
            llm, self._llm = self._llm, None
            llm.shutdown()
        self._reaper.close()

    async def release_memory(self) -> None:
        """Drop vLLM's cached prefix blocks so their KV pages return to the free pool (SIGUSR1 from
        gpu-defragd, :mod:`zerolayer.runtime.defrag.release`). Running requests keep their blocks."""
        if self._llm is None:
            return
        try:
            reset = await self._llm.reset_prefix_cache()
        except Exception as exc:  # vLLM's own errors (engine dead, RPC failure)
            raise EngineError(f"vLLM reset_prefix_cache failed: {exc}") from exc
        if reset is False:  # vLLM declines while blocks are still in use by running requests
            log.info("vLLM kept its prefix cache: blocks still in use")

    @property
    def kv_capacity_tokens(self) -> int | None:
        """KV-cache size in tokens (blocks x block size) once started; ``None`` when vLLM does not say."""
        if self._llm is None:
            return None
        cache = getattr(getattr(self._llm, "vllm_config", None), "cache_config", None)
        blocks = getattr(cache, "num_gpu_blocks", None)  # the engine core reports it back at start
        block_size = getattr(cache, "block_size", None)
        if not blocks or not block_size:
            return None
        return int(blocks) * int(block_size)

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
            if _is_template_error(exc):
                # The template refused these messages (roles out of order, a system turn it does not
                # take, ...): the client's mistake, not the engine's. Its text is the template's own.
                raise InputRejected(f"the model's chat template refused the messages: {str(exc)[:200]}") from exc
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
