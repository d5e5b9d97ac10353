"""Tool calls streamed as they are generated (runtime/engine/tool_stream.py): the forced-JSON scanner
split at every position gives what the non-streamed parse gives, and vLLM's streaming parsers are
fed as vllm serve feeds them."""

from __future__ import annotations

import json
import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zerolayer.runtime.engine import tools as forced
from zerolayer.runtime.engine.base import Delta, ToolCallPiece, ToolSpec, ToolUse
from zerolayer.runtime.engine.tool_stream import ForcedCallStream, JsonEcho, ParserCallStream
from zerolayer.runtime.errors import EngineError

WEATHER = ToolSpec("weather", "", json.dumps({"type": "object", "properties": {"city": {"type": "string"}}}))
CLOCK = ToolSpec("clock", "", json.dumps({"type": "object", "properties": {}}))
REQUIRED = ToolUse((WEATHER, CLOCK), "required")
NAMED = ToolUse((WEATHER, CLOCK), "function", "weather", parallel=False)

# JSON values as a model writes them: free whitespace, escapes json.dumps writes differently
# (\/, \u00e9, a surrogate pair), numbers it re-writes (2.50, 1E2, -0), nesting, empty containers.
VALUES = [
    '{"city":"Oslo","unit":"C"}',
    ' { "a" : [1, 2.50, -0, 1E2, true, null, false] ,"b":{"c":"x\\"y\\\\z\\u00e9\\ud83d\\ude00\\/\\n"} } ',
    '{}',
    '{"a":{},"b":[],"c":[{}]}',
    '{"\\u0041":"\\\\ud83d","k":"Å ü 日本"}',
]


def splits(text: str):
    """``text`` cut into three pieces at every pair of positions (every single cut included)."""
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            yield [text[:i], text[i:j], text[j:]]


def echo(pieces: list[str]) -> str:
    value, out = JsonEcho(), []
    for piece in pieces:
        written, used = value.feed(piece)
        out.append(written)
        if value.done:
            assert piece[used:].strip() == ""  # the value ends where the JSON ends
            break
    return "".join(out) + value.finish()


@pytest.mark.parametrize("text", VALUES)
def test_json_echo_writes_what_json_dumps_writes_whatever_the_cuts(text):
    whole = json.dumps(json.loads(text), ensure_ascii=False)
    for pieces in splits(text):
        assert echo(pieces) == whole, pieces
    assert echo(list(text)) == whole


# Any JSON a structured output can produce, written any way a model may write it (escaped or not, with
# free whitespace), cut anywhere: the echo always writes what json.dumps writes.
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)
OBJECTS = st.dictionaries(st.text(max_size=8), JSON, max_size=4)
STYLE = st.fixed_dictionaries({"ensure_ascii": st.booleans(), "indent": st.sampled_from([None, 0, 1]),
                               "separators": st.sampled_from([(",", ":"), (", ", ": "), (" ,", " : ")])})


def cuts(text: str, at: list[int]) -> list[str]:
    points = sorted({min(a, len(text)) for a in at})
    return [text[i:j] for i, j in zip([0, *points], [*points, len(text)])]


@settings(max_examples=300, deadline=None, derandomize=True)
@given(value=JSON, style=STYLE, at=st.lists(st.integers(min_value=0, max_value=400), max_size=12))
def test_json_echo_property(value, style, at):
    text = json.dumps(value, **style)
    assert echo(cuts(text, at)) == json.dumps(value, ensure_ascii=False)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(arguments=st.lists(OBJECTS, min_size=1, max_size=3), style=STYLE,
       at=st.lists(st.integers(min_value=0, max_value=600), max_size=12))
def test_forced_scanner_property(arguments, style, at):
    calls = [{"name": "weather" if i % 2 else "clock", "parameters": a} for i, a in enumerate(arguments)]
    text = json.dumps(calls, **style)
    assert stream(REQUIRED, cuts(text, at))[:2] == parsed(REQUIRED, text)
    text = json.dumps(arguments[0], **style)
    assert stream(NAMED, cuts(text, at))[:2] == parsed(NAMED, text)


def test_json_echo_says_where_the_value_ends():
    value = JsonEcho()
    assert value.feed('{"a": "}"') == ('{"a": "}"', 9) and not value.done
    assert value.feed('}], "next"') == ("}", 1) and value.done


def stream(use: ToolUse, pieces: list[str], finish: str = "stop") -> tuple[str, list[tuple[str, str]], int]:
    """Feed ``pieces`` as deltas; the content, the calls joined from their pieces (name, arguments)
    and how many deltas carried arguments before the last one."""
    calls: dict[int, list[str]] = {}
    content, early = "", 0
    scanner = ForcedCallStream(use)
    for k, piece in enumerate(pieces):
        last = k == len(pieces) - 1
        step = scanner.feed(Delta(piece, 1, finish if last else None))
        content += step.content
        for call in step.calls:
            if call.id is not None:
                assert call.index not in calls and call.id.startswith("call_") and call.name
                calls[call.index] = [call.name, ""]
            calls[call.index][1] += call.arguments
            early += bool(call.arguments) and not last
    return content, [(name, arguments) for name, arguments in (calls[i] for i in sorted(calls))], early


