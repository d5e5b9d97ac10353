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
import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import subprocess
import sys
from typing import (TYPE_CHECKING, Any, AsyncGenerator, AsyncIterator, Callable, ClassVar, Iterator, Mapping,
                    Sequence, cast)

from zerolayer.engine_prefixes import EngineCachedPrefixes
from zerolayer.prefix import ServedPrefixes
from zerolayer.runtime.engine import kv_events
from zerolayer.runtime.engine import tools as forced
from zerolayer.runtime.engine.base import (
    ChatMessage, Delta, EngineStats, InputRejected, LoraStats, MemoryRelease, Prompt, SamplingOptions,
    TokenLogprob, ToolCall, ToolSpec, ToolUse, echo_deltas, renumbered)
from zerolayer.runtime.engine.lora import AdapterSet, LoraAdapter
from zerolayer.runtime.engine.shared_core import StatsBox
from zerolayer.runtime.errors import ConfigError, EngineError

if TYPE_CHECKING:
    from zerolayer.runtime.engine.shared_core import CoreClient

log = logging.getLogger(__name__)

# gpu-defragd's nudge on a vLLM engine (VllmEngine.release_memory says why).
NOTHING_TO_RELEASE = "nothing to release: vLLM pre-allocates; idle prefix blocks are already free"

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


@contextlib.contextmanager
def _visible_devices(devices: Sequence[int] | None) -> Iterator[None]:
    """CUDA_VISIBLE_DEVICES set to ``devices`` while vLLM starts its engine-core and worker
    processes (they inherit it and see only those GPUs), restored after; nothing when None."""
    if devices is None:
        yield
        return
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in devices)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved


@contextlib.contextmanager
def _otlp_over_http(endpoint: str | None) -> Iterator[None]:
    """While vLLM starts: its span exporters speak OTLP/HTTP to ``endpoint`` (vLLM picks the protocol from
    OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, gRPC when unset) under the service name ``vllm`` unless
    OTEL_SERVICE_NAME names one (vLLM sets none: ``unknown_service``). Its engine-core process inherits
    both; restored after. Nothing when tracing is off (``endpoint`` None)."""
    if endpoint is None:
        yield
        return
    wanted = {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
              "OTEL_SERVICE_NAME": os.environ.get("OTEL_SERVICE_NAME") or "vllm"}
    saved = {name: os.environ.get(name) for name in wanted}
    os.environ.update(wanted)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def trace_headers(options: SamplingOptions) -> dict[str, str] | None:
    """vLLM's ``trace_headers`` for one request: the request span's W3C context, so vLLM's own
    ``llm_request`` span is its child; None when tracing is off."""
    return {"traceparent": options.traceparent} if options.traceparent else None


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
    # Not an ``engine:`` key: build_engine (config.py, called by the composition root) sets it to
    # telemetry.tracing.otlp_endpoint (an OTLP/HTTP URL) when tracing is on, so vLLM exports its own
    # ``llm_request`` spans there too (docs/observability.md, "vLLM's own span"); None: vLLM traces nothing.
    otlp_traces_endpoint: str | None = None

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
        if self.otlp_traces_endpoint is not None and "otlp_traces_endpoint" in self.engine_args:
            raise ConfigError("engine_args otlp_traces_endpoint: telemetry.tracing already sends vLLM's spans "
                              "to its otlp_endpoint; set it in one place")

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
        if self.otlp_traces_endpoint is not None:
            args["otlp_traces_endpoint"] = self.otlp_traces_endpoint
        return args


def _check_tool_parser(name: str) -> None:
    """EngineError unless ``name`` is one of vLLM's tool-call parsers."""
    from vllm.tool_parsers import ToolParserManager

    try:
        ToolParserManager.get_tool_parser(name)
    except KeyError:
        known = sorted({*ToolParserManager.tool_parsers, *ToolParserManager.lazy_parsers})
        raise EngineError(f"tool_parser {name!r} is not one of vLLM's: {', '.join(known)}") from None


def tool_parser_for(name: str | None, tokenizer: Any, model: str, tools: ToolUse) -> tuple[Any, Any]:
    """A new instance of vLLM's tool-call parser ``name`` and the ``ChatCompletionRequest`` it reads
    the tools from; :class:`InputRejected` where the node runs none."""
    if name is None:
        raise InputRejected("tool_choice auto: this node runs no tool-call parser")
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.tool_parsers import ToolParserManager

    request = ChatCompletionRequest.model_validate({
        "model": model, "messages": [{"role": "user", "content": ""}],
        "tools": [tool_schema(t) for t in tools.tools], "tool_choice": "auto"})
    # ToolParser declares a list of vLLM's wider tool union; a list of one member is that at run time
    # (mypy's lists are invariant).
    return ToolParserManager.get_tool_parser(name)(tokenizer, cast(Any, request.tools)), request


