"""Request fields of the three APIs: each honoured one reaches the engine's options, each refused or
unknown one is a 400 naming it (issue 15), and the response builders say what the engine did."""

from __future__ import annotations

import json

import pytest

from zerolayer.runtime.api import anthropic, openai
from zerolayer.runtime.api.common import Choice
from zerolayer.runtime.engine.base import StructuredOutput, TokenLogprob, ToolCall, ToolUse
from tests.unit.runtime.test_runtime_api import events as sse_events
from zerolayer.runtime.errors import RequestRefused

USER = [{"role": "user", "content": "hi"}]
WEATHER = {"type": "function", "function": {
    "name": "weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ANTHROPIC_WEATHER = {"name": "weather", "description": "the weather in a city",
                     "input_schema": WEATHER["function"]["parameters"]}


def chat(**fields):
    return openai.parse(json.dumps({"model": "m", "messages": USER, **fields}).encode())


def messages(**fields):
    return anthropic.parse(json.dumps({"model": "m", "max_tokens": 8, "messages": USER, **fields}).encode())


def refused(parse, **fields) -> str:
    with pytest.raises(RequestRefused) as info:
        parse(**fields)
    assert info.value.http_status is None or info.value.http_status == 400
    return info.value.message


# ---------------------------------------------------------------- unknown and refused fields

@pytest.mark.parametrize("parse", [chat, messages])
def test_an_unknown_field_is_refused_naming_it(parse):
    assert refused(parse, frobnicate=1) == "frobnicate: unknown field"


@pytest.mark.parametrize("field, value", [
    ("audio", {"voice": "alloy", "format": "wav"}), ("modalities", ["text", "audio"]),
    ("functions", [{"name": "f"}]), ("prediction", {"type": "content", "content": "x"}),
    ("reasoning_effort", "high"), ("service_tier", "flex"), ("store", True), ("metadata", {"k": "v"}),
    ("web_search_options", {}), ("verbosity", "low"),
])
def test_openai_refused_fields_name_the_field_and_the_reason(field, value):
    message = refused(chat, **{field: value})
    assert message.startswith(f"{field}: not supported: ")


@pytest.mark.parametrize("field, value", [
    ("store", False), ("service_tier", "auto"), ("modalities", ["text"]), ("metadata", {}), ("audio", None),
])
def test_openai_refused_fields_at_their_neutral_value_pass(field, value):
    chat(**{field: value})


@pytest.mark.parametrize("field, value", [
    ("thinking", {"type": "enabled", "budget_tokens": 1024}), ("service_tier", "priority"),
    ("container", "c1"), ("mcp_servers", [{"type": "url", "url": "u", "name": "n"}]),
])
def test_anthropic_refused_fields_name_the_field(field, value):
    assert refused(messages, **{field: value}).startswith(f"{field}: not supported: ")


def test_nested_unknown_fields_are_named_with_their_path():
    assert refused(chat, messages=[{"role": "user", "content": "x", "nmae": "typo"}]) == \
        "messages[0].nmae: unknown field"
    assert refused(messages, metadata={"user": "u"}) == "metadata.user: unknown field"
    message = refused(messages, messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}])
    assert "only text content blocks" in message


# ---------------------------------------------------------------- sampling fields

def test_openai_sampling_fields_reach_the_engine_options():
    options = chat(top_k=5, presence_penalty=0.5, frequency_penalty=-0.5, logit_bias={"17": 10, "3": -100},
                   logprobs=True, top_logprobs=3, n=3, seed=7, stop=["\n"], user="u-1").sampling_options()
    assert (options.top_k, options.presence_penalty, options.frequency_penalty) == (5, 0.5, -0.5)
    assert options.logit_bias == ((17, 10.0), (3, -100.0))
    assert (options.logprobs, options.n, options.seed, options.stop) == (3, 3, 7, ("\n",))


def test_openai_defaults_leave_every_option_at_its_default():
    request = chat()
    assert request.sampling_options().set_fields() == []
    assert request.logprobs is None and request.n == 1 and request.tool_use is None


