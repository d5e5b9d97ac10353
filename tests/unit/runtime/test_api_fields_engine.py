"""What the engines honour of SamplingOptions: the synthetic engine (n, stop strings, logprobs,
structured outputs, forced tool calls, prefill) and the vLLM adapter's mapping to SamplingParams."""

from __future__ import annotations

import dataclasses
import json
import math
import warnings

import pytest

from zerolayer.runtime.engine import tools as forced
from zerolayer.runtime.engine.base import (
    ChatMessage,
    InputRejected,
    SamplingOptions,
    StructuredOutput,
    ToolSpec,
    ToolUse,
)
from zerolayer.runtime.engine.synthetic import _WORDS, SyntheticEngine


WEATHER = ToolSpec("weather", "", json.dumps({"type": "object", "properties": {"city": {"type": "string"}},
                                               "required": ["city"]}))
CLOCK = ToolSpec("clock", "", json.dumps({"type": "object", "properties": {}}))


async def run(options: SamplingOptions, messages=(ChatMessage("user", "hello"),), **render):
    engine = SyntheticEngine(output_tokens=8)
    await engine.start()
    prompt = await engine.render("synthetic", list(messages), **render)
    return [d async for d in engine.generate(prompt, options, "r", 0)], engine


async def test_synthetic_n_gives_distinct_indexed_completions():
    deltas, _ = await run(SamplingOptions(max_tokens=8, n=3))
    texts = {i: "".join(d.text for d in deltas if d.index == i) for i in range(3)}
    assert len(set(texts.values())) == 3
    assert [d.finish_reason for d in deltas if d.finish_reason] == ["length"] * 3


async def test_synthetic_stop_string_ends_the_output_and_is_reported():
    full, _ = await run(SamplingOptions(max_tokens=8))
    text = "".join(d.text for d in full)
    stop = text.split()[2]
    deltas, _ = await run(SamplingOptions(max_tokens=8, stop=("nope", stop)))
    cut = "".join(d.text for d in deltas)
    assert cut == text[:text.index(stop)] and stop not in cut
    assert (deltas[-1].finish_reason, deltas[-1].stop_sequence) == ("stop", stop)


async def test_synthetic_logprobs_are_the_uniform_choice():
    deltas, _ = await run(SamplingOptions(max_tokens=3, logprobs=2))
    for delta in deltas:
        (lp,) = delta.logprobs
        assert lp.token == delta.text and math.isclose(lp.logprob, -math.log(len(_WORDS)))
        assert len(lp.top) == 2


async def test_synthetic_json_outputs_follow_the_schema():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "y"]}},
              "required": ["a", "b"]}
    deltas, _ = await run(SamplingOptions(max_tokens=50, structured=StructuredOutput("json_schema",
                                                                                      json.dumps(schema))))
    value = json.loads("".join(d.text for d in deltas))
    assert isinstance(value["a"], int) and value["b"] == "x"
    deltas, _ = await run(SamplingOptions(max_tokens=50, structured=StructuredOutput("json_object")))
    assert json.loads("".join(d.text for d in deltas)) == {}


async def test_forced_tool_calls_round_trip_through_the_parser():
    required = ToolUse((WEATHER, CLOCK), "required")
    deltas, engine = await run(SamplingOptions(max_tokens=50, tools=required), tools=required.tools)
    text, calls = engine.parse_tool_calls("".join(d.text for d in deltas), required)
    assert text == "" and [c.name for c in calls] == ["weather"]
    assert set(json.loads(calls[0].arguments)) == {"city"} and calls[0].id.startswith("call_")
    named = ToolUse((WEATHER, CLOCK), "function", "clock", parallel=False)
    deltas, engine = await run(SamplingOptions(max_tokens=50, tools=named), tools=named.tools)
    _, calls = engine.parse_tool_calls("".join(d.text for d in deltas), named)
    assert [(c.name, c.arguments) for c in calls] == [("clock", "{}")]


def test_forced_parse_of_cut_short_output_returns_the_text():
    use = ToolUse((WEATHER,), "required")
    assert forced.parse_forced('[{"name": "wea', use) == ('[{"name": "wea', ())


def test_required_schema_lists_every_tool_and_bounds_parallel_calls():
    schema = forced.forced_schema(ToolUse((WEATHER, CLOCK), "required", parallel=False))
    assert schema["maxItems"] == 1 and schema["minItems"] == 1
    assert [b["properties"]["name"]["enum"] for b in schema["items"]["anyOf"]] == [["weather"], ["clock"]]


async def test_synthetic_refuses_auto_tool_choice_it_cannot_parse():
    with pytest.raises(InputRejected, match="tool_choice auto"):
        await run(SamplingOptions(max_tokens=4, tools=ToolUse((WEATHER,), "auto")))


