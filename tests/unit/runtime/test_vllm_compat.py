"""What `vllm serve`'s users send works unchanged (issue 31): the request fields vLLM 0.32 takes, the
range checks it makes (a 400, never a 500), its extensions, and the answer's shape where the two differ.

Requests go through the wire APIs and the synthetic engine the way a session drives them
(:func:`answer`): parse, render, generate, assemble, format. The real engine's side of the same
fields is in tests/integration/runtime/test_api_fields_vllm.py.
"""

from __future__ import annotations

import json

import pytest

from tests.unit.runtime.test_runtime_api import events
from zerolayer.runtime.api import anthropic, openai
from zerolayer.runtime.api.common import Assembler, Choice, render_prompt
from zerolayer.runtime.api.completions_wire import COMPLETIONS
from zerolayer.runtime.api.openai_wire import OPENAI
from zerolayer.runtime.api.wire import StreamFrame
from zerolayer.runtime.engine import tools as forced
from zerolayer.runtime.engine.base import Delta, InputRejected, Prompt, SamplingOptions, ToolSpec, ToolUse
from zerolayer.runtime.engine.synthetic import VOCAB_SIZE, SyntheticEngine
from zerolayer.runtime.errors import RequestRefused

USER = [{"role": "user", "content": "hi"}]


def chat_body(**fields) -> bytes:
    return json.dumps({"model": "synthetic", "messages": USER, **fields}).encode()


def completions_body(**fields) -> bytes:
    return json.dumps({"model": "synthetic", "prompt": "Once upon a time", **fields}).encode()


def refusal(parse, body: bytes) -> str:
    with pytest.raises(RequestRefused) as info:
        parse(body)
    return info.value.message


async def answer(wire, body: bytes, engine: SyntheticEngine | None = None) -> list | dict:
    """The answer a session gives ``body``: the JSON object, or the stream's parsed SSE events."""
    engine = engine or SyntheticEngine(output_tokens=4)
    await engine.start()
    request = wire.parse(body)
    prompt = await render_prompt(engine, request)
    frame = StreamFrame("id", 1, request)
    deltas = engine.generate(prompt, request.sampling_options(), "r", 0)
    output = 0
    if not request.stream:
        assembler = Assembler(request, engine.parse_tool_calls)
        async for delta in deltas:
            output += delta.token_count
            assembler.add(delta)
        return json.loads(wire.completion(frame, assembler.choices(), prompt.token_count, output))
    assembler = Assembler(request, engine.parse_tool_calls, engine.tool_call_stream)
    sse = wire.stream_start(frame, prompt.token_count)
    async for delta in deltas:
        output += delta.token_count
        sent = assembler.add(delta)
        if sent is not None:
            sse += wire.stream_delta(frame, *sent)
    sse += wire.stream_end(frame, assembler.choices(), prompt.token_count, output)
    return events(sse)


# ---------------------------------------------------------------- client errors are 400s, never 500s

@pytest.mark.parametrize("value", [-2**63 - 1, 2**63, 10**30, "7", 1.5, True])
def test_a_seed_outside_64_bits_is_a_400_in_every_api(value):
    assert "seed" in refusal(openai.parse, chat_body(seed=value))
    assert "seed" in refusal(openai.parse_completions, completions_body(seed=value))
    body = json.dumps({"model": "m", "max_tokens": 4, "messages": USER, "metadata": {"seed": value}}).encode()
    assert "metadata.seed" in refusal(anthropic.parse, body)


@pytest.mark.parametrize("value", [-2**63, 2**63 - 1, 0])
def test_the_64_bit_seed_range_is_taken_whole(value):
    assert openai.parse(chat_body(seed=value)).seed == value


def test_stream_options_need_stream_true_as_vllm_and_openai_say():
    for parse, body in [(openai.parse, chat_body), (openai.parse_completions, completions_body)]:
        assert refusal(parse, body(stream_options={"include_usage": True})) == \
            "stream_options: only with stream: true"
        assert refusal(parse, body(stream=False, stream_options={"include_usage": False})).startswith("stream_options")
        parse(body(stream_options={}))  # empty, as vLLM: nothing asked
        parse(body(stream_options=None))
        assert parse(body(stream=True, stream_options={"include_usage": True})).include_usage