@pytest.mark.parametrize("fields, named", [
    ({"n": 0}, "n"), ({"n": 17}, "n"), ({"top_k": -2}, "top_k"), ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"), ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"1": 101}}, "logit_bias"), ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"), ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"), ({"user": 5}, "user"),
    ({"stream": True, "stream_options": {"include_usage": True, "frobnicate": True}}, "stream_options.frobnicate"),
])
def test_openai_bad_sampling_values_name_the_field(fields, named):
    assert named in refused(chat, **fields)


def test_top_k_zero_and_minus_one_mean_all_tokens():
    assert chat(top_k=0).top_k is None and chat(top_k=-1).top_k is None and messages(top_k=40).top_k == 40


def test_anthropic_stop_reason_stop_sequence_carries_the_matched_sequence():
    choice = Choice(0, "abc", "stop", 3, stop_sequence="END")
    body = anthropic.message_of("id", "m", choice, {"input_tokens": 1, "output_tokens": 3})
    assert (body["stop_reason"], body["stop_sequence"]) == ("stop_sequence", "END")
    plain = anthropic.message_of("id", "m", Choice(0, "abc", "stop", 3), {})
    assert (plain["stop_reason"], plain["stop_sequence"]) == ("end_turn", None)
    assert anthropic.message_of("id", "m", Choice(0, "abc", "length", 3), {})["stop_reason"] == "max_tokens"
    end = anthropic.stream_end("stop_sequence", 1, 3, stop_sequence="END").decode()
    assert '"stop_sequence":"END"' in end


def test_openai_logprobs_and_n_choices_in_the_response():
    lps = (TokenLogprob("a", -0.5, (("a", -0.5), ("b", -1.5))),)
    body = openai.chat_completion("c", 1, "m", [Choice(0, "a", "stop", 1, logprobs=lps),
                                                Choice(1, "b", "length", 1, logprobs=lps)],
                                  openai.usage(2, 2), logprobs=True)
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert [c["finish_reason"] for c in body["choices"]] == ["stop", "length"]
    entry = body["choices"][0]["logprobs"]["content"][0]
    assert entry == {"token": "a", "logprob": -0.5, "bytes": [97],
                     "top_logprobs": [{"token": "a", "logprob": -0.5, "bytes": [97]},
                                      {"token": "b", "logprob": -1.5, "bytes": [98]}]}
    legacy = openai.completion_logprobs(lps + (TokenLogprob("bc", -1.0),))
    assert legacy["text_offset"] == [0, 1] and legacy["tokens"] == ["a", "bc"]


# ---------------------------------------------------------------- response_format

def test_response_format_json_object_and_json_schema():
    assert chat(response_format={"type": "text"}).structured is None
    assert chat(response_format={"type": "json_object"}).structured == StructuredOutput("json_object")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    structured = chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}).structured
    assert structured.kind == "json_schema" and json.loads(structured.schema) == schema
    assert "response_format" in refused(chat, response_format={"type": "json_schema", "json_schema": {"name": "x"}})
    assert "response_format" in refused(chat, response_format={"type": "grammar"})


# ---------------------------------------------------------------- tools

def test_openai_tools_and_choices():
    request = chat(tools=[WEATHER])
    assert request.tool_use == ToolUse(request.tools, "auto") and request.tools[0].name == "weather"
    assert chat(tools=[WEATHER], tool_choice="none").tool_use is None
    assert chat(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False).tool_use.parallel is False
    named = chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "weather"}}).tool_use
    assert (named.choice, named.function) == ("function", "weather")
    assert "not among the tools" in refused(chat, tools=[WEATHER],
                                            tool_choice={"type": "function", "function": {"name": "nope"}})
    assert "tool_choice needs tools" in refused(chat, tool_choice="required")
    assert "only function tools" in refused(chat, tools=[{"type": "custom", "custom": {"name": "x"}}])


