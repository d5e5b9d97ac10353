"""Tool calls found while the output streams, sent as they are generated (as ``vllm serve`` does).

Two :class:`~zerolayer.runtime.engine.base.ToolCallStream`\\ s, engine-independent:

- :class:`ForcedCallStream` for forced choices (``"required"``, a named function): the output is
  JSON of the known shape :func:`~zerolayer.runtime.engine.tools.forced_schema` constrains it to, so a
  small incremental scanner of that shape finds each call's name and passes its arguments on as
  they come. The arguments are re-written token by token (:class:`JsonEcho`) exactly as the
  non-streamed answer writes them (``json.dumps`` of the parsed value), so a client that joins the
  streamed pieces gets the same string the non-streamed answer carries.
- :class:`ParserCallStream` for ``"auto"``: one of vLLM's tool-call parsers in streaming mode
  (``extract_tool_calls_streaming``), fed the text and token ids the way vLLM's own
  ``serving_chat`` feeds it; its granularity is the parser's own (vllm_engine.py builds it).

Why a hand scanner rather than a partial-JSON library (``partial_json_parser``, which vLLM's
parsers use): such a library re-parses the whole prefix on every token (quadratic in the output)
and returns a *value* whose re-serialisation may later change behind what was already sent (a
number ``1`` that becomes ``12``, a string closed early); the parsers built on it then diff
serialisations to guess what is safe to send. The forced shape is fixed and small, so a
single-pass scanner that only ever emits what can no longer change is both exact and linear.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from zerolayer.runtime.engine import tools as forced
from zerolayer.runtime.engine.base import Delta, ToolCallPiece, ToolStreamStep, ToolUse
from zerolayer.runtime.errors import EngineError

_SPACE = " \t\n\r"
_SCALAR_END = _SPACE + ",]}:"
_SEPARATORS = {",": ", ", ":": ": "}  # json.dumps' defaults


class JsonEcho:
    """Re-writes one JSON value, fed in pieces of any size, as ``json.dumps(json.loads(value),
    ensure_ascii=False)`` writes it, emitting each part once it can no longer change.

    Whitespace between tokens is dropped and json.dumps' separators (``", "``, ``": "``) written;
    strings are re-escaped one complete escape at a time (a UTF-16 surrogate pair whole), numbers
    and literals once they end (``1E2`` becomes ``100.0``). The concatenated output equals the
    re-serialised value for valid JSON; the one exception is an object with a duplicate key
    (json.loads keeps the last value; what was streamed cannot be taken back).

    ``done`` once the value is complete; :meth:`feed` then stops at its end and says how much of
    the piece it used. Not a validator: the engine's structured output guarantees the JSON.
    """

    def __init__(self) -> None:
        self.done = False
        self._depth = 0
        self._mode = "value"  # "value" (between tokens) | "string" | "scalar"
        self._pending: list[str] = []  # raw text of the string or scalar being read
        self._escape = 0  # characters still owed to the escape being read (-1: the one after "\")

    def feed(self, text: str) -> tuple[str, int]:
        """The re-written output ``text`` adds, and how many of its characters belong to the value
        (all of them unless the value ended inside ``text``)."""
        out: list[str] = []
        for i, ch in enumerate(text):
            if self._mode == "string":
                self._string_char(ch, out)
                if self.done:
                    return "".join(out), i + 1
                continue
            if self._mode == "scalar":
                if ch not in _SCALAR_END:
                    self._pending.append(ch)
                    continue
                self._end_scalar(out)
                if self.done:
                    return "".join(out), i
            if ch in _SPACE:
                continue
            if ch in "{[":
                self._depth += 1
                out.append(ch)
            elif ch in "}]":
                self._depth -= 1
                out.append(ch)
                if self._depth <= 0:
                    self.done = True
                    return "".join(out), i + 1
            elif ch in _SEPARATORS:
                out.append(_SEPARATORS[ch])
            elif ch == '"':
                self._mode = "string"
                out.append('"')
            else:
                self._mode = "scalar"
                self._pending.append(ch)
        if self._mode == "string":
            self._flush_string(out, final=False)
        return "".join(out), len(text)

    def finish(self) -> str:
        """What is still held back when the output ends (a cut-short value: written as far as it goes)."""
        out: list[str] = []
        if self._mode == "scalar":
            self._end_scalar(out)
        elif self._mode == "string":
            self._flush_string(out, final=True)
        return "".join(out)

    def _string_char(self, ch: str, out: list[str]) -> None:
        """Take one character inside a string (its closing quote ends it)."""
        if self._escape:
            self._pending.append(ch)
            self._escape = (4 if ch == "u" else 0) if self._escape == -1 else self._escape - 1  # \uXXXX: 4 more
        elif ch == "\\":
            self._pending.append(ch)
            self._escape = -1
        elif ch != '"':
            self._pending.append(ch)
        else:
            self._flush_string(out, final=True)
            out.append('"')
            self._mode = "value"
            self.done = self._depth == 0

    def _flush_string(self, out: list[str], final: bool) -> None:
        raw = "".join(self._pending)
        if not raw:
            return
        cut = len(raw)
        if not final:
            if self._escape:  # inside an escape: it waits for its last character
                cut = raw.rfind("\\")
            if _ends_in_high_surrogate(raw, cut):
                cut -= 6  # a high surrogate escape: the low one that pairs with it may follow
        done, self._pending = raw[:cut], [raw[cut:]] if cut < len(raw) else []
        if "\\" not in done:
            out.append(done)  # valid JSON string text without escapes is written back unchanged
            return
        try:
            out.append(json.dumps(json.loads(f'"{done}"'), ensure_ascii=False)[1:-1])
        except ValueError:  # not JSON after all (a cut-short escape at the end): passed on as it is
            out.append(done)

    def _end_scalar(self, out: list[str]) -> None:
        raw = "".join(self._pending)
        self._pending, self._mode = [], "value"
        try:
            out.append(json.dumps(json.loads(raw)))
        except ValueError:
            out.append(raw)
        if self._depth == 0:
            self.done = True


def _ends_in_high_surrogate(raw: str, end: int) -> bool:
    """``raw[:end]`` (string text between escapes) ends with a ``\\uD800``-``\\uDBFF`` escape."""
    if end < 6 or raw[end - 6:end - 4] != "\\u" or raw[end - 4:end - 2].lower() not in ("d8", "d9", "da", "db"):
        return False
    slashes = len(raw[:end - 5]) - len(raw[:end - 5].rstrip("\\"))
    return slashes % 2 == 1  # an odd run of backslashes: the last one starts the escape (not an escaped "\\")


class _Call:
    """One element of a ``"required"`` array: its name once read, its arguments until it is started."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.name: str | None = None
        self.started = False
        self.held: list[str] = []  # arguments read before the name (an element written parameters-first)
        self.has_arguments = False


