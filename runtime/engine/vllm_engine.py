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
import contextlib
import dataclasses
import logging
import os
import subprocess
import sys
from typing import Any, AsyncIterator, ClassVar, Iterator, Mapping, Sequence

from zerolayer.runtime.engine import tools as forced
from zerolayer.runtime.engine.base import (
    ChatMessage,
    Delta,
    EngineStats,
    InputRejected,
    LoraStats,
    Prompt,
    SamplingOptions,
    TokenLogprob,
    ToolCall,
    ToolSpec,
    ToolUse,
)
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


@dataclasses.dataclass(frozen=True)
class LoraAdapter:
    """A LoRA adapter served under its own model name: a PEFT folder (``adapter_config.json`` and
    ``adapter_model.safetensors``) trained for the engine's base model."""

    name: str
    path: str


# vLLM's accepted ``max_lora_rank`` values (vllm.config.lora.MaxLoRARanks).
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def adapter_rank(adapter: LoraAdapter) -> int:
    """The adapter's rank ``r`` from its ``adapter_config.json`` (ConfigError when unreadable)."""
    import json

    where = os.path.join(adapter.path, "adapter_config.json")
    try:
        with open(where) as f:
            rank = json.load(f).get("r")
    except (OSError, ValueError) as exc:
        raise ConfigError(f"LoRA adapter {adapter.name!r}: cannot read {where}: {exc}") from exc
    if not isinstance(rank, int) or rank <= 0:
        raise ConfigError(f"LoRA adapter {adapter.name!r}: {where} gives no positive rank r")
    return rank