def parsed(use: ToolUse, text: str) -> tuple[str, list[tuple[str, str]]]:
    content, calls = forced.parse_forced(text, use)
    return content, [(c.name, c.arguments) for c in calls]


REQUIRED_OUTPUTS = [
    '[{"name":"weather","parameters":{"city":"Oslo"}},{"name":"clock","parameters":{}}]',
    ' [ { "parameters" : {"city": "\\u00d8rsta", "n": [1, 2e1]} , "name" : "weather" } ] ',  # parameters first
    '[{"name":"clock"}]',  # no parameters: parse_forced writes {}
    '[{"name":"wea\\u0074her","parameters":{"city":"a,b}]"}}]',
    '[]',
]


@pytest.mark.parametrize("text", REQUIRED_OUTPUTS)
def test_required_calls_streamed_at_every_cut_are_the_parsed_calls(text):
    want = parsed(REQUIRED, text)
    for pieces in splits(text):
        content, calls, _ = stream(REQUIRED, pieces)
        assert (content, calls) == want, pieces


@pytest.mark.parametrize("text", VALUES)
def test_named_function_arguments_streamed_at_every_cut_are_the_parsed_arguments(text):
    if not text.strip().startswith("{"):
        pytest.skip("a named function's output is an object")
    want = parsed(NAMED, text)
    for pieces in splits(text):
        assert stream(NAMED, pieces)[:2] == want, pieces


def test_arguments_arrive_before_the_end_one_piece_per_token():
    text = '[{"name":"weather","parameters":{"city":"Oslo","unit":"C"}}]'
    tokens = [text[i:i + 3] for i in range(0, len(text), 3)]
    content, calls, early = stream(REQUIRED, tokens)
    assert content == "" and calls == parsed(REQUIRED, text)[1] and early >= 5
    scanner = ForcedCallStream(NAMED)
    first = scanner.feed(Delta('{"ci', 1)).calls
    assert [(c.index, c.name, c.arguments) for c in first] == [(0, "weather", '{"ci')] and first[0].id
    assert scanner.feed(Delta('ty": "Oslo"', 1)).calls == (ToolCallPiece(0, 'ty": "Oslo"'),)


def test_output_cut_short_before_a_call_is_content_as_unstreamed_and_after_is_partial():
    # Before a name was read nothing was sent: the text is the content, as the non-streamed answer has it.
    assert stream(REQUIRED, ['[{"na', 'me":"wea'], "length")[:2] == ('[{"name":"wea', [])
    assert stream(REQUIRED, ["not json"], "length")[:2] == ("not json", [])
    # After: the call's pieces went out as they came (vllm serve does the same).
    assert stream(REQUIRED, ['[{"name":"weather","parameters":{"ci', 'ty":"Os'], "length")[:2] == \
        ("", [("weather", '{"city": "Os')])
    assert stream(NAMED, ['{"city":', ' "Os'], "length")[:2] == ("", [("weather", '{"city": "Os')])


def test_a_scanner_says_nothing_after_its_end():
    scanner = ForcedCallStream(NAMED)
    scanner.feed(Delta("{}", 1, "stop"))
    assert scanner.feed(Delta("more", 1)).calls == ()
    with pytest.raises(ValueError):
        ForcedCallStream(ToolUse((WEATHER,), "auto"))


# ---------------------------------------------------------------- vLLM's parsers, streaming

class RecordingParser:
    """Stands in for a vLLM ToolParser: records what it is fed and answers like one."""

    def __init__(self, answers):  # type: ignore[no-untyped-def]
        self.fed: list[tuple] = []
        self.answers = list(answers)
        self.prev_tool_call_arr: list[dict] = []  # what the parser has read (vLLM's parsers keep it)

    def extract_tool_calls_streaming(self, *args):  # type: ignore[no-untyped-def]
        self.fed.append(args)
        return self.answers.pop(0)


class Msg:
    def __init__(self, content=None, tool_calls=None):  # type: ignore[no-untyped-def]
        self.content, self.tool_calls = content, tool_calls


class Call:
    def __init__(self, index, id=None, name=None, arguments=None, as_dict=False):  # type: ignore[no-untyped-def]
        self.index, self.id = index, id
        function = {k: v for k, v in (("name", name), ("arguments", arguments)) if v is not None}

        class F:
            pass

        if as_dict:
            self.function = function
        else:
            self.function = F()
            self.function.name, self.function.arguments = name, arguments


