"""A deterministic stand-in for a model, named as one: the *synthetic* engine.

It renders chats with a fixed plain template, counts whitespace-separated words as
tokens and answers with words chosen by a hash of the prompt, so the same request
always gets the same answer. Optional pacing (time to first token, tokens per second)
makes streams last long enough for scheduling tests; with no pacing it measures pure
protocol cost. KV-cache use is modelled as tokens held by running requests over
``kv_capacity_tokens``, so memory pressure can be produced on purpose.

Its "model" picks each word uniformly from a fixed list of :data:`_WORDS` (the hash says which), so
what it honours of :class:`SamplingOptions` is what a uniform deterministic chooser can: ``n``
(completion ``i`` hashes the prompt with ``i``), ``stop`` (output ends before a stop string, which is
reported), ``logprobs`` (every word's true probability, 1/len(_WORDS)), structured outputs and forced
tool calls (a minimal JSON instance of the schema: types, required properties, enums, first
``anyOf`` branch; not pattern, length or numeric bounds; written :data:`JSON_TOKEN_CHARS` characters
per token, cut short by ``max_tokens`` like any output). Temperature, top_p, top_k, penalties,
logit_bias and seed change nothing: the choice is not sampled. ``traceparent`` is ignored by design:
this engine has no request tracing of its own to bridge (the runtime's spans cover its requests).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import math
import time
from typing import Any, AsyncIterator, Mapping, Sequence

from zerolayer.prefix import ServedPrefixes
from zerolayer.runtime.engine import tools as forced
from zerolayer.runtime.engine.tool_stream import ForcedCallStream
from zerolayer.runtime.engine.base import (
    ChatMessage, Delta, EngineStats, InputRejected, Prompt, SamplingOptions, TokenLogprob, ToolCall, ToolSpec,
    ToolUse, echo_deltas, renumbered)
from zerolayer.runtime.errors import EngineError

VOCAB_SIZE = 32000  # token ids are word hashes modulo this (see _token_id)
MAX_LOGPROBS = 20  # alternatives per token, as vLLM's default max_logprobs

# A JSON output (structured outputs, forced tool calls) is written this many characters per token,
# so it streams in pieces as a model's would.
JSON_TOKEN_CHARS = 4

_WORDS = (
    "zero layer stream token header tenant session priority deadline engine cache memory "
    "node cluster quota budget admit refuse settle observe sample pressure window frame"
).split()
# The word each hash byte picks, as a first piece and (with its leading space) as any later one: an
# answer is read off these tables per token instead of being computed.
_FIRST_BY_BYTE = tuple(_WORDS[b % len(_WORDS)] for b in range(256))
_LATER_BY_BYTE = tuple(" " + word for word in _FIRST_BY_BYTE)


class SyntheticEngine:
    kind = "synthetic"
    preallocates_gpu_memory = False  # it holds no GPU memory: GPU memory is whatever else runs there

    def __init__(
        self,
        models: Sequence[str] = ("synthetic",),
        *,
        output_tokens: int = 16,
        ttft_s: float = 0.0,
        tokens_per_second: float | None = None,
        kv_capacity_tokens: int = 65536,
        max_model_len: int | None = None,
    ) -> None:
        if not models:
            raise EngineError("the synthetic engine needs at least one model name")
        self.models = tuple(models)
        self.output_tokens = output_tokens
        self.ttft_s = ttft_s
        self.tokens_per_second = tokens_per_second
        self.kv_capacity_tokens = kv_capacity_tokens
        self.max_model_len = max_model_len  # context size (prompt + output) in tokens; None: unbounded
        self._held: dict[str, int] = {}  # request_id -> tokens in the modelled KV cache
        self._aborted: set[str] = set()
        self._made: dict[str, int] = {}  # request_id -> output tokens made, for final_only requests
        self._started = False
        # What it served, for the prefix-cache digest the node gossips (it models no cache of its own).
        # the gossiped digest's record, no larger than this engine's KV cache (docs/routing.md)
        self.served_prefixes = ServedPrefixes(cache_tokens=lambda: self.kv_capacity_tokens)

    adapters: dict[str, str] = {}  # no LoRA: every name in models is a base model

    def for_model(self, model: str) -> "SyntheticEngine":
        return self

    def context_length(self, model: str) -> int | None:
        return self.max_model_len

    def model_stats(self) -> list[tuple[str, EngineStats]]:
        return [(self.models[0], self.stats())]

    def model_card(self, model: str) -> dict[str, Any]:
        return {"root": model, "max_model_len": self.max_model_len}

    async def start(self) -> None:
        self._started = True

    async def close(self) -> None:
        self._started = False

    def ready(self) -> bool:
        return self._started

    async def render(self, model: str, messages: Sequence[ChatMessage], *, tools: Sequence[ToolSpec] = (),
                     continue_final: bool = False, template_kwargs: Mapping[str, Any] | None = None) -> Prompt:
        # template_kwargs: its fixed template reads no variables (vLLM drops those a template does not read)
        if continue_final and (not messages or messages[-1].role != "assistant"):
            raise InputRejected("continuing a prefill needs an assistant message last")
        head = "".join(f"<tool> {t.name} {t.parameters}\n" for t in tools)
        turns = [f"<{m.role}> {m.content}" + "".join(f" <call {c.name} {c.arguments}>" for c in m.tool_calls)
                 for m in messages]
        # A prefill is continued: its turn stays open, no new assistant turn is started.
        text = head + ("\n".join(turns) if continue_final else "".join(t + "\n" for t in turns) + "<assistant>")
        return self._prompt(text)

    async def encode(self, model: str, prompt: str | Sequence[int]) -> Prompt:
        if isinstance(prompt, str):
            return self._prompt(prompt)
        bad = [t for t in prompt if not 0 <= t < VOCAB_SIZE]
        if bad:
            raise InputRejected(f"prompt: token id {bad[0]} is out of vocabulary (size {VOCAB_SIZE})")
        return Prompt(text=" ".join(f"<{t}>" for t in prompt), token_ids=tuple(prompt))

    @staticmethod
    def _prompt(text: str) -> Prompt:
        return Prompt(text=text, token_ids=tuple(map(_token_id, text.split())))

    def parse_tool_calls(self, text: str, tools: ToolUse) -> tuple[str, tuple[ToolCall, ...]]:
        if tools.choice in ("required", "function"):
            return forced.parse_forced(text, tools)
        raise InputRejected("tool_choice auto: the synthetic engine has no tool-call parser")

    def tool_call_stream(self, tools: ToolUse) -> ForcedCallStream:
        if tools.choice in ("required", "function"):
            return ForcedCallStream(tools)
        raise InputRejected("tool_choice auto: the synthetic engine has no tool-call parser")

    async def generate(
        self, prompt: Prompt, options: SamplingOptions, request_id: str, priority: int
    ) -> AsyncIterator[Delta]:
        if options.tools is not None and options.tools.choice == "auto":
            raise InputRejected("tool_choice auto: the synthetic engine has no tool-call parser")
        if options.structured is not None and options.structured.kind in ("regex", "grammar"):
            raise InputRejected(f"structured_outputs.{options.structured.kind}: the synthetic engine cannot "
                                "honour it (it writes no text to a pattern)")
        if options.stop_token_ids:
            raise InputRejected("stop_token_ids: the synthetic engine's token ids are word hashes; "
                                "use stop strings")
        if options.logprobs is not None and options.logprobs > MAX_LOGPROBS:
            raise InputRejected(f"logprobs: at most {MAX_LOGPROBS} alternatives on this engine, "
                                f"got {options.logprobs}")
        # A batch's prompts one after the other (each its own choices), each after its echo.
        for part, one in enumerate(prompt.each()):
            aborted = False
            for delta in echo_deltas(one, options, part * options.n):
                yield delta
            if options.max_tokens == 0:
                continue
            async for delta in self._generate_one(one, options, request_id):
                aborted = aborted or delta.finish_reason == "abort"
                yield renumbered(delta, part, options.n)
            if aborted:
                return

    async def _generate_one(self, prompt: Prompt, options: SamplingOptions, request_id: str) -> AsyncIterator[Delta]:
        outputs = [self._output(prompt, options, i) for i in range(options.n)]
        self._held[request_id] = prompt.token_count
        try:
            if self.ttft_s:
                await asyncio.sleep(self.ttft_s)
            longest = max(len(words) for words, _, _ in outputs)
            logprobs = options.logprobs
            held = self._held
            pace = 1.0 / self.tokens_per_second if self.tokens_per_second else 0.0
            if options.final_only:
                done, first = await self._steps(outputs, longest, pace, request_id)
                for delta in self._whole(outputs, longest, done, first, logprobs):
                    yield delta
                return
            for step in range(longest):
                if request_id in self._aborted:
                    for i in range(options.n):
                        yield Delta("", 0, "abort", index=i)
                    return
                if step and pace:
                    await asyncio.sleep(pace)
                for i, (words, finish, stop) in enumerate(outputs):
                    if step >= len(words):
                        continue
                    held[request_id] += 1
                    word, last = words[step], step == len(words) - 1
                    yield Delta(word, 1, finish if last else None, i, stop if last else None,
                                (self._logprob(word, logprobs),) if logprobs is not None else (),
                                (_token_id(word),))
            for i, (words, finish, stop) in enumerate(outputs):
                if not words:
                    yield Delta("", 0, finish, index=i, stop_sequence=stop)
        finally:
            self._held.pop(request_id, None)
            self._made.pop(request_id, None)
            self._aborted.discard(request_id)

    async def _steps(self, outputs: list[tuple[list[str], str, str | None]], longest: int, pace: float,
                     request_id: str) -> tuple[int, float | None]:
        """``final_only``: the same steps as a streamed answer, paced and abortable; returns how many ran
        (``longest`` unless aborted) and when the first token was made. A coroutine, not a generator:
        nothing is yielded until the end (:meth:`_whole`)."""
        held = self._held
        if not pace and request_id not in self._aborted:  # nothing to wait for: no step can see an abort
            held[request_id] += sum(len(words) for words, _, _ in outputs)
            return longest, time.monotonic()
        made, first = self._made, None
        made[request_id] = 0
        for step in range(longest):
            if request_id in self._aborted:
                return step, first
            if step:
                await asyncio.sleep(pace)
            if first is None:
                first = time.monotonic()
            tokens = sum(step < len(words) for words, _, _ in outputs)
            held[request_id] += tokens
            made[request_id] += tokens
        return longest, first

    def _whole(self, outputs: list[tuple[list[str], str, str | None]], longest: int, done: int,
               first: float | None, logprobs: int | None) -> list[Delta]:
        """``final_only``: each completion as one delta once ``done`` steps ran (an abort gives what
        each had so far, finish ``abort``)."""
        out = []
        for i, (words, finish, stop) in enumerate(outputs):
            if done < longest:
                words, finish, stop = words[:done], "abort", None
            out.append(Delta("".join(words), len(words), finish, i, stop,
                             tuple(self._logprob(w, logprobs) for w in words) if logprobs is not None else (),
                             tuple(map(_token_id, words)), first_token_at=first if words else None))
        return out

    def tokens_so_far(self, request_id: str) -> int:
        return self._made.get(request_id, 0)

    def _output(self, prompt: Prompt, options: SamplingOptions, index: int) -> tuple[list[str], str, str | None]:
        """Completion ``index``'s tokens (text pieces), finish reason and matched stop string."""
        seed = prompt.text.encode() + (b"" if index == 0 else f"#{index}".encode())
        digest = hashlib.sha256(seed).digest()
        schema = self._schema(options)
        if options.structured is not None and options.structured.kind == "choice" and options.tools is None:
            choices = json.loads(options.structured.schema or '[""]')
            whole = choices[digest[0] % len(choices)]  # one of the choices, as it is (not as JSON)
            schema = {}
        elif schema is not None:
            whole = json.dumps(_instance(schema, digest), separators=(",", ":"))
        if schema is not None:
            pieces = [whole[i:i + JSON_TOKEN_CHARS] for i in range(0, len(whole), JSON_TOKEN_CHARS)]
        else:
            # the synthetic engine's own end of sequence is after output_tokens; ignore_eos runs past it
            # (and min_tokens holds it off, as vLLM holds off the end-of-sequence token)
            count = options.max_tokens if options.ignore_eos else \
                min(options.max_tokens, max(self.output_tokens, options.min_tokens))
            size = len(digest)
            pieces = [_LATER_BY_BYTE[digest[i % size]] for i in range(count)]
            if pieces:
                pieces[0] = _FIRST_BY_BYTE[digest[0]]
        if not any(options.stop):  # nothing to cut at: the common case, without the per-piece scan
            kept = pieces[:options.max_tokens]
            finish = "length" if len(kept) < len(pieces) or (schema is None and len(kept) >= options.max_tokens) \
                else "stop"
            return kept, finish, None
        text, kept = "", []
        for piece in pieces[:options.max_tokens]:
            text += piece
            hit = min(((text.find(s), s) for s in options.stop if s and s in text), default=None)
            if hit is not None:  # as vLLM: the output ends before the stop string, which is not returned
                cut = hit[0] - (len(text) - len(piece))
                if options.include_stop_str_in_output:  # ... unless asked to keep it
                    cut += len(hit[1])
                if cut > 0:
                    kept.append(piece[:cut])
                return kept, "stop", hit[1]
            kept.append(piece)
        finish = "length" if len(kept) < len(pieces) or (schema is None and len(kept) >= options.max_tokens) \
            else "stop"
        return kept, finish, None

    @staticmethod
    def _schema(options: SamplingOptions) -> dict[str, Any] | None:
        if options.tools is not None and options.tools.choice in ("required", "function"):
            return forced.forced_schema(options.tools)
        if options.structured is not None:
            if options.structured.kind == "json_object":
                return {"type": "object"}

            return json.loads(options.structured.schema or "{}")
        return None

    @staticmethod
    def _logprob(word: str, top: int) -> TokenLogprob:
        """Each word is picked with probability 1/len(_WORDS): that is its true logprob, and every
        other word is as likely."""
        lp = -math.log(len(_WORDS))
        return TokenLogprob(word, lp, tuple((w, lp) for w in _WORDS[:top]))

    async def abort(self, request_id: str) -> None:
        if request_id in self._held:
            self._aborted.add(request_id)

    def stats(self) -> EngineStats:
        used = sum(self._held.values())
        return EngineStats(running=len(self._held), waiting=0,
                           kv_cache_usage=min(1.0, used / self.kv_capacity_tokens))