def test_a_bad_logit_bias_names_every_bad_entry():
    message = refusal(openai.parse, chat_body(logit_bias={"abc": 1, "12": 5, "x1": 2, "7": 500, "9": "high",
                                                          "\u00b2": 1}))
    for key in ("'abc'", "'x1'", "'\u00b2'", "7", "9"):
        assert key in message
    assert "12" not in message
    assert openai.parse(chat_body(logit_bias={"12": 5})).logit_bias == ((12, 5.0),)


# ---------------------------------------------------------------- forced tool calls with $ref/$defs

OPTIONS_MODEL = {"type": "object", "properties": {"unit": {"type": "string", "enum": ["c", "f"]}}}
PYDANTIC_PARAMETERS = {  # what pydantic's model_json_schema() writes for a nested model
    "type": "object", "$defs": {"WeatherOptions": OPTIONS_MODEL},
    "properties": {"city": {"type": "string"}, "options": {"$ref": "#/$defs/WeatherOptions"}},
    "required": ["city", "options"]}


def test_required_tool_choice_moves_each_tools_defs_to_the_schemas_root():
    weather = ToolSpec("weather", "", json.dumps(PYDANTIC_PARAMETERS))
    clock = ToolSpec("clock", "", json.dumps({"type": "object", "$defs": {"WeatherOptions": OPTIONS_MODEL},
                                              "properties": {}}))
    schema = forced.forced_schema(ToolUse((weather, clock), "required"))
    assert schema["$defs"] == {"WeatherOptions": OPTIONS_MODEL}
    first = schema["items"]["anyOf"][0]["properties"]["parameters"]
    assert "$defs" not in first and first["properties"]["options"] == {"$ref": "#/$defs/WeatherOptions"}
    named = forced.forced_schema(ToolUse((weather,), "function", "weather"))
    assert named == PYDANTIC_PARAMETERS  # the whole schema: its refs already point at its own $defs


def test_two_tools_defining_one_name_differently_is_a_400():
    weather = ToolSpec("weather", "", json.dumps(PYDANTIC_PARAMETERS))
    other = ToolSpec("other", "", json.dumps({"type": "object", "$defs": {"WeatherOptions": {"type": "string"}}}))
    with pytest.raises(InputRejected, match=r"\$defs/WeatherOptions"):
        forced.forced_schema(ToolUse((weather, other), "required"))