def stats_sink(keep: Callable[[EngineStats], None], max_loras: int) -> type:
    """A ``StatLoggerBase`` class for ``AsyncLLM``: vLLM's scheduler stats of every step, kept as
    :class:`EngineStats` through ``keep`` (with the LoRA adapters in use when ``max_loras``)."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class _StatsSink(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            pass

        def record(self, scheduler_stats: Any, iteration_stats: Any, *args: Any, **kwargs: Any) -> None:
            if scheduler_stats is None:
                return
            lora = None
            if max_loras:
                lora = LoraStats(max_loras, tuple(sorted(scheduler_stats.running_lora_adapters)),
                                 tuple(sorted(scheduler_stats.waiting_lora_adapters)))
            keep(EngineStats(running=scheduler_stats.num_running_reqs, waiting=scheduler_stats.num_waiting_reqs,
                             kv_cache_usage=float(scheduler_stats.kv_cache_usage), lora=lora))

        def log_engine_initialized(self) -> None:
            pass

    return _StatsSink


def prefix_record(kind: str, engine: "VllmEngine") -> ServedPrefixes | EngineCachedPrefixes:
    """The record ``engine`` gossips its prefix-cache digest from (docs/routing.md, "Precise mode"):
    ``served``, the chats it rendered, kept to what its KV cache can hold; ``kv_events``, what vLLM's KV
    cache events say it holds (fed by :func:`kv_events.attach`), sized by the engine's cache once started."""
    if kind == "served":
        return ServedPrefixes(cache_tokens=lambda: engine.kv_capacity_tokens)
    if kind != "kv_events":
        raise ConfigError(f"prefix_digest: served or kv_events, got {kind!r}")

    def engine_blocks() -> tuple[int, int] | None:
        cache = getattr(getattr(engine._llm, "vllm_config", None), "cache_config", None)
        size, blocks = getattr(cache, "block_size", None), getattr(cache, "num_gpu_blocks", None)
        return (int(size), int(blocks)) if size and blocks else None

    return EngineCachedPrefixes(engine_blocks=engine_blocks)


