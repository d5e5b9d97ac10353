"""Issue 15's response side through the official SDKs against a real runtime on the synthetic engine
(deterministic, no model): n choices, logprobs, the matched stop sequence, JSON outputs, forced
tool calls (OpenAI tool_calls, Anthropic tool_use blocks; whole, and streamed in pieces as they are
generated: the synthetic engine writes JSON four characters per token), /v1/completions and
the 400 for an unknown field. The same families against real vLLM: test_api_fields_vllm.py."""

from __future__ import annotations

import json
import math

import pytest
from runtime_helpers import KEY

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60), pytest.mark.asyncio(loop_scope="session")]

USER = [{"role": "user", "content": "hello there"}]
SCHEMA = {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": SCHEMA}}]


def oai(runtime):  # type: ignore[no-untyped-def]
    import openai

    return openai.AsyncOpenAI(base_url=runtime.base_url + "/v1", api_key=KEY, max_retries=0)


def ant(runtime):  # type: ignore[no-untyped-def]
    import anthropic

    return anthropic.AsyncAnthropic(base_url=runtime.base_url, api_key=KEY, max_retries=0)


async def test_openai_n_logprobs_and_stop(runtime):
    async with oai(runtime) as client:
        reply = await client.chat.completions.create(model="synthetic", messages=USER, max_tokens=5, n=2,
                                                     logprobs=True, top_logprobs=2)
        assert [c.index for c in reply.choices] == [0, 1] and reply.choices[0].message.content \
            != reply.choices[1].message.content
        assert reply.usage.completion_tokens == 10
        for choice in reply.choices:
            assert len(choice.logprobs.content) == 5 and all(len(e.top_logprobs) == 2 for e in choice.logprobs.content)
            assert "".join(e.token for e in choice.logprobs.content) == choice.message.content
            assert all(math.isclose(e.logprob, reply.choices[0].logprobs.content[0].logprob)
                       for e in choice.logprobs.content)
        stream = await client.chat.completions.create(model="synthetic", messages=USER, max_tokens=5, n=2,
                                                      stream=True, logprobs=True)
        texts, finishes = {0: "", 1: ""}, {}
        async for chunk in stream:
            for c in chunk.choices:
                texts[c.index] += c.delta.content or ""
                if c.finish_reason:
                    finishes[c.index] = c.finish_reason
        assert texts == {c.index: c.message.content for c in reply.choices} and finishes == {0: "length", 1: "length"}


async def test_anthropic_stop_sequence_whole_and_streamed(runtime):
    async with ant(runtime) as client:
        full = (await client.messages.create(model="synthetic", messages=USER, max_tokens=16)).content[0].text
        stop = full.split()[3]
        cut = await client.messages.create(model="synthetic", messages=USER, max_tokens=16, stop_sequences=[stop])
        assert (cut.stop_reason, cut.stop_sequence, cut.content[0].text) == \
            ("stop_sequence", stop, full[:full.index(stop)])
        async with client.messages.stream(model="synthetic", messages=USER, max_tokens=16,
                                          stop_sequences=[stop]) as stream:
            final = await stream.get_final_message()
        assert (final.stop_reason, final.stop_sequence, final.content[0].text) == \
            ("stop_sequence", stop, cut.content[0].text)


async def test_json_schema_and_forced_tool_calls_openai(runtime):
    async with oai(runtime) as client:
        reply = await client.chat.completions.create(
            model="synthetic", messages=USER, max_tokens=50,
            response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}})
        assert set(json.loads(reply.choices[0].message.content)) == {"city"}
        called = await client.chat.completions.create(model="synthetic", messages=USER, max_tokens=50, tools=TOOLS,
                                                      tool_choice="required")
        (call,) = called.choices[0].message.tool_calls
        assert called.choices[0].finish_reason == "tool_calls" and call.function.name == "weather"
        assert set(json.loads(call.function.arguments)) == {"city"}
        # Streamed: the call's arguments arrive in pieces, as they are generated; the SDK's joined
        # message is the non-streamed one.
        async with client.chat.completions.stream(model="synthetic", messages=USER, max_tokens=50, tools=TOOLS,
                                                  tool_choice="required") as stream:
            chunks = [event.chunk.choices async for event in stream if event.type == "chunk"]
            final = await stream.get_final_completion()
        early = [c[0].delta.tool_calls[0].function.arguments for c in chunks
                 if c and c[0].delta.tool_calls and c[0].finish_reason is None]
        assert len([a for a in early if a]) >= 3  # argument pieces in separate chunks before the finish
        (streamed,) = final.choices[0].message.tool_calls
        assert (streamed.function.name, streamed.function.arguments) == (call.function.name, call.function.arguments)
        assert final.choices[0].finish_reason == "tool_calls" and not final.choices[0].message.content