def test_openai_tool_messages_keep_calls_and_ids():
    history = [*USER,
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city":"Oslo"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "rain"}]
    request = chat(messages=history, tools=[WEATHER])
    assert request.messages[1].tool_calls == (ToolCall("call_1", "weather", '{"city":"Oslo"}'),)
    assert (request.messages[2].role, request.messages[2].tool_call_id) == ("tool", "call_1")
    assert "tool_call_id" in refused(chat, messages=[{"role": "tool", "content": "x"}])


def test_anthropic_tools_tool_use_and_tool_result_blocks():
    history = [*USER,
               {"role": "assistant", "content": [{"type": "text", "text": "checking"},
                                                 {"type": "tool_use", "id": "tu_1", "name": "weather",
                                                  "input": {"city": "Oslo"}}]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "tu_1", "content": "rain"},
                                            {"type": "text", "text": "and tomorrow?"}]}]
    request = messages(messages=history, tools=[ANTHROPIC_WEATHER], tool_choice={"type": "any"})
    roles = [m.role for m in request.messages]
    assert roles == ["user", "assistant", "tool", "user"]
    assert request.messages[1].tool_calls[0].name == "weather" and request.messages[2].tool_call_id == "tu_1"
    assert request.tool_use.choice == "required" and not request.continue_final
    named = messages(tools=[ANTHROPIC_WEATHER], tool_choice={"type": "tool", "name": "weather"}).tool_use
    assert (named.choice, named.function) == ("function", "weather")
    assert messages(tools=[ANTHROPIC_WEATHER], tool_choice={"type": "none"}).tool_use is None
    assert "server tools" in refused(messages, tools=[{"type": "web_search_20250305", "name": "web_search"}])


def test_tool_calls_in_responses():
    call = ToolCall("call_1", "weather", '{"city":"Oslo"}')
    choice = Choice(0, "", "stop", 5, tool_calls=(call,))
    body = openai.chat_completion("c", 1, "m", [choice], openai.usage(1, 5))
    message = body["choices"][0]["message"]
    assert message["content"] is None and body["choices"][0]["finish_reason"] == "tool_calls"
    assert message["tool_calls"] == [{"id": "call_1", "type": "function",
                                      "function": {"name": "weather", "arguments": '{"city":"Oslo"}'}}]
    forced = openai.chat_completion("c", 1, "m", [choice], {}, tool_use=ToolUse((), "function", "weather"))
    assert forced["choices"][0]["finish_reason"] == "stop"  # OpenAI's word for a named forced call
    reply = anthropic.message_of("id", "m", choice, {})
    assert reply["stop_reason"] == "tool_use"
    assert reply["content"] == [{"type": "tool_use", "id": "call_1", "name": "weather", "input": {"city": "Oslo"}}]


# ---------------------------------------------------------------- prefill, completions

def test_anthropic_assistant_prefill_is_continued():
    request = messages(messages=[*USER, {"role": "assistant", "content": "The answer is"}])
    assert request.continue_final and request.messages[-1].content == "The answer is"
    assert not messages().continue_final


def test_openai_continue_final_message_is_vllms_extra_field():
    assert chat(messages=[*USER, {"role": "assistant", "content": "x"}], continue_final_message=True).continue_final
    assert "continue_final_message" in refused(chat, continue_final_message=True)


def test_completions_parse():
    request = openai.parse_completions(json.dumps(
        {"model": "m", "prompt": "Once upon", "logprobs": 2, "n": 2, "echo": False}).encode())
    assert request.prompts == ("Once upon",) and request.messages == () and request.logprobs == 2
    assert request.max_tokens == openai.COMPLETIONS_DEFAULT_MAX_TOKENS and request.n == 2
    for bad, named in [({"prompt": ["a", 1]}, "prompt"), ({"prompt": "a", "echo": True, "logprobs": 1}, "echo"),
                       ({"prompt": "a", "suffix": "z"}, "suffix"), ({"prompt": "a", "best_of": 3}, "best_of"),
                       ({"prompt": "a", "logprobs": -1}, "logprobs"), ({"prompt": "a", "max_tokens": 0}, "max_tokens")]:
        with pytest.raises(RequestRefused) as info:
            openai.parse_completions(json.dumps({"model": "m", **bad}).encode())
        assert named in info.value.message
    body = openai.text_completion("cmpl", 1, "m", [Choice(0, " there", "length", 2)], openai.usage(2, 2))
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == " there"