class VllmEngine:
    """vLLM's ``AsyncLLM`` serving one model. ``settings`` (or the same fields as keywords, see
    :class:`VllmSettings`) say how; with neither, the GPU defaults apply."""

    kind = "vllm"
    #: vLLM takes ``gpu_memory_utilization`` of each GPU at start (weights, activations, KV cache), so
    #: the GPU's memory used/total says nothing about load: pressure follows the KV cache (docs/gpu.md).
    preallocates_gpu_memory = True

    def __init__(self, model_path: str, *, served_name: str | None = None, settings: VllmSettings | None = None,
                 tool_parser: str | None = None, loras: Sequence[LoraAdapter] = (), core_client: CoreClient | None = None,
                 devices: Sequence[int] | None = None, prefix_digest: str = "served", **knobs: Any) -> None:
        if settings is not None and knobs:
            raise TypeError("give settings or keyword settings, not both")
        # vLLM's tool-call parser for tool_choice "auto" (vllm serve's --tool-call-parser, e.g. "hermes");
        # None: "auto" is refused (400), forced choices work without one.
        self.tool_parser = tool_parser
        self.model_path = model_path
        base = served_name or os.path.basename(os.path.normpath(model_path))
        self.lora = AdapterSet(base, loras)  # adapters are served under their own names
        self._batches: dict[str, list[str]] = {}  # a batch's request id -> its prompts' vLLM request ids
        # The GPUs this engine's processes see (CUDA_VISIBLE_DEVICES while vLLM starts them); None: all.
        self.devices = tuple(devices) if devices is not None else None
        self.settings = settings if settings is not None else VllmSettings(**knobs)
        self._args = self.settings.vllm_args(model_path, base)
        self._llm: Any = None
        self._tokenizer: Any = None
        self._render_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.core_client = core_client  # one of several API processes: a client of the parent's engine core
        self._stats = StatsBox(core_client.stats if core_client else None)  # the freshest of any API process's
        self._reaper = ChildReaper()
        # The gossiped digest's record (prefix_record), and the subscriber feeding a "kv_events" one
        self.served_prefixes = prefix_record(prefix_digest, self)
        self._kv_events: kv_events.KvEventSubscriber | None = None

    @property
    def kv_event_feed(self) -> kv_events.KvEventFeed | None:  # what the KV-event subscriber received (metrics)
        return self._kv_events.feed if self._kv_events is not None else None

    @property
    def models(self) -> tuple[str, ...]:
        """The base model, then its LoRA adapters (these change while running: :meth:`add_adapter`)."""
        return self.lora.names

    @property
    def adapters(self) -> dict[str, str]:
        return self.lora.parents

    async def add_adapter(self, adapter: LoraAdapter) -> None:
        """Load ``adapter`` into the running engine and serve it (:meth:`AdapterSet.add`)."""
        await self.lora.add(self._llm, adapter)

    async def remove_adapter(self, name: str) -> None:
        """Stop serving adapter ``name`` and unload it (:meth:`AdapterSet.remove`)."""
        await self.lora.remove(self._llm, name)

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

    def for_model(self, model: str) -> "VllmEngine":
        return self

    def context_length(self, model: str) -> int | None:
        return self.max_model_len

    def model_stats(self) -> list[tuple[str, EngineStats]]:
        return [(self.models[0], self.stats())]

    def engine_args(self) -> dict[str, Any]:
        """``AsyncEngineArgs``' keyword arguments, LoRA's included (the shared engine core starts from them)."""
        return self.lora.start_args(self._args)

    async def start(self) -> None:
        """Start AsyncLLM. Blocks the loop while vLLM spawns its processes: call before serving."""
        if self._llm is not None:
            return
        try:
            import vllm  # noqa: F401
        except ImportError as exc:
            raise EngineError("the vllm engine needs vLLM installed (pip install 'zerolayer[engine]')") from exc

        if self.tool_parser is not None:
            _check_tool_parser(self.tool_parser)
        self._kv_events, args = kv_events.attach(self.served_prefixes, self.engine_args(), self.core_client)
        max_loras = int(args.get("max_loras", 1)) if args.get("enable_lora") else 0
        before = set(descendants(os.getpid()))
        try:
            with _visible_devices(self.devices), _otlp_over_http(self.settings.otlp_traces_endpoint):
                self._llm = async_llm(args, [stats_sink(self._stats.put, max_loras)], self.core_client)
            self._tokenizer = self._llm.get_tokenizer()
        except Exception as exc:  # vLLM raises plain RuntimeError/ValueError for bad configs
            kv_events.detach(self._kv_events)
            raise EngineError(f"vLLM failed to start with model {self.model_path!r}: {exc}") from exc
        self._reaper.watch(before)  # vLLM's processes now exist: they die with this one, even on SIGKILL
        self._render_pool = render_pool(args)

    async def close(self) -> None:
        if self._llm is not None:
            llm, self._llm = self._llm, None
            llm.shutdown()
        if self._render_pool is not None:
            self._render_pool.shutdown(wait=False)
            self._render_pool = None
        kv_events.detach(self._kv_events)
        self._reaper.close()

    async def release_memory(self) -> MemoryRelease:
        """gpu-defragd's nudge (SIGUSR1, :mod:`zerolayer.runtime.defrag.release`): a no-op that frees
        0 bytes, on purpose. vLLM pre-allocates its KV cache at start, so that memory stays reserved
        whatever the cache holds (NVML sees no change), and a cached prefix block no request holds
        already counts as free (vLLM's ``BlockPool.get_usage``): a new request takes it when it needs
        it. ``reset_prefix_cache()`` would free no usable KV memory and only throw away the prefixes
        that prefix-aware routing sends requests here for (docs/routing.md). What does return an idle
        engine's memory is vLLM's sleep mode, not wired here (docs/defragd.md)."""
        log.debug("SIGUSR1 from gpu-defragd: vLLM prefix cache kept, %s", NOTHING_TO_RELEASE)
        return MemoryRelease(freed_bytes=0, note=NOTHING_TO_RELEASE)

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

    async def render(self, model: str, messages: Sequence[ChatMessage], *, tools: Sequence[ToolSpec] = (),
                     continue_final: bool = False, template_kwargs: Mapping[str, Any] | None = None) -> Prompt:
        if self._tokenizer is None:
            raise EngineError("engine not started")
        tokenizer = self._tokenizer
        template = getattr(tokenizer, "chat_template", None) or ""
        if isinstance(template, dict):  # named templates ("default", "tool_use", ...)
            template = " ".join(str(t) for t in template.values())
        if tools and "tools" not in template:
            # A template that never reads ``tools`` would render the chat without them: the model would
            # not know the tools exist. Said, not silently dropped.
            raise InputRejected("tools: this model's chat template does not render tools")
        if continue_final and (not messages or messages[-1].role != "assistant"):
            raise InputRejected("continuing a prefill needs an assistant message last")
        chat = [chat_message(m) for m in messages]
        extra: dict[str, Any] = {"tools": [tool_schema(t) for t in tools]} if tools else {}

        def _render() -> Prompt:
            if template_kwargs:
                # vLLM's own filter: the variables this template (or the tokenizer's call) reads, the
                # rest dropped, as vllm serve does with chat_template_kwargs.
                from vllm.renderers.hf import resolve_chat_template_kwargs

                extra.update({k: v for k, v in resolve_chat_template_kwargs(tokenizer, template,
                                                                            dict(template_kwargs)).items()
                              if k not in extra})
            text = tokenizer.apply_chat_template(chat, add_generation_prompt=not continue_final,
                                                 continue_final_message=continue_final, tokenize=False, **extra)
            ids = tokenizer.encode(text, add_special_tokens=False)
            return Prompt(text=text, token_ids=tuple(ids), model=model)

        return await rendered(self._render_pool, _render, "chat template")

    async def encode(self, model: str, prompt: str | Sequence[int]) -> Prompt:
        if self._tokenizer is None:
            raise EngineError("engine not started")
        tokenizer = self._tokenizer
        if not isinstance(prompt, str):
            ids = tuple(prompt)
            # vLLM's bound (renderers/base.py validate_token_ids): the larger of the tokenizer's and the model's.
            vocab = max(int(tokenizer.max_token_id), self._vocab_size() - 1)
            bad = [t for t in ids if not 0 <= t <= vocab]
            if bad:
                raise InputRejected(f"prompt: token id {bad[0]} is out of vocabulary (ids 0..{vocab})")

        def _encode() -> Prompt:
            if isinstance(prompt, str):
                # As vllm serve's /v1/completions: the tokenizer's own special tokens (BOS) are added.
                return Prompt(text=prompt, token_ids=tuple(tokenizer.encode(prompt, add_special_tokens=True)),
                              model=model)
            return Prompt(text=tokenizer.decode(list(ids)), token_ids=ids, model=model)  # the text: for echo

        return await rendered(self._render_pool, _encode, "tokenizer")

    def parse_tool_calls(self, text: str, tools: ToolUse) -> tuple[str, tuple[ToolCall, ...]]:
        if tools.choice in ("required", "function"):
            return forced.parse_forced(text, tools)
        parser, request = tool_parser_for(self.tool_parser, self._tokenizer, self.models[0], tools)
        found = parser.extract_tool_calls(text, request)
        if not found.tools_called:
            return text, ()
        calls = tuple(ToolCall(c.id or forced.call_id(), c.function.name, c.function.arguments)
                      for c in found.tool_calls)
        return found.content or "", calls

    def tool_call_stream(self, tools: ToolUse) -> Any:
        """A :class:`~zerolayer.runtime.engine.base.ToolCallStream`. Forced choices: their JSON read as
        it streams; ``"auto"``: a fresh instance of vLLM's parser (parsers keep streaming state, so one
        per completion) fed as ``vllm serve`` feeds it."""
        from zerolayer.runtime.engine.tool_stream import ForcedCallStream, ParserCallStream

        if tools.choice in ("required", "function"):
            return ForcedCallStream(tools)
        return ParserCallStream(*tool_parser_for(self.tool_parser, self._tokenizer, self.models[0], tools))

    async def generate(
        self, prompt: Prompt, options: SamplingOptions, request_id: str, priority: int
    ) -> AsyncIterator[Delta]:
        if self._llm is None:
            raise EngineError("engine not started")
        if options.tools is not None and options.tools.choice == "auto" and self.tool_parser is None:
            raise InputRejected("tool_choice auto: this node runs no tool-call parser (give tool_choice "
                                "required or a named function, which need none)")
        parts = prompt.each()
        for part, one in enumerate(parts):
            for echoed in echo_deltas(one, options, part * options.n):
                yield echoed
        if options.max_tokens == 0:  # echo alone
            return
        if len(parts) == 1:
            async for delta in self._generate_one(prompt, options, request_id, priority):
                yield delta
            return
        # A batch: one vLLM request per prompt, run together (as vllm serve runs a list of prompts),
        # their choices numbered prompt by prompt. abort() ends them all.
        ids = [f"{request_id}-{k}" for k in range(len(parts))]
        self._batches[request_id] = ids
        try:
            from vllm.utils.async_utils import merge_async_iterators

            streams = [self._generate_one(one, options, rid, priority) for one, rid in zip(parts, ids)]
            async for part, delta in merge_async_iterators(*streams):
                yield renumbered(delta, part, options.n)
        finally:
            self._batches.pop(request_id, None)

    async def _generate_one(self, prompt: Prompt, options: SamplingOptions, request_id: str,
                            priority: int) -> AsyncGenerator[Delta, None]:
        """One prompt's completions as deltas; the first delta of each carries the prompt's cached tokens."""
        params = sampling_params(options)  # per request: vLLM may keep state on its params
        lora_request = self.lora.request(prompt.model)
        if lora_request is None and prompt.model and prompt.model != self.lora.base:
            # Admitted for an adapter removed since: never run it on the base model under its name.
            raise EngineError(f"model {prompt.model!r} is no longer served here (its adapter was removed)")
        started = False
        seen: set[int] = set()
        try:
            async for out in self._llm.generate(
                engine_input(prompt), params, request_id=request_id, priority=priority,
                lora_request=lora_request, trace_headers=trace_headers(options),
            ):
                started = True
                for completion in out.outputs:  # n > 1: each output is one completion's delta
                    delta = delta_of(completion, options.logprobs)
                    if completion.index not in seen:
                        seen.add(completion.index)
                        delta = first_delta(delta, out, options.final_only)
                    yield delta
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if not started and _client_error(exc):  # vLLM's input checks (a logit_bias token outside the vocabulary)
                raise InputRejected(f"vLLM refused the request: {str(exc)[:200]}") from exc
            raise EngineError(f"vLLM request {request_id} failed: {exc}") from exc

    async def abort(self, request_id: str) -> None:
        if self._llm is not None:
            await self._llm.abort([request_id, *self._batches.get(request_id, ())])

    def tokens_so_far(self, request_id: str) -> int:
        return tokens_made(self._llm, (request_id, *self._batches.get(request_id, ())))

    def _vocab_size(self) -> int:
        model_config = getattr(self._llm, "model_config", None)
        return int(model_config.get_vocab_size()) if model_config is not None else 0

    def model_card(self, model: str) -> dict[str, Any]:
        """vLLM's ``/v1/models`` fields for ``model``: ``root`` (the weights: the model's path, an
        adapter's path) and ``max_model_len`` (None for an adapter, as vllm serve lists it)."""
        return self.lora.card(model) or {"root": self.model_path, "max_model_len": self.max_model_len}

    def stats(self) -> EngineStats:
        return self._stats.get()