@functools.lru_cache(maxsize=1 << 16)
def _token_id(piece: str) -> int:
    """A word's (or output piece's) token id: a hash, as stable as a vocabulary (cached: a prompt's and
    an answer's words repeat, and this runs once per word of each)."""
    return int.from_bytes(hashlib.blake2b(piece.encode(), digest_size=4).digest(), "big") % VOCAB_SIZE


def _instance(schema: dict[str, Any], digest: bytes) -> Any:
    """A minimal value of ``schema``: see the module docstring for what is and is not covered."""
    if "enum" in schema:
        return schema["enum"][0]
    if "const" in schema:
        return schema["const"]
    for key in ("anyOf", "oneOf", "allOf"):
        if schema.get(key):
            return _instance(schema[key][0], digest)
    kind = schema.get("type", "object")
    if isinstance(kind, list):
        kind = kind[0]
    if kind == "object":
        props = schema.get("properties", {})
        return {name: _instance(props.get(name, {}), digest) for name in schema.get("required", [])}
    if kind == "array":
        return [_instance(schema.get("items", {}), digest) for _ in range(schema.get("minItems", 0))]
    if kind == "string":
        return _WORDS[digest[0] % len(_WORDS)]
    if kind in ("integer", "number"):
        return digest[1]
    if kind == "boolean":
        return True
    return None