def lora_args(adapters: Sequence[LoraAdapter], given: Mapping[str, Any]) -> dict[str, Any]:
    """The ``AsyncEngineArgs`` LoRA needs (those ``given`` in engine_args win): LoRA on, every adapter
    resident at once (``max_loras``), and the smallest vLLM rank that fits the largest adapter."""
    if not adapters:
        return {}
    args: dict[str, Any] = {"enable_lora": True, "max_loras": len(adapters)}
    rank = max(adapter_rank(a) for a in adapters)
    fits = [r for r in LORA_RANKS if r >= rank]
    if not fits:
        raise ConfigError(f"LoRA rank {rank} is above vLLM's largest, {LORA_RANKS[-1]}")
    args["max_lora_rank"] = fits[0]
    return {k: v for k, v in args.items() if k not in given}


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
                 tool_parser: str | None = None, loras: Sequence[LoraAdapter] = (),
                 devices: Sequence[int] | None = None, **knobs: Any) -> None:
        if settings is not None and knobs:
            raise TypeError("give settings or keyword settings, not both")
        # vLLM's tool-call parser for tool_choice "auto" (vllm serve's --tool-call-parser, e.g. "hermes");
        # None: "auto" is refused (400), forced choices work without one.
        self.tool_parser = tool_parser
        self.model_path = model_path
        base = served_name or os.path.basename(os.path.normpath(model_path))
        self.loras = tuple(loras)
        self.models = (base, *(a.name for a in self.loras))  # adapters are served under their own names
        if len(set(self.models)) != len(self.models):
            raise ConfigError(f"model {base!r}: adapter names must be unique and differ from the model's")
        self.adapters = {a.name: base for a in self.loras}
        self._lora_requests: dict[str, Any] = {}  # adapter name -> vLLM LoRARequest, built at start
        # The GPUs this engine's processes see (CUDA_VISIBLE_DEVICES while vLLM starts them); None: all.
        self.devices = tuple(devices) if devices is not None else None
        self.settings = settings if settings is not None else VllmSettings(**knobs)
        self._args = self.settings.vllm_args(model_path, base)
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

    def for_model(self, model: str) -> "VllmEngine":
        return self

    def context_length(self, model: str) -> int | None:
        return self.max_model_len

    def model_stats(self) -> list[tuple[str, EngineStats]]:
        return [(self.models[0], self._stats)]

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

        if self.tool_parser is not None:
            from vllm.tool_parsers import ToolParserManager

            try:
                ToolParserManager.get_tool_parser(self.tool_parser)
            except KeyError:
                known = sorted({*ToolParserManager.tool_parsers, *ToolParserManager.lazy_parsers})
                raise EngineError(f"tool_parser {self.tool_parser!r} is not one of vLLM's: {', '.join(known)}") from None

        engine = self

        class _StatsSink(StatLoggerBase):
            """Receives vLLM's scheduler stats every step; keeps the latest as EngineStats."""

            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                pass

            def record(self, scheduler_stats: Any, iteration_stats: Any, *args: Any, **kwargs: Any) -> None:
                if scheduler_stats is not None:
                    lora = None
                    if max_loras:
                        lora = LoraStats(max_loras, tuple(sorted(scheduler_stats.running_lora_adapters)),
                                         tuple(sorted(scheduler_stats.waiting_lora_adapters)))
                    engine._stats = EngineStats(
                        running=scheduler_stats.num_running_reqs,
                        waiting=scheduler_stats.num_waiting_reqs,
                        kv_cache_usage=float(scheduler_stats.kv_cache_usage),
                        lora=lora,
                    )

            def log_engine_initialized(self) -> None:
                pass

        args = {**self._args, **lora_args(self.loras, self._args)}
        max_loras = int(args.get("max_loras", 1)) if args.get("enable_lora") else 0
        if self.loras:
            from vllm.lora.request import LoRARequest

            self._lora_requests = {a.name: LoRARequest(a.name, i, a.path) for i, a in enumerate(self.loras, 1)}
        before = set(descendants(os.getpid()))
        try:
            with _visible_devices(self.devices):
                self._llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**args), stat_loggers=[_StatsSink])
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

    async def render(self, model: str, messages: Sequence[ChatMessage], *, tools: Sequence[ToolSpec] = (),
                     continue_final: bool = False) -> Prompt:
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
            text = tokenizer.apply_chat_template(chat, add_generation_prompt=not continue_final,
                                                 continue_final_message=continue_final, tokenize=False, **extra)
            ids = tokenizer.encode(text, add_special_tokens=False)
            return Prompt(text=text, token_ids=tuple(ids), model=model)

        return await self._tokenize(_render, "chat template")

    async def encode(self, model: str, text: str) -> Prompt:
        if self._tokenizer is None:
            raise EngineError("engine not started")
        tokenizer = self._tokenizer

        def _encode() -> Prompt:
            # As vllm serve's /v1/completions: the tokenizer's own special tokens (BOS) are added.
            return Prompt(text=text, token_ids=tuple(tokenizer.encode(text, add_special_tokens=True)), model=model)

        return await self._tokenize(_encode, "tokenizer")

    async def _tokenize(self, work: Any, what: str) -> Prompt:
        try:
            return await asyncio.to_thread(work)
        except Exception as exc:  # jinja or tokenizer errors on odd input
            if _is_template_error(exc) or isinstance(exc, ValueError):
                # The template refused these messages (roles out of order, a system turn it does not
                # take, a prefill it cannot continue, ...): the client's mistake, not the engine's.
                # transformers raises ValueError for what it checks itself (continue_final_message
                # without a final assistant turn). Its text is the template's own.
                raise InputRejected(f"the model's {what} refused the input: {str(exc)[:200]}") from exc
            raise EngineError(f"{what} failed: {exc}") from exc

    def parse_tool_calls(self, text: str, tools: ToolUse) -> tuple[str, tuple[ToolCall, ...]]:
        if tools.choice in ("required", "function"):
            return forced.parse_forced(text, tools)
        parser, request = self._tool_parser(tools)
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
        return ParserCallStream(*self._tool_parser(tools))

    def _tool_parser(self, tools: ToolUse) -> tuple[Any, Any]:
        """A new instance of this node's vLLM tool-call parser and the ``ChatCompletionRequest`` it reads
        the tools from; :class:`InputRejected` where the node runs none."""
        if self.tool_parser is None:
            raise InputRejected("tool_choice auto: this node runs no tool-call parser")
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.tool_parsers import ToolParserManager

        request = ChatCompletionRequest(model=self.models[0], messages=[{"role": "user", "content": ""}],
                                        tools=[tool_schema(t) for t in tools.tools], tool_choice="auto")
        return ToolParserManager.get_tool_parser(self.tool_parser)(self._tokenizer, request.tools), request

    async def generate(
        self, prompt: Prompt, options: SamplingOptions, request_id: str, priority: int
    ) -> AsyncIterator[Delta]:
        if self._llm is None:
            raise EngineError("engine not started")
        if options.tools is not None and options.tools.choice == "auto" and self.tool_parser is None:
            raise InputRejected("tool_choice auto: this node runs no tool-call parser (give tool_choice "
                                "required or a named function, which need none)")
        params = sampling_params(options)
        started = False
        try:
            async for out in self._llm.generate(
                {"prompt_token_ids": list(prompt.token_ids)}, params, request_id=request_id, priority=priority,
                lora_request=self._lora_requests.get(prompt.model),
            ):
                started = True
                for completion in out.outputs:  # n > 1: each output is one completion's delta
                    yield delta_of(completion, options.logprobs)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if not started and _client_error(exc):  # vLLM's input checks (a logit_bias token outside the vocabulary)
                raise InputRejected(f"vLLM refused the request: {str(exc)[:200]}") from exc
            raise EngineError(f"vLLM request {request_id} failed: {exc}") from exc

    async def abort(self, request_id: str) -> None:
        if self._llm is not None:
            await self._llm.abort(request_id)

    def stats(self) -> EngineStats:
        return self._stats


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