def async_llm(args: dict[str, Any], stat_loggers: list[Any], client: "CoreClient | None") -> Any:
    """vLLM's ``AsyncLLM`` from engine ``args``: with its own engine core, or as client i of N of the
    engine core the parent of several API processes started (``engine/shared_core.py``)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    if client is None:
        return AsyncLLM.from_engine_args(AsyncEngineArgs(**args), stat_loggers=stat_loggers)
    from vllm.usage.usage_lib import UsageContext

    engine_args = AsyncEngineArgs(**args)
    engine_args._api_process_count = client.count
    engine_args._api_process_rank = client.index
    vllm_config = engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
    return AsyncLLM.from_vllm_config(vllm_config, stat_loggers=stat_loggers, client_addresses=client.addresses,
                                     client_count=client.count, client_index=client.index)


def _client_error(exc: BaseException) -> bool:
    """vLLM's verdict that the request is wrong (its ``VLLMClientError``s, or a ValueError from its checks)."""
    from vllm.exceptions import VLLMClientError

    return isinstance(exc, (ValueError, VLLMClientError))


def chat_message(message: ChatMessage) -> dict[str, Any]:
    """A message as Hugging Face chat templates read it (tool-call arguments as objects, as vLLM passes them)."""
    out: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.name, "arguments": _json_object(c.arguments)}}
                             for c in message.tool_calls]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        out["name"] = message.name
    if message.reasoning is not None:  # both names, as vLLM passes it
        out["reasoning"] = out["reasoning_content"] = message.reasoning
    return out