def test_parser_stream_is_fed_like_vllm_serve_feeds_it():
    parser = RecordingParser([Msg(content="Hi "), None,
                              Msg(tool_calls=[Call(0, "call_x", "weather", as_dict=True)]),
                              Msg(tool_calls=[Call(0, arguments='{"city": ')])])
    parser.prev_tool_call_arr = [{"name": "weather", "arguments": {"city": "Oslo"}}]
    request = object()
    calls = ParserCallStream(parser, request)
    steps = [calls.feed(Delta("Hi ", 1, token_ids=(1,))), calls.feed(Delta("[", 1, token_ids=(2,))),
             calls.feed(Delta('{"name":"weather"', 3, token_ids=(3, 4, 5))),
             calls.feed(Delta(', "arguments": {"city": "Oslo"}}]', 4, "stop", token_ids=(6, 7, 8, 9)))]
    assert [s.content for s in steps] == ["Hi ", "", "", ""]
    assert steps[2].calls == (ToolCallPiece(0, "", "call_x", "weather"),)
    assert steps[3].calls == (ToolCallPiece(0, '{"city": "Oslo"}'),)  # the parser's rest goes out at the end
    previous, current, delta, previous_ids, current_ids, delta_ids, given = parser.fed[2]
    assert (previous, current, delta) == ("Hi [", 'Hi [{"name":"weather"', '{"name":"weather"')
    assert (previous_ids, current_ids, delta_ids, given) == ([1, 2], [1, 2, 3, 4, 5], [3, 4, 5], request)


def test_parser_stream_names_a_call_once_and_turns_failures_into_engine_errors():
    parser = RecordingParser([Msg(tool_calls=[Call(1, None, "clock", "{")]),
                              Msg(tool_calls=[Call(1, None, "clock", "}")])])
    calls = ParserCallStream(parser, None)
    (first,) = calls.feed(Delta("x", 1, token_ids=(1,))).calls
    assert first.id.startswith("call_") and first.name == "clock"  # a parser that gives no id: one is made
    assert calls.feed(Delta("y", 1, token_ids=(2,))).calls == (ToolCallPiece(1, "}"),)
    assert calls.feed(Delta("", 0, "stop")).calls == ()  # nothing new: the parser is not asked

    class Broken:
        def extract_tool_calls_streaming(self, *args):  # type: ignore[no-untyped-def]
            raise RuntimeError("bad state")

    with pytest.raises(EngineError, match="bad state"):
        ParserCallStream(Broken(), None).feed(Delta("x", 1, token_ids=(1,)))


def test_an_engine_based_parser_is_flushed_at_the_end():
    class EngineBased(RecordingParser):
        engine_based_streaming = True

        def finish_streaming(self):  # type: ignore[no-untyped-def]
            return Msg(content="held back", tool_calls=[Call(0, arguments='"}')])

    parser = EngineBased([Msg(tool_calls=[Call(0, "call_1", "weather", '{"city": "Os')]), None])
    parser.prev_tool_call_arr = [{"name": "weather", "arguments": {"city": "Oslo"}}]
    calls = ParserCallStream(parser, None)
    assert calls.feed(Delta("a", 1, token_ids=(1,))).calls == (ToolCallPiece(0, '{"city": "Os', "call_1", "weather"),)
    end = calls.feed(Delta("b", 1, "stop", token_ids=(2,)))
    # Flushed first; then nothing is added: what was sent is no longer a prefix of the parsed arguments,
    # and a guess could only send text twice.
    assert (end.content, end.calls) == ("held back", (ToolCallPiece(0, '"}'),))


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_vllms_xlam_parser_streams_a_call_that_joins_to_its_whole_parse():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        pytest.importorskip("vllm", reason="the vllm engine extra is not installed")
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.tool_parsers import ToolParserManager

    from zerolayer.runtime.engine.vllm_engine import tool_schema

    request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": ""}],
                                    tools=[tool_schema(WEATHER)], tool_choice="auto")
    xlam = ToolParserManager.get_tool_parser("xlam")
    text = '[{"name":"weather","arguments":{"city":"Oslo"}}]'
    calls: dict[int, list[str]] = {}
    stream_ = ParserCallStream(xlam(None, request.tools), request)
    tokens = [text[i:i + 4] for i in range(0, len(text), 4)]
    for k, token in enumerate(tokens):
        step = stream_.feed(Delta(token, 1, "stop" if k == len(tokens) - 1 else None, token_ids=(k,)))
        assert step.content == ""
        for piece in step.calls:
            if piece.id is not None:
                calls[piece.index] = [piece.name, ""]
            calls[piece.index][1] += piece.arguments
    whole = xlam(None, request.tools).extract_tool_calls(text, request)
    assert [tuple(v) for v in calls.values()] == [(c.function.name, c.function.arguments) for c in whole.tool_calls]