async def test_synthetic_prefill_is_continued_not_a_new_turn():
    engine = SyntheticEngine()
    chat = [ChatMessage("user", "hi"), ChatMessage("assistant", "The answer is")]
    continued = await engine.render("synthetic", chat, continue_final=True)
    restarted = await engine.render("synthetic", chat)
    assert continued.text.endswith("The answer is") and restarted.text.endswith("<assistant>")
    with pytest.raises(InputRejected):
        await engine.render("synthetic", chat[:1], continue_final=True)


# ---------------------------------------------------------------- vLLM's SamplingParams

def vllm_params(options: SamplingOptions):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        pytest.importorskip("vllm", reason="the vllm engine extra is not installed")
    from zerolayer.runtime.engine.vllm_engine import sampling_params

    return sampling_params(options)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_vllm_sampling_params_carry_every_option():
    params = vllm_params(SamplingOptions(
        max_tokens=9, temperature=0.5, top_p=0.9, stop=("END",), seed=3, top_k=7, presence_penalty=1.0,
        frequency_penalty=-1.0, logit_bias=((5, 2.0),), logprobs=4, n=2,
        structured=StructuredOutput("json_schema", '{"type": "object"}')))
    assert (params.n, params.max_tokens, params.top_k, params.seed, params.logprobs) == (2, 9, 7, 3, 4)
    assert (params.presence_penalty, params.frequency_penalty, params.stop) == (1.0, -1.0, ["END"])
    assert params.logit_bias == {5: 2.0} and params.structured_outputs.json == {"type": "object"}
    required = vllm_params(SamplingOptions(max_tokens=9, tools=ToolUse((WEATHER,), "required"),
                                           structured=StructuredOutput("json_object")))
    assert required.structured_outputs.json["type"] == "array"  # forced tools win over response_format
    assert vllm_params(SamplingOptions(max_tokens=9, structured=StructuredOutput("json_object"))) \
        .structured_outputs.json_object is True


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_vllm_refusing_a_value_is_input_rejected():
    with pytest.raises(InputRejected, match="top_p"):
        vllm_params(SamplingOptions(max_tokens=9, top_p=0.0))


async def test_synthetic_final_only_gives_each_completion_whole_as_its_steps_would():
    """A non-streamed request (``final_only``): one delta per completion, the same text, tokens,
    logprobs, token ids and finish as its step-by-step deltas joined, with when its first token came."""
    options = SamplingOptions(max_tokens=6, n=2, logprobs=1, stop=("zzz",))
    steps, _ = await run(options)
    whole, _ = await run(dataclasses.replace(options, final_only=True))
    assert [d.index for d in whole] == [0, 1]
    for d in whole:
        mine = [s for s in steps if s.index == d.index]
        assert d.text == "".join(s.text for s in mine) and d.token_count == sum(s.token_count for s in mine) == 6
        assert d.logprobs == tuple(lp for s in mine for lp in s.logprobs)
        assert d.token_ids == tuple(t for s in mine for t in s.token_ids)
        assert (d.finish_reason, d.stop_sequence) == (mine[-1].finish_reason, mine[-1].stop_sequence)
        assert d.first_token_at is not None and all(s.first_token_at is None for s in mine)


async def test_synthetic_final_only_abort_gives_what_was_made_so_far():
    import asyncio

    engine = SyntheticEngine(output_tokens=50, tokens_per_second=200)
    await engine.start()
    prompt = await engine.render("synthetic", [ChatMessage("user", "hello")])
    gen = engine.generate(prompt, SamplingOptions(max_tokens=50, final_only=True), "r", 0)
    task = asyncio.ensure_future(gen.__anext__())
    await asyncio.sleep(0.05)
    await engine.abort("r")
    delta = await task
    assert delta.finish_reason == "abort" and 0 < delta.token_count < 50
    assert len(delta.text.split()) == delta.token_count


def test_a_request_not_streamed_asks_for_whole_completions():
    from zerolayer.runtime.api.openai import parse

    for stream in (False, True):
        body = {"model": "m", "stream": stream, "messages": [{"role": "user", "content": "hi"}]}
        assert parse(json.dumps(body).encode()).sampling_options().final_only is (not stream)
    assert "final_only" not in SamplingOptions(max_tokens=1, final_only=True).set_fields()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_vllm_final_only_is_vllm_serves_final_only_output():
    from vllm.sampling_params import RequestOutputKind

    assert vllm_params(SamplingOptions(max_tokens=2)).output_kind == RequestOutputKind.DELTA
    assert vllm_params(SamplingOptions(max_tokens=2, final_only=True)).output_kind == RequestOutputKind.FINAL_ONLY