# ---------------------------------------------------------------- assembling the engine's deltas

def test_assembler_collects_n_choices_and_parses_forced_tool_calls():
    from zerolayer.runtime.api.common import Assembler
    from zerolayer.runtime.engine.base import Delta
    from zerolayer.runtime.engine.tools import parse_forced

    request = chat(n=2, tools=[WEATHER], tool_choice="required")
    assembler = Assembler(request, parse_forced)
    for delta in [Delta('[{"name":"weather",', 3, index=0), Delta("x", 1, index=1),
                  Delta('"parameters":{"city":"Oslo"}}]', 5, "stop", index=0), Delta("y", 1, "length", index=1)]:
        assembler.add(delta)
    first, second = assembler.choices()
    assert (first.text, [c.name for c in first.tool_calls], first.tokens) == ("", ["weather"], 8)
    assert (second.text, second.tool_calls, second.finish) == ("xy", (), "length")  # cut short: text as it is
    plain = Assembler(chat(stop=["END"]), parse_forced)
    delta = Delta("abc", 2, "stop", stop_sequence="END")
    assert plain.add(delta) == (delta, ()) and plain.choices()[0].stop_sequence == "END"


def test_assembler_streams_each_choices_tool_calls_as_they_are_found():
    from zerolayer.runtime.api.common import Assembler
    from zerolayer.runtime.engine.base import Delta, ToolCallPiece
    from zerolayer.runtime.engine.tool_stream import ForcedCallStream
    from zerolayer.runtime.engine.tools import parse_forced

    assembler = Assembler(chat(n=2, tools=[WEATHER], tool_choice="required"), parse_forced, ForcedCallStream)
    assert assembler.add(Delta('[{"name":"wea', 3, index=0)) is None  # nothing known yet
    sent, (start,) = assembler.add(Delta('ther","parameters":{"ci', 3, index=0))
    assert (sent.text, start.index, start.name, start.arguments) == ("", 0, "weather", '{"ci')
    assert assembler.add(Delta('ty":"Oslo"}}]', 3, "stop", index=0))[1] == (ToolCallPiece(0, 'ty": "Oslo"}'),)
    sent, calls = assembler.add(Delta("nope", 1, "length", index=1))  # never a call: its text, as unstreamed
    assert (sent.index, sent.text, calls) == (1, "nope", ())
    first, second = assembler.choices()
    assert first.tool_calls[0].arguments == '{"city": "Oslo"}' and second.text == "nope"