def sampling_params(options: SamplingOptions) -> Any:
    """vLLM's ``SamplingParams`` for ``options``: every field honoured, streamed as deltas. A value
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
        if options.structured.kind == "json_object":
            structured = StructuredOutputsParams(json_object=True)
        else:
            structured = StructuredOutputsParams(json=json.loads(options.structured.schema or "{}"))
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
            structured_outputs=structured,
            output_kind=RequestOutputKind.DELTA,
        )
    except Exception as exc:
        if not _client_error(exc):
            raise
        raise InputRejected(f"vLLM refused the sampling settings: {str(exc)[:200]}") from exc


def delta_of(completion: Any, logprobs: int | None) -> Delta:
    """One vLLM ``CompletionOutput`` (a delta) as a :class:`Delta`. ``stop_reason`` is the stop
    string that ended it (an int is a stop token id, not a sequence the client gave)."""
    stop = completion.stop_reason if isinstance(completion.stop_reason, str) else None
    return Delta(completion.text, len(completion.token_ids), completion.finish_reason, index=completion.index,
                 stop_sequence=stop if completion.finish_reason == "stop" else None,
                 logprobs=token_logprobs(completion, logprobs) if logprobs is not None else (),
                 token_ids=tuple(completion.token_ids))


def token_logprobs(completion: Any, top: int) -> tuple[TokenLogprob, ...]:
    """vLLM's per-position ``{token id: Logprob}`` maps (the top ``top`` by rank, plus the sampled
    token wherever it ranks) as one :class:`TokenLogprob` per sampled token."""
    out = []
    for token_id, position in zip(completion.token_ids, completion.logprobs or ()):
        sampled = position[token_id]
        ranked = sorted((lp for lp in position.values() if lp.rank is not None and lp.rank <= top),
                        key=lambda lp: lp.rank)[:top]
        out.append(TokenLogprob(sampled.decoded_token or "", float(sampled.logprob),
                                tuple((lp.decoded_token or "", float(lp.logprob)) for lp in ranked)))
    return tuple(out)