class ForcedCallStream:
    """The calls of a forced choice's output, streamed (see the module docstring).

    Named function: the output is the arguments object; the call starts with its first
    character. ``"required"``: ``[{"name": ..., "parameters": {...}}, ...]``; each call starts
    (id, name, arguments so far) once its name is read, then its arguments stream. An output that
    never started a call (cut short before a name) is sent as content at the end, as the
    non-streamed answer returns it (:func:`~zerolayer.runtime.engine.tools.parse_forced`).
    """

    def __init__(self, use: ToolUse, new_id: Callable[[], str] = forced.call_id) -> None:
        if use.choice not in ("required", "function"):
            raise ValueError(f"tool choice {use.choice!r} is not a forced one")
        self.use = use
        self._new_id = new_id
        self._text: list[str] = []
        self._started = False
        self._ended = False
        self._echo: JsonEcho | None = JsonEcho() if use.choice == "function" else None
        # "required": where the scanner is in the array
        self._state = "open"  # open | element | key | colon | value | in_value | end
        self._key: list[str] = []
        self._key_escaped = False
        self._key_name = ""
        self._calls: list[_Call] = []
        self._name: list[str] = []

    def feed(self, delta: Delta) -> ToolStreamStep:
        if self._ended:
            return ToolStreamStep()
        self._text.append(delta.text)
        pieces: list[ToolCallPiece] = []
        if self.use.choice == "function":
            self._named(delta.text, pieces)
        else:
            self._required(delta.text, pieces)
        content = ""
        if delta.finish_reason is not None:
            self._ended = True
            content = self._finish(pieces)
        return ToolStreamStep(content, _merged(pieces))

    # ---------------------------------------------------------------- a named function
    def _named(self, text: str, pieces: list[ToolCallPiece]) -> None:
        assert self._echo is not None
        if self._echo.done:
            return
        out, _ = self._echo.feed(text)
        self._named_out(out, pieces)

    def _named_out(self, out: str, pieces: list[ToolCallPiece]) -> None:
        if not out:
            return
        if not self._started:
            self._started = True
            pieces.append(ToolCallPiece(0, out, self._new_id(), forced.named_tool(self.use).name))
        else:
            pieces.append(ToolCallPiece(0, out))

    # ---------------------------------------------------------------- "required": a list of calls
    def _required(self, text: str, pieces: list[ToolCallPiece]) -> None:
        i = 0
        while i < len(text):
            state = self._state
            if state == "in_value":
                assert self._echo is not None
                out, used = self._echo.feed(text[i:])
                i += used
                self._value_out(out, pieces)
                if self._echo.done:
                    self._state = "key"
                continue
            ch = text[i]
            i += 1
            if state == "key" and self._key:  # inside a key string
                if ch == '"' and not self._key_escaped:
                    name = _loads("".join(self._key) + '"')
                    self._key_name = name if isinstance(name, str) else ""
                    self._key, self._state = [], "colon"
                else:
                    self._key_escaped = ch == "\\" and not self._key_escaped
                    self._key.append(ch)
                continue
            if ch in _SPACE:
                continue
            if state == "open":
                self._state = "element" if ch == "[" else "end"
            elif state == "element":
                if ch == "{":
                    self._calls.append(_Call(len(self._calls)))
                    self._state = "key"
                elif ch == "]":
                    self._state = "end"
            elif state == "key":
                if ch == '"':
                    self._key, self._key_escaped = ['"'], False
                elif ch == "}":
                    self._element_end(pieces)
                    self._state = "element"
            elif state == "colon":
                if ch == ":":
                    self._state = "value"
            elif state == "value":
                self._echo, self._state = JsonEcho(), "in_value"
                self._name = []
                i -= 1  # the value's first character is the echo's
            else:  # "end": after the list (nothing may follow but whitespace)
                return

    def _value_out(self, out: str, pieces: list[ToolCallPiece]) -> None:
        call = self._calls[-1]
        if self._key_name == "parameters":
            call.has_arguments = True
            if call.started:
                if out:
                    pieces.append(ToolCallPiece(call.index, out))
            else:
                call.held.append(out)
        elif self._key_name == "name":
            self._name.append(out)
            assert self._echo is not None
            if self._echo.done:
                name = _loads("".join(self._name))
                if isinstance(name, str) and not call.started:
                    call.name, call.started, self._started = name, True, True
                    pieces.append(ToolCallPiece(call.index, "".join(call.held), self._new_id(), name))
                    call.held = []

    def _element_end(self, pieces: list[ToolCallPiece]) -> None:
        call = self._calls[-1]
        if call.started and not call.has_arguments:
            pieces.append(ToolCallPiece(call.index, "{}"))  # as parse_forced writes a call without parameters

    # ---------------------------------------------------------------- the end
    def _finish(self, pieces: list[ToolCallPiece]) -> str:
        if self._echo is not None and not self._echo.done:
            rest = self._echo.finish()
            if self.use.choice == "function":
                self._named_out(rest, pieces)
            elif self._state == "in_value":
                self._value_out(rest, pieces)
        if self._started:
            return ""
        # No call was started: the output is what the non-streamed answer makes of it.
        content, calls = forced.parse_forced("".join(self._text), self.use)
        pieces.extend(ToolCallPiece(i, c.arguments, c.id, c.name) for i, c in enumerate(calls))
        return content


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _merged(pieces: list[ToolCallPiece]) -> tuple[ToolCallPiece, ...]:
    """Consecutive argument pieces of one call as one piece (one event per call per delta)."""
    out: list[ToolCallPiece] = []
    for piece in pieces:
        last = out[-1] if out else None
        if last is not None and last.index == piece.index and piece.id is None and piece.name is None:
            out[-1] = ToolCallPiece(last.index, last.arguments + piece.arguments, last.id, last.name)
        else:
            out.append(piece)
    return tuple(out)