def test_anthropic_stream_opens_a_block_per_text_run_and_per_call():
    from zerolayer.runtime.api.common import ContentBlocks
    from zerolayer.runtime.engine.base import ToolCallPiece

    blocks = ContentBlocks()
    raw = anthropic.stream_start("m1", "m", 4, text_block=False)
    raw += anthropic.stream_piece(blocks, "let me check", ())
    raw += anthropic.stream_piece(blocks, "", (ToolCallPiece(0, '{"ci', "tu_1", "weather"),))
    raw += anthropic.stream_piece(blocks, "", (ToolCallPiece(0, 'ty": "Oslo"}'), ToolCallPiece(1, "{}", "tu_2", "clock")))
    choice = Choice(0, "let me check", "stop", 9, tool_calls=(ToolCall("tu_1", "weather", '{"city": "Oslo"}'),))
    raw += anthropic.stream_close(choice, 4, 9, blocks)
    events = sse_events(raw)
    assert [name for name, _ in events] == [
        "message_start", "ping", "content_block_start", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert events[5][1]["content_block"] == {"type": "tool_use", "id": "tu_1", "name": "weather", "input": {}}
    assert "".join(e[1]["delta"]["partial_json"] for e in events[6:8]) == '{"city": "Oslo"}'
    assert [e[1]["index"] for e in events[2:12] if "index" in e[1]] == [0, 0, 0, 1, 1, 1, 1, 2, 2, 2]
    assert events[12][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    # An answer that opened no block still has its (empty) text block, as the non-streamed one.
    empty = sse_events(anthropic.stream_close(Choice(0, "", "stop", 0), 1, 0, ContentBlocks()))
    assert [name for name, _ in empty][:2] == ["content_block_start", "content_block_stop"]


def test_openai_tool_call_chunks_and_stream_close_per_choice():
    from zerolayer.runtime.engine.base import Delta, ToolCallPiece

    start = openai.stream_piece("c", 1, "m", Delta("", 1), calls=(ToolCallPiece(0, "", "call_1", "weather"),))
    more = openai.stream_piece("c", 1, "m", Delta("", 1), calls=(ToolCallPiece(0, '{"city"'),))
    (first,), (second,) = ([e["choices"][0]["delta"] for _, e in sse_events(r)] for r in (start, more))
    assert first == {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                     "function": {"name": "weather", "arguments": ""}}]}
    assert second == {"tool_calls": [{"index": 0, "function": {"arguments": '{"city"'}}]}
    calls = (ToolCall("call_1", "weather", "{}"),)
    raw = openai.stream_close("c", 1, "m", [Choice(0, "", "stop", 2, tool_calls=calls), Choice(1, "hi", "length", 2)],
                              openai.usage(1, 4), include_usage=True, tool_use=ToolUse((), "required"))
    events = [data for _, data in sse_events(raw)]
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 4
    finishes = {e["choices"][0]["index"]: e["choices"][0]["finish_reason"] for e in events[:-2]
                if e["choices"] and e["choices"][0]["finish_reason"]}
    assert finishes == {0: "tool_calls", 1: "length"}


def test_anthropic_sdk_tool_use_block_sent_back_as_history_is_taken():
    block = {"id": "tu_1", "caller": None, "input": {}, "name": "weather", "type": "tool_use", "toolset_name": None}
    history = [*USER, {"role": "assistant", "content": [block]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "tu_1", "content": "rain"}]}]
    assert messages(messages=history, tools=[ANTHROPIC_WEATHER]).messages[1].tool_calls[0].id == "tu_1"
    block["caller"] = {"type": "code_execution_20250825", "tool_id": "x"}
    assert "caller: not supported" in refused(messages, messages=[*USER, {"role": "assistant", "content": [block]}, *USER])



def test_ignore_eos_reaches_the_engine_and_runs_past_the_synthetic_end():
    """vLLM's extension that `vllm bench serve` always sends: honoured, not a 400."""
    import asyncio

    from zerolayer.runtime.engine.base import ChatMessage
    from zerolayer.runtime.engine.synthetic import SyntheticEngine

    body = {"model": "m", "max_tokens": 20, "ignore_eos": True, "messages": [{"role": "user", "content": "hi"}]}
    options = openai.parse(json.dumps(body).encode()).sampling_options()
    assert options.ignore_eos is True
    assert openai.parse_completions(json.dumps({"model": "m", "prompt": "hi", "max_tokens": 5, "ignore_eos": True})
                                    .encode()).sampling_options().ignore_eos is True
    with pytest.raises(RequestRefused, match="ignore_eos"):
        openai.parse(json.dumps({**body, "ignore_eos": "yes"}).encode())

    engine = SyntheticEngine(output_tokens=4)

    async def tokens(opts):  # type: ignore[no-untyped-def]
        prompt = await engine.render("m", [ChatMessage("user", "hi")])
        return sum([d.token_count async for d in engine.generate(prompt, opts, "r", 0)])

    assert asyncio.run(tokens(options)) == 20
    assert asyncio.run(tokens(openai.parse(json.dumps({**body, "ignore_eos": False}).encode())
                              .sampling_options())) == 4