async def test_required_tool_choice_with_defs_is_served():
    tool = {"type": "function", "function": {"name": "weather", "parameters": PYDANTIC_PARAMETERS}}
    body = await answer(OPENAI, chat_body(tools=[tool], tool_choice="required", max_tokens=200))
    (call,) = body["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "weather" and body["choices"][0]["finish_reason"] == "tool_calls"


# ---------------------------------------------------------------- /v1/completions: prompts, echo, logprobs

@pytest.mark.parametrize("prompt, parsed", [
    ("a b", ("a b",)), (["a", "b c"], ("a", "b c")), ([1, 2, 3], ((1, 2, 3),)),
    ([[1, 2], [3]], ((1, 2), (3,))),
])
def test_completions_take_every_prompt_form_openai_documents(prompt, parsed):
    assert openai.parse_completions(completions_body(prompt=prompt)).prompts == parsed


@pytest.mark.parametrize("prompt", [[], "", ["a", ""], [1, "a"], [[1], 2], [[]], [-1], [True], [1.5], {"a": 1},
                                    ["x"] * (openai.MAX_PROMPTS + 1)])
def test_bad_prompts_are_a_400_naming_prompt(prompt):
    assert refusal(openai.parse_completions, completions_body(prompt=prompt)).startswith("prompt")


def test_prompts_times_n_are_bounded():
    assert "n=4" in refusal(openai.parse_completions, completions_body(prompt=["a"] * 17, n=4))


async def test_several_prompts_are_numbered_prompt_by_prompt_as_vllm_does():
    body = await answer(COMPLETIONS, completions_body(prompt=["alpha beta", "gamma delta epsilon"], n=2, max_tokens=3))
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    texts = [c["text"] for c in body["choices"]]
    assert texts[0] != texts[2]  # each prompt its own completions
    assert body["usage"]["prompt_tokens"] == 2 + 3 and body["usage"]["completion_tokens"] == 4 * 3


async def test_out_of_vocabulary_token_ids_are_refused_saying_so():
    engine = SyntheticEngine()
    with pytest.raises(InputRejected, match=f"token id {VOCAB_SIZE} is out of vocabulary"):
        await engine.encode("synthetic", [1, VOCAB_SIZE])


async def test_echo_puts_the_prompt_before_each_completion():
    body = await answer(COMPLETIONS, completions_body(prompt="alpha beta", echo=True, n=2, max_tokens=2))
    assert all(c["text"].startswith("alpha beta") and len(c["text"]) > len("alpha beta") for c in body["choices"])
    assert body["usage"]["completion_tokens"] == 4
    only = await answer(COMPLETIONS, completions_body(prompt="alpha beta", echo=True, max_tokens=0))
    assert [(c["text"], c["finish_reason"]) for c in only["choices"]] == [("alpha beta", "length")]
    streamed = await answer(COMPLETIONS, completions_body(prompt="alpha", echo=True, max_tokens=2, stream=True))
    assert streamed[0][1]["choices"][0]["text"] == "alpha"


def test_completions_logprobs_go_up_to_the_engines_bound():
    assert openai.parse_completions(completions_body(logprobs=20)).logprobs == 20
    assert openai.parse(chat_body(logprobs=True, top_logprobs=20)).logprobs == 20


async def test_logprobs_above_the_engines_bound_are_refused_by_it():
    with pytest.raises(InputRejected, match="logprobs: at most 20"):
        await answer(COMPLETIONS, completions_body(logprobs=21))


# ---------------------------------------------------------------- vLLM's extensions

@pytest.mark.parametrize("spec, kind, schema", [
    ({"choice": ["yes", "no"]}, "choice", '["yes", "no"]'),
    ({"regex": "[a-z]+"}, "regex", "[a-z]+"),
    ({"grammar": "root ::= \"a\""}, "grammar", "root ::= \"a\""),
    ({"json": {"type": "object"}}, "json_schema", '{"type": "object"}'),
    ({"json": '{"type": "object"}'}, "json_schema", '{"type": "object"}'),
    ({"json_object": True}, "json_object", None),
])
def test_structured_outputs_kinds_reach_the_engine(spec, kind, schema):
    for parse, body in [(openai.parse, chat_body), (openai.parse_completions, completions_body)]:
        structured = parse(body(structured_outputs=spec)).sampling_options().structured
        assert (structured.kind, structured.schema) == (kind, schema)


@pytest.mark.parametrize("spec, named", [
    ({}, "exactly one"), ({"choice": ["a"], "regex": "a"}, "exactly one"), ({"choice": []}, "choice"),
    ({"regex": 5}, "regex"), ({"json": "{nope"}, "json"), ({"choise": ["a"]}, "structured_outputs.choise"),
    ({"regex": "a", "disable_any_whitespace": True}, "structured_outputs.disable_any_whitespace: not supported"),
    ({"regex": "a", "structural_tag": "{}"}, "structural_tag"), ([], "structured_outputs"),
])
def test_bad_structured_outputs_name_what_is_wrong(spec, named):
    assert named in refusal(openai.parse, chat_body(structured_outputs=spec))


def test_structured_outputs_and_response_format_together_is_a_400():
    message = refusal(openai.parse, chat_body(structured_outputs={"regex": "a"},
                                             response_format={"type": "json_object"}))
    assert "structured_outputs and response_format" in message


async def test_structured_choice_answers_one_of_the_choices():
    body = await answer(OPENAI, chat_body(structured_outputs={"choice": ["positive", "negative"]}))
    assert body["choices"][0]["message"]["content"] in ("positive", "negative")


def test_chat_template_kwargs_reach_the_template_except_what_the_request_sets():
    assert openai.parse(chat_body(chat_template_kwargs={"enable_thinking": False})).template_kwargs == \
        {"enable_thinking": False}
    assert openai.parse(chat_body(chat_template_kwargs={})).template_kwargs is None
    assert "tokenize" in refusal(openai.parse, chat_body(chat_template_kwargs={"tokenize": True}))
    assert "tools" in refusal(openai.parse, chat_body(chat_template_kwargs={"tools": []}))
    assert "chat_template_kwargs" in refusal(openai.parse, chat_body(chat_template_kwargs=[1]))


async def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk():
    body = chat_body(stream=True, max_tokens=3, stream_options={"include_usage": True, "continuous_usage_stats": True})
    chunks = [data for _, data in await answer(OPENAI, body) if isinstance(data, dict)]
    with_choices = [c for c in chunks if c["choices"]]
    assert [c["usage"]["completion_tokens"] for c in with_choices] == [0, 1, 2, 3, 3]
    assert all(c["usage"]["prompt_tokens"] == chunks[-1]["usage"]["prompt_tokens"] for c in with_choices)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    plain = chat_body(stream=True, max_tokens=3, stream_options={"include_usage": True})
    assert all(c["usage"] is None for _, c in await answer(OPENAI, plain) if isinstance(c, dict) and c["choices"])
    completions = completions_body(stream=True, max_tokens=2,
                                   stream_options={"include_usage": True, "continuous_usage_stats": True})
    texts = [c for _, c in await answer(COMPLETIONS, completions) if isinstance(c, dict) and c["choices"]]
    assert [c["usage"]["completion_tokens"] for c in texts] == [1, 2, 2]


def test_continuous_usage_without_include_usage_asks_nothing_as_in_vllm():
    request = openai.parse(chat_body(stream=True, stream_options={"continuous_usage_stats": True}))
    assert not request.continuous_usage and not request.include_usage


def test_usage_reports_cached_prompt_tokens_where_the_engine_does():
    request = openai.parse_completions(completions_body(prompt=["a", "b"], n=2))
    assembler = Assembler(request, forced.parse_forced)
    for index, cached in [(0, 16), (1, 16), (2, 0), (3, 0)]:  # each prompt's choices share its count
        assembler.add(Delta("x", 1, "stop", index=index, cached_tokens=cached))
    choices = assembler.choices()
    assert openai.cached_tokens(choices, request.n) == 16
    body = json.loads(COMPLETIONS.completion(StreamFrame("id", 1, request), choices, 40, 4))
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 16}
    assert "prompt_tokens_details" not in openai.usage(1, 1)  # not reported: not invented
    assert openai.cached_tokens([Choice(0, "x", "stop")], 1) is None