async def test_streamed_tool_calls_of_n_choices_join_per_choice(runtime):
    tools = [*TOOLS, {"type": "function", "function": {"name": "clock", "parameters": {"type": "object"}}}]
    request = dict(model="synthetic", messages=USER, max_tokens=50, tools=tools, tool_choice="required", n=2)
    async with oai(runtime) as client:
        whole = await client.chat.completions.create(**request)
        joined: dict[int, dict[int, list[str]]] = {0: {}, 1: {}}
        async for chunk in await client.chat.completions.create(**request, stream=True):
            for choice in chunk.choices:
                for call in choice.delta.tool_calls or []:
                    if call.id is not None:
                        joined[choice.index][call.index] = [call.function.name, ""]
                    joined[choice.index][call.index][1] += call.function.arguments or ""
    for choice in whole.choices:
        assert [tuple(v) for _, v in sorted(joined[choice.index].items())] == \
            [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]


async def test_forced_tool_use_anthropic(runtime):
    tools = [{"name": "weather", "input_schema": SCHEMA}]
    async with ant(runtime) as client:
        reply = await client.messages.create(model="synthetic", messages=USER, max_tokens=50, tools=tools,
                                             tool_choice={"type": "any"})
        assert reply.stop_reason == "tool_use" and reply.content[0].type == "tool_use"
        assert set(reply.content[0].input) == {"city"}
        async with client.messages.stream(model="synthetic", messages=USER, max_tokens=50, tools=tools,
                                          tool_choice={"type": "any"}) as stream:
            kinds = [event.type async for event in stream]
            final = await stream.get_final_message()
        # input_json_delta fragments arrive one per generated piece, inside the tool_use block
        assert kinds.count("input_json") >= 3 and kinds.index("input_json") < kinds.index("content_block_stop")
        assert final.stop_reason == "tool_use" and final.content[0].input == reply.content[0].input
        assert [b.type for b in final.content] == ["tool_use"] and final.content[0].name == "weather"


async def test_completions_and_unknown_fields(runtime):
    import openai

    async with oai(runtime) as client:
        reply = await client.completions.create(model="synthetic", prompt="Once upon a time", max_tokens=4, n=2,
                                                logprobs=1)
        assert reply.object == "text_completion" and [c.index for c in reply.choices] == [0, 1]
        assert all(len(c.logprobs.tokens) == 4 and c.finish_reason == "length" for c in reply.choices)
        stream = await client.completions.create(model="synthetic", prompt="Once upon a time", max_tokens=4,
                                                 stream=True, stream_options={"include_usage": True})
        events = [e async for e in stream]
        assert "".join(c.text for e in events for c in e.choices) == reply.choices[0].text
        assert events[-1].usage.completion_tokens == 4
        with pytest.raises(openai.BadRequestError, match="use_beam_search: unknown field"):
            await client.chat.completions.create(model="synthetic", messages=USER,
                                                 extra_body={"use_beam_search": True})
        with pytest.raises(openai.BadRequestError, match="echo with logprobs: not supported"):
            await client.completions.create(model="synthetic", prompt="x", echo=True, logprobs=1)