def _json_object(text: str) -> Any:
    import json

    try:
        return json.loads(text)
    except ValueError:
        return text


def tool_schema(tool: ToolSpec) -> dict[str, Any]:
    """A tool in the OpenAI shape chat templates and vLLM's parsers expect."""
    import json

    return {"type": "function", "function": {"name": tool.name, "description": tool.description,
                                             "parameters": json.loads(tool.parameters)}}


def engine_input(prompt: Prompt) -> Any:
    """``prompt`` as vLLM's rendered ``TokensInput`` (``type: "token"``), as vllm serve hands it to the
    engine: ``AsyncLLM.generate`` then checks it on the event loop. A bare ``{"prompt_token_ids": ...}``
    counts as unrendered, and vLLM sends each one through its renderer's thread before the engine sees
    it: a second hop between threads per request, after the chat template's (docs/benchmarks.md
    section 13). The token ids are already ours: rendered and checked by :meth:`VllmEngine.render` and
    :meth:`VllmEngine.encode`."""
    from vllm.inputs.engine import tokens_input

    return tokens_input(list(prompt.token_ids))


async def rendered(pool: concurrent.futures.Executor | None, work: Callable[[], Prompt], what: str) -> Prompt:
    """``work`` (a chat template's render, a tokenization) run in ``pool``; its errors as the runtime's."""
    try:
        return await asyncio.get_running_loop().run_in_executor(pool, work)
    except Exception as exc:  # jinja or tokenizer errors on odd input
        if _is_template_error(exc) or isinstance(exc, ValueError):
            # The template refused these messages (roles out of order, a system turn it does not
            # take, a prefill it cannot continue, ...): the client's mistake, not the engine's.
            # transformers raises ValueError for what it checks itself (continue_final_message
            # without a final assistant turn). Its text is the template's own.
            raise InputRejected(f"the model's {what} refused the input: {str(exc)[:200]}") from exc
        raise EngineError(f"{what} failed: {exc}") from exc