class ParserCallStream:
    """One of vLLM's tool-call parsers (a ``ToolParser`` instance, made for this completion) in
    streaming mode, as a :class:`~zerolayer.runtime.engine.base.ToolCallStream`.

    Fed as vLLM's ``serving_chat`` feeds it: the text and token ids before this delta, with it, and
    the delta's own; at the end, an engine-based parser is flushed (``finish_streaming``) and the
    arguments the parser read but did not send yet go out with the last call (as serving_chat's
    ``get_remaining_unstreamed_args``, see :meth:`_unsent`). ``request`` is the
    ``ChatCompletionRequest`` carrying the tools. Nothing of vLLM is imported here: the parser's
    ``DeltaMessage`` is read by its field names.
    """

    def __init__(self, parser: Any, request: Any) -> None:
        self._parser = parser
        self._request = request
        self._text = ""
        self._ids: list[int] = []
        self._sent: dict[int, str] = {}  # call index -> the arguments sent so far

    def feed(self, delta: Delta) -> ToolStreamStep:
        message = None
        if delta.text or delta.token_ids:
            current_text = self._text + delta.text
            delta_ids = list(delta.token_ids)
            current_ids = self._ids + delta_ids
            try:
                message = self._parser.extract_tool_calls_streaming(
                    self._text, current_text, delta.text, self._ids, current_ids, delta_ids, self._request)
            except Exception as exc:  # a parser's own failure on odd output: the engine's error, not the client's
                raise EngineError(f"the tool-call parser failed on the streamed output: {exc}") from exc
            self._text, self._ids = current_text, current_ids
        content, pieces = self._read(message)
        if delta.finish_reason is not None:
            if getattr(self._parser, "engine_based_streaming", False):
                # vLLM's engine-based parsers hold text back until told the output ended.
                more, flushed = self._read(self._parser.finish_streaming())
                content, pieces = content + more, pieces + flushed
            pieces.extend(self._unsent())
        return ToolStreamStep(content, _merged(pieces))

    def _read(self, message: Any) -> tuple[str, list[ToolCallPiece]]:
        """A parser's ``DeltaMessage`` (or None) as content and pieces."""
        if message is None:
            return "", []
        return (getattr(message, "content", None) or "",
                [self._piece(call) for call in (getattr(message, "tool_calls", None) or ())])

    def _unsent(self) -> list[ToolCallPiece]:
        """The last call's arguments the parser has read but not sent (a parser sends a call's last
        arguments only when it sees what follows them, and the output may end first). Measured
        against what this stream sent: vLLM's ``get_remaining_unstreamed_args`` reads a counter that
        some parsers (xlam) never update, and would send the whole arguments a second time."""
        parsed = getattr(self._parser, "prev_tool_call_arr", None) or []
        index = len(parsed) - 1
        if index < 0 or index not in self._sent or not isinstance(parsed[index], dict):
            return []
        arguments = parsed[index].get("arguments", parsed[index].get("parameters"))
        if arguments is None:
            return []
        whole = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        sent = self._sent[index]
        return [ToolCallPiece(index, whole[len(sent):])] if len(whole) > len(sent) and whole.startswith(sent) else []

    def _piece(self, call: Any) -> ToolCallPiece:
        function = getattr(call, "function", None)
        if isinstance(function, dict):
            name, arguments = function.get("name"), function.get("arguments")
        else:
            name, arguments = getattr(function, "name", None), getattr(function, "arguments", None)
        index = int(getattr(call, "index", 0) or 0)
        call_id = getattr(call, "id", None)
        if index in self._sent:
            call_id = name = None  # a call starts once; later pieces only add arguments
        else:
            self._sent[index] = ""
            call_id = call_id or forced.call_id()  # a parser that names a call without an id: the client needs one
        self._sent[index] += arguments or ""
        return ToolCallPiece(index, arguments or "", call_id, name)