def test_models_entries_carry_vllms_root_and_max_model_len():
    document = json.loads(openai.models(["base", "sql"], 1, {"sql": "base"},
                                        {"base": {"root": "/models/base", "max_model_len": 2048},
                                         "sql": {"root": "/adapters/sql", "max_model_len": None}}))
    base, sql = document["data"]
    assert (base["root"], base["max_model_len"], base["parent"]) == ("/models/base", 2048, None)
    assert (sql["root"], sql["max_model_len"], sql["parent"]) == ("/adapters/sql", None, "base")
    assert SyntheticEngine(max_model_len=256).model_card("synthetic") == {"root": "synthetic", "max_model_len": 256}


def test_a_batch_prompt_counts_its_parts_and_generates_each():
    parts = [Prompt("a", (1, 2)), Prompt("b", (3,))]
    batch = Prompt.batch(parts)
    assert batch.token_count == 3 and batch.each() == tuple(parts)
    assert Prompt.batch(parts[:1]) is parts[0] and parts[0].each() == (parts[0],)
    assert SamplingOptions(max_tokens=1, echo=True).set_fields() == ["echo"]


def test_custom_roles_names_and_reasoning_reach_the_template():
    from zerolayer.runtime.engine.vllm_engine import chat_message

    request = openai.parse(chat_body(messages=[
        {"role": "user", "content": "hi", "name": "ada"},
        {"role": "assistant", "content": "ok", "reasoning_content": "thought"},
        {"role": "observation", "content": "42"}]))
    user, assistant, custom = request.messages
    assert (user.name, assistant.reasoning, custom.role) == ("ada", "thought", "observation")
    assert chat_message(user)["name"] == "ada" and chat_message(custom) == {"role": "observation", "content": "42"}
    assert chat_message(assistant)["reasoning"] == chat_message(assistant)["reasoning_content"] == "thought"
    for bad, named in [({"role": ""}, "role"), ({"role": "x" * 65}, "role"), ({"role": 3}, "role"),
                       ({"role": "user", "reasoning": "r"}, "reasoning"), ({"role": "user", "name": 5}, "name"),
                       ({"role": "user", "extra": 1}, "messages[0].extra: unknown field")]:
        assert named in refusal(openai.parse, chat_body(messages=[{"content": "x", **bad}]))