def render_pool(args: Mapping[str, Any]) -> concurrent.futures.ThreadPoolExecutor:
    """The threads chat templates are rendered and prompts tokenized in: as many as vLLM's own
    renderer has (``renderer_num_workers``, vLLM's default 1), since the tokenizer vLLM hands out
    (``get_tokenizer()``, made thread-safe by ``vllm.tokenizers.hf.maybe_make_thread_pool``) keeps
    that many copies plus one, and deep-copies a new one whenever more threads use it at once. With
    asyncio's default executor (up to 6 threads on 2 cores) a burst of requests made copies and set
    those threads fighting the event loop for the GIL (docs/benchmarks.md section 13)."""
    workers = int(args.get("renderer_num_workers") or 1)
    return concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="zerolayer-render")


def sampling_params(options: SamplingOptions) -> Any:
    """vLLM's ``SamplingParams`` for ``options``: every field honoured, streamed as deltas (or, with
    ``final_only``, each completion whole at its end, as vllm serve asks for a non-streamed request). A value
    vLLM refuses (its own range checks) is the client's: :class:`InputRejected`."""
    import json

    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    # Whitespace inside generated JSON is the engine's setting (vLLM reads disable_any_whitespace from
    # its structured_outputs_config, not per request): engine_args {"structured_outputs_config":
    # {"backend": "xgrammar", "disable_any_whitespace": true}} keeps small models from looping on whitespace.
    structured = None
    if options.tools is not None and options.tools.choice in ("required", "function"):
        structured = StructuredOutputsParams(json=forced.forced_schema(options.tools))
    elif options.structured is not None:
        kind, spec = options.structured.kind, options.structured.schema or ""
        if kind == "json_object":
            structured = StructuredOutputsParams(json_object=True)
        elif kind == "choice":
            structured = StructuredOutputsParams(choice=json.loads(spec))
        elif kind == "regex":
            structured = StructuredOutputsParams(regex=spec)
        elif kind == "grammar":
            structured = StructuredOutputsParams(grammar=spec)
        else:
            structured = StructuredOutputsParams(json=json.loads(spec or "{}"))
    try:
        return SamplingParams(
            n=options.n,
            max_tokens=options.max_tokens,
            temperature=options.temperature,
            top_p=options.top_p,
            top_k=options.top_k if options.top_k is not None else 0,
            presence_penalty=options.presence_penalty,
            frequency_penalty=options.frequency_penalty,
            logit_bias=dict(options.logit_bias) or None,
            logprobs=options.logprobs,
            stop=list(options.stop) or None,
            seed=options.seed,
            ignore_eos=options.ignore_eos,
            min_p=options.min_p,
            repetition_penalty=options.repetition_penalty,
            min_tokens=options.min_tokens,
            stop_token_ids=list(options.stop_token_ids) or None,
            include_stop_str_in_output=options.include_stop_str_in_output,
            skip_special_tokens=options.skip_special_tokens,
            spaces_between_special_tokens=options.spaces_between_special_tokens,
            structured_outputs=structured,
            output_kind=RequestOutputKind.FINAL_ONLY if options.final_only else RequestOutputKind.DELTA,
        )
    except Exception as exc:
        if not _client_error(exc):
            raise
        raise InputRejected(f"vLLM refused the sampling settings: {str(exc)[:200]}") from exc


def tokens_made(llm: Any, request_ids: Sequence[str]) -> int:
    """Output tokens vLLM's output processor has for these requests (every choice): a FINAL_ONLY request
    sends nothing until it ends. 0 where vLLM's internals read otherwise than this version's
    (``output_processor.external_req_ids``, ``request_states``)."""
    processor = getattr(llm, "output_processor", None)
    try:
        states = processor.request_states  # type: ignore[union-attr]
        return sum(state.detokenizer.num_output_tokens() for rid in request_ids
                   for internal in processor.external_req_ids.get(rid, ())  # type: ignore[union-attr]
                   if (state := states.get(internal)) is not None and state.detokenizer is not None)
    except AttributeError:
        return 0


def first_delta(delta: Delta, out: Any, final_only: bool) -> Delta:
    """A completion's first delta with what vLLM reports once per request (``out``: its ``RequestOutput``):
    the prompt's cached tokens, when the engine scheduled it and, for a whole completion
    (``final_only``), when its first token was made."""
    cached = getattr(out, "num_cached_tokens", None)
    stats = getattr(out, "metrics", None)
    scheduled = getattr(stats, "scheduled_ts", 0.0)  # engine core's time.monotonic(): our clock on one host
    first_token = getattr(stats, "first_token_ts", 0.0) if final_only else 0.0
    return dataclasses.replace(delta, cached_tokens=cached if isinstance(cached, int) else delta.cached_tokens,
                               scheduled_at=scheduled or delta.scheduled_at,
                               first_token_at=first_token or delta.first_token_at)


def delta_of(completion: Any, logprobs: int | None) -> Delta:
    """One vLLM ``CompletionOutput`` (a delta) as a :class:`Delta`. ``stop_reason`` is the stop
    string that ended it (an int is a stop token id, not a sequence the client gave)."""
    stop = completion.stop_reason if isinstance(completion.stop_reason, str) else None
    return Delta(completion.text, len(completion.token_ids), completion.finish_reason, index=completion.index,
                 stop_sequence=stop if completion.finish_reason == "stop" else None,
                 logprobs=token_logprobs(completion, logprobs) if logprobs is not None else (),
                 token_ids=tuple(completion.token_ids))


#: The lowest logprob answered: a token the sampler masked has -inf, which JSON cannot carry. vllm serve
#: answers ``max(logprob, -9999.0)`` (its chat and completions serving); so does the runtime.
MIN_LOGPROB = -9999.0


def token_logprobs(completion: Any, top: int) -> tuple[TokenLogprob, ...]:
    """vLLM's per-position ``{token id: Logprob}`` maps (the top ``top`` by rank, plus the sampled
    token wherever it ranks) as one :class:`TokenLogprob` per sampled token, each logprob at least
    :data:`MIN_LOGPROB`."""
    out = []
    for token_id, position in zip(completion.token_ids, completion.logprobs or ()):
        sampled = position[token_id]
        ranked = sorted((lp for lp in position.values() if lp.rank is not None and lp.rank <= top),
                        key=lambda lp: lp.rank)[:top]
        out.append(TokenLogprob(sampled.decoded_token or "", max(float(sampled.logprob), MIN_LOGPROB),
                                tuple((lp.decoded_token or "", max(float(lp.logprob), MIN_LOGPROB))
                                      for lp in ranked)))
    return tuple(out)