def test_vllms_sampling_extensions_reach_the_engine_options():
    fields = dict(min_p=0.1, repetition_penalty=1.2, min_tokens=3, stop_token_ids=[7, 9],
                  include_stop_str_in_output=True, skip_special_tokens=False, spaces_between_special_tokens=False)
    for parse, body in [(openai.parse, chat_body), (openai.parse_completions, completions_body)]:
        options = parse(body(**fields)).sampling_options()
        assert (options.min_p, options.repetition_penalty, options.min_tokens, options.stop_token_ids) == \
            (0.1, 1.2, 3, (7, 9))
        assert options.include_stop_str_in_output and not options.skip_special_tokens
        assert not options.spaces_between_special_tokens
        assert parse(body(min_p=None, stop_token_ids=None)).sampling_options().set_fields() == []
    for bad, named in [({"min_p": 1.5}, "min_p"), ({"repetition_penalty": 0}, "repetition_penalty"),
                       ({"min_tokens": -1}, "min_tokens"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
                       ({"stop_token_ids": list(range(65))}, "stop_token_ids"),
                       ({"skip_special_tokens": "no"}, "skip_special_tokens")]:
        assert named in refusal(openai.parse, chat_body(**bad))


def test_the_vllm_adapter_passes_the_extensions_to_sampling_params():
    pytest.importorskip("vllm")
    from zerolayer.runtime.engine.vllm_engine import sampling_params

    params = sampling_params(SamplingOptions(max_tokens=8, min_p=0.1, repetition_penalty=1.2, min_tokens=3,
                                             stop_token_ids=(7,), include_stop_str_in_output=True,
                                             skip_special_tokens=False))
    assert (params.min_p, params.repetition_penalty, params.min_tokens) == (0.1, 1.2, 3)
    assert 7 in params.stop_token_ids and params.include_stop_str_in_output and not params.skip_special_tokens
    with pytest.raises(InputRejected, match="min_tokens"):
        sampling_params(SamplingOptions(max_tokens=2, min_tokens=3))


async def test_the_synthetic_engine_keeps_the_stop_string_when_asked_and_holds_off_the_end():
    whole = await answer(OPENAI, chat_body(max_tokens=8))
    stop = whole["choices"][0]["message"]["content"].split()[1]
    kept = await answer(OPENAI, chat_body(max_tokens=8, stop=[stop], include_stop_str_in_output=True))
    assert kept["choices"][0]["message"]["content"].endswith(stop)
    longer = await answer(OPENAI, chat_body(max_tokens=8, min_tokens=6))
    assert longer["usage"]["completion_tokens"] == 6  # its own end is after 4


def test_anthropic_thinking_blocks_in_history_reach_the_template_and_redacted_ones_are_named():
    def parse(content):
        return anthropic.parse(json.dumps({"model": "m", "max_tokens": 4, "messages": [
            *USER, {"role": "assistant", "content": content}, {"role": "user", "content": "and?"}]}).encode())

    request = parse([{"type": "thinking", "thinking": "hmm", "signature": "sig"}, {"type": "text", "text": "ok"}])
    assert (request.messages[1].reasoning, request.messages[1].content) == ("hmm", "ok")
    with pytest.raises(RequestRefused, match="redacted_thinking: not supported"):
        parse([{"type": "redacted_thinking", "data": "xyz"}])
    with pytest.raises(RequestRefused, match="thinking: required string"):
        parse([{"type": "thinking", "signature": "sig"}])


def test_a_masked_token_logprob_is_answered_as_vllm_serve_does():
    """-inf (a token the sampler masked) is not JSON; vllm serve answers max(logprob, -9999.0)."""
    from types import SimpleNamespace

    from zerolayer.runtime.engine.vllm_engine import MIN_LOGPROB, token_logprobs

    def lp(logprob, rank, text):
        return SimpleNamespace(logprob=logprob, rank=rank, decoded_token=text)

    completion = SimpleNamespace(token_ids=[7], logprobs=[{7: lp(float("-inf"), 2, "b"), 3: lp(-0.5, 1, "a")}])
    (only,) = token_logprobs(completion, 2)
    assert only.logprob == MIN_LOGPROB == -9999.0
    assert only.top == (("a", -0.5), ("b", -9999.0))
    body = OPENAI.completion(StreamFrame("chatcmpl_1", 0, openai.parse(chat_body(logprobs=True, top_logprobs=2))),
                             [Choice(0, "b", "stop", tokens=1, logprobs=(only,))], 1, 1)
    assert b"Infinity" not in body and json.loads(body)["choices"][0]["logprobs"]["content"][0]["logprob"] == -9999.0
