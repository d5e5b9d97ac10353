"""Issue 15's request fields through the official ``openai`` and ``anthropic`` SDKs against the real
engine: vLLM's AsyncLLM serving the tiny generated model, with a chat template that renders tools.

What random weights can and cannot show. The model's next-token distribution is noise, so these
tests never judge what the text says. They check what the engine is made to do whatever the weights:

- structure: ``n`` choices with their indexes, one logprob entry (with ``top_logprobs``
  alternatives) per generated token, usage, finish and stop reasons, the ``/v1/completions`` shape;
- constraints that override the weights: ``logit_bias`` of +100 on one token makes it the only
  token sampled; ``top_k: 1`` is greedy, so two seeds give the same text; structured outputs
  (``response_format``, forced tool calls) make the output valid JSON of the schema, so the tool-call
  path (JSON schema from the tools, parsing it back into ``tool_calls`` / ``tool_use`` blocks) runs
  end to end; a stop string taken from a seeded answer ends the same seeded answer there;
- the prompt: a prefill is continued (the prompt is the template rendered with
  ``continue_final_message``, token for token), a template error is a 400.

Streaming tool calls: forced calls stream their arguments one piece per generated token whatever
the weights, and the SDKs' joined streamed message equals the non-streamed answer to the same seeded
request (a seed makes vLLM's sampling repeat).

What they cannot show: that the model *chooses* to call a tool (``tool_choice: auto`` needs a model
trained for a tool-call format). The auto path still runs for real: the engine has vLLM's
``llama3_json`` parser (it needs ``<|python_tag|>`` in the vocabulary: the test copy of the tokenizer
renames its unused ``<|eos|>`` token so, with no new embedding row), random weights write text (no
call), and output forced into that parser's format (``{"name": ..., "parameters": {...}}``) by a JSON
schema is read back by it as a call, whole and streamed (the parser streams arguments piece by piece).
Nor can they show that penalties change the text in a meaningful way (they are checked to be accepted
and passed on; tests/unit/runtime/test_api_fields_engine.py checks they reach SamplingParams).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import pathlib
import shutil
from typing import AsyncIterator

import pytest
import pytest_asyncio
from runtime_helpers import KEY, start_runtime
from tests.vllm_marks import require_vllm, vllm_marks

require_vllm()

pytestmark = [*vllm_marks(timeout=300), pytest.mark.asyncio(loop_scope="session")]
REPO = pathlib.Path(__file__).resolve().parents[3]
MODEL = "tiny-tools"
USER = [{"role": "user", "content": "Say something about zero layers."}]
CLOSE_BRACE = "}"

# The tiny model's template plus tools (listed in a system header, as Hermes-style templates do),
# assistant tool calls, tool results, and a template error for a chat that starts with the assistant.
TOOLS_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'assistant' %}{{ raise_exception('the chat must not start with the assistant') }}"
    "{% endif %}"
    "{% if tools %}<|start|>system<|sep|>Tools: {{ tools | tojson }}<|eot|>{% endif %}"
    "{% for message in messages %}"
    "<|start|>{{ message['role'] }}<|sep|>"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] %}{% for part in message['content'] %}{{ part['text'] }}{% endfor %}{% endif %}"
    "{% for call in message.get('tool_calls') or [] %}<tool_call>{{ call['function'] | tojson }}</tool_call>"
    "{% endfor %}"
    "{% if not loop.last or not continue_final_message %}<|eot|>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant<|sep|>{% endif %}"
)
WEATHER_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                  "properties": {"city": {"enum": ["Oslo", "Lima"]}, "unit": {"enum": ["C", "F"]}}}
OPENAI_TOOLS = [{"type": "function", "function": {"name": "weather", "description": "the weather",
                                                  "parameters": WEATHER_SCHEMA}},
                {"type": "function", "function": {"name": "clock", "description": "the time",
                                                  "parameters": {"type": "object", "properties": {},
                                                                 "additionalProperties": False}}}]
ANTHROPIC_TOOLS = [{"name": "weather", "description": "the weather", "input_schema": WEATHER_SCHEMA}]
# A call in llama3_json's format, as a JSON schema: what the auto path's parser reads as a call.
LLAMA3_CALL = {"type": "object", "required": ["name", "parameters"], "additionalProperties": False,
               "properties": {"name": {"enum": ["weather"]}, "parameters": WEATHER_SCHEMA}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> pathlib.Path:
    from zerolayer.runtime.node import tinymodel

    source = tinymodel.generate(REPO / ".models" / "tiny-llama")
    target = tmp_path_factory.mktemp("models") / MODEL
    shutil.copytree(source, target)
    (target / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    # llama3_json looks its start token up in the vocabulary; the tiny tokenizer's <|eos|> is never used
    # (<|eot|> ends turns), so it is renamed rather than a token (and an embedding row) added.
    for name in ("tokenizer.json", "tokenizer_config.json"):
        path = target / name
        path.write_text(path.read_text().replace("<|eos|>", "<|python_tag|>"))
    return target


@pytest.fixture(scope="module")
def tokenizer(model_dir):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def server(model_dir) -> AsyncIterator:
    from zerolayer.runtime.engine.vllm_engine import VllmEngine

    # vLLM-CPU compiles its logprob-rank kernel (batched_count_greater_than) with inductor at the first
    # logprobs request; on this shared 2-core machine that C++ compile failed once ("at::vec has not
    # been declared") and took the engine core down. Eager torch for the engine's processes (they
    # inherit the environment at start) takes the compiler out of what these tests depend on.
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TORCHDYNAMO_DISABLE", "1")
        async with _serve(VllmEngine, model_dir) as running:
            env.undo()
            yield running


@contextlib.asynccontextmanager
async def _serve(VllmEngine, model_dir) -> AsyncIterator:  # type: ignore[no-untyped-def]
    # Compact JSON: with free whitespace allowed, random weights loop on whitespace inside JSON.
    structured = {"backend": "xgrammar", "disable_any_whitespace": True}
    # llama3_json: a vLLM tool-call parser that reads a JSON object {"name", "parameters"} (its start
    # token is optional in the output) and streams the arguments piece by piece.
    engine = VllmEngine(str(model_dir), served_name=MODEL, max_model_len=1024, max_num_seqs=8,
                        kv_cache_memory_bytes=64 * 1024 * 1024, enforce_eager=True, dtype="float32",
                        engine_args={"structured_outputs_config": structured}, tool_parser="llama3_json")
    async with start_runtime(engine=engine, sample_interval_s=0.05) as running:
        yield running


@pytest_asyncio.fixture(loop_scope="session")
async def oai(server):  # type: ignore[no-untyped-def]
    import openai

    async with openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0) as client:
        yield client


@pytest_asyncio.fixture(loop_scope="session")
async def ant(server):  # type: ignore[no-untyped-def]
    import anthropic

    async with anthropic.AsyncAnthropic(base_url=server.base_url, api_key=KEY, max_retries=0) as client:
        yield client


# ---------------------------------------------------------------- refused fields and template errors

async def test_unknown_and_unsupported_fields_are_400s_naming_them(oai, ant):
    import anthropic
    import openai

    with pytest.raises(openai.BadRequestError, match="use_beam_search: unknown field"):
        await oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=2,
                                          extra_body={"use_beam_search": True})
    with pytest.raises(openai.BadRequestError, match="reasoning_effort: not supported"):
        await oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=2, reasoning_effort="high")
    with pytest.raises(anthropic.BadRequestError, match="thinking: not supported"):
        await ant.messages.create(model=MODEL, messages=USER, max_tokens=2,
                                  thinking={"type": "enabled", "budget_tokens": 1024})
    with pytest.raises(openai.BadRequestError, match="top_p"):  # vLLM's own range check: 400, not 500
        await oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=2, top_p=0.0)


async def test_a_chat_template_error_is_a_400(oai):
    import openai

    with pytest.raises(openai.BadRequestError, match="must not start with the assistant"):
        await oai.chat.completions.create(model=MODEL, max_tokens=2,
                                          messages=[{"role": "assistant", "content": "x"}, *USER])


# ---------------------------------------------------------------- sampling fields

async def test_n_choices_with_logprobs(oai):
    reply = await oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=6, n=3, logprobs=True,
                                              top_logprobs=3, seed=1)
    assert sorted(c.index for c in reply.choices) == [0, 1, 2]
    total = 0
    for choice in reply.choices:
        entries = choice.logprobs.content
        assert 1 <= len(entries) <= 6 and all(len(e.top_logprobs) == 3 for e in entries)
        assert all(e.logprob <= 0 and e.top_logprobs[0].logprob >= e.logprob for e in entries)
        total += len(entries)
    assert reply.usage.completion_tokens == total


async def test_logit_bias_makes_one_token_the_only_choice(oai, tokenizer):
    (the,) = tokenizer.encode(" the", add_special_tokens=False)
    reply = await oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=5,
                                              logit_bias={str(the): 100}, presence_penalty=0.5,
                                              frequency_penalty=0.5)
    assert reply.choices[0].message.content == " the" * 5


async def test_top_k_one_is_greedy_whatever_the_seed(oai):
    texts = set()
    for seed in (1, 2):
        reply = await oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=8, seed=seed,
                                                  extra_body={"top_k": 1})
        texts.add(reply.choices[0].message.content)
    assert len(texts) == 1


async def test_anthropic_stop_sequence_is_reported(ant):
    # A seeded answer is the same every time (metadata.seed is zerolayer's extension), so a stop
    # string taken from it ends the same answer there.
    seeded = {"seed": 7}
    full = await ant.messages.create(model=MODEL, messages=USER, max_tokens=24, metadata=seeded)
    text = full.content[0].text
    assert len(text) > 12, "the seeded answer is too short to cut"
    stop = text[8:12]
    cut = await ant.messages.create(model=MODEL, messages=USER, max_tokens=24, metadata=seeded,
                                    stop_sequences=["\x00never", stop])
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", stop)
    assert cut.content[0].text == text[:text.index(stop)]
    async with ant.messages.stream(model=MODEL, messages=USER, max_tokens=24, metadata=seeded,
                                   stop_sequences=[stop]) as stream:
        final = await stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)


async def test_openai_streaming_n_and_logprobs(oai):
    stream = await oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=4, n=2, logprobs=True,
                                               stream=True, stream_options={"include_usage": True})
    texts, logprobs, finishes, usage = {0: "", 1: ""}, {0: 0, 1: 0}, {}, None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.logprobs is not None:
                logprobs[choice.index] += len(choice.logprobs.content)
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert set(finishes) == {0, 1} and usage.completion_tokens == logprobs[0] + logprobs[1]


# ---------------------------------------------------------------- response_format

async def test_json_schema_output_follows_the_schema(oai):
    reply = await oai.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER_SCHEMA}})
    value = json.loads(reply.choices[0].message.content)
    assert value["city"] in ("Oslo", "Lima") and value["unit"] in ("C", "F") and set(value) == {"city", "unit"}


async def test_json_object_output_is_an_object(oai, tokenizer):
    # Any JSON object is allowed; a bias towards "}" makes the random model close it at once.
    (close,) = tokenizer.encode(CLOSE_BRACE, add_special_tokens=False)
    reply = await oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=20,
                                              response_format={"type": "json_object"},
                                              logit_bias={str(close): 100})
    assert json.loads(reply.choices[0].message.content) == {}


# ---------------------------------------------------------------- tools

async def test_openai_forced_tool_calls(oai):
    reply = await oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=80, tools=OPENAI_TOOLS,
                                              tool_choice="required", parallel_tool_calls=False)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.function.name in ("weather", "clock") and call.id.startswith("call_")
    if call.function.name == "weather":
        assert set(json.loads(call.function.arguments)) == {"city", "unit"}
    named = await oai.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=40, tools=OPENAI_TOOLS,
        tool_choice={"type": "function", "function": {"name": "weather"}})
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "weather" and named.choices[0].finish_reason == "stop"
    # The call and its result go back to the model through the template.
    followup = await oai.chat.completions.create(
        model=MODEL, max_tokens=3, tools=OPENAI_TOOLS,
        messages=[*USER, named.choices[0].message.model_dump(exclude_none=True),
                  {"role": "tool", "tool_call_id": call.id, "content": "rain"}], tool_choice="none")
    assert followup.choices[0].message.tool_calls is None and followup.usage.prompt_tokens > reply.usage.prompt_tokens


async def test_tool_choice_auto_goes_through_vllms_parser(oai):
    # The model decides: random weights write no call, so the answer is text.
    plain = await oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=4, tools=OPENAI_TOOLS)
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason in ("stop", "length")
    # Output forced into llama3_json's format is read back by vLLM's parser as a call.
    called = await oai.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=80, tools=OPENAI_TOOLS, tool_choice="auto",
        response_format={"type": "json_schema", "json_schema": {"name": "call", "schema": LLAMA3_CALL}})
    (call,) = called.choices[0].message.tool_calls
    assert called.choices[0].finish_reason == "tool_calls" and call.function.name == "weather"
    assert set(json.loads(call.function.arguments)) == {"city", "unit"}


async def test_anthropic_tool_use_and_tool_result(ant):
    reply = await ant.messages.create(model=MODEL, messages=USER, max_tokens=40, tools=ANTHROPIC_TOOLS,
                                      tool_choice={"type": "tool", "name": "weather"})
    assert reply.stop_reason == "tool_use"
    (block,) = [b for b in reply.content if b.type == "tool_use"]
    assert block.name == "weather" and set(block.input) == {"city", "unit"}
    # One call (random weights would go on adding calls to the list until max_tokens).
    async with ant.messages.stream(model=MODEL, messages=USER, max_tokens=80, tools=ANTHROPIC_TOOLS,
                                   tool_choice={"type": "any", "disable_parallel_tool_use": True}) as stream:
        streamed = await stream.get_final_message()
    assert streamed.stop_reason == "tool_use" and streamed.content[-1].type == "tool_use"
    followup = await ant.messages.create(
        model=MODEL, max_tokens=3, tools=ANTHROPIC_TOOLS, tool_choice={"type": "none"},
        messages=[*USER, {"role": "assistant", "content": [block.model_dump()]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id, "content": "rain"}]}])
    assert followup.stop_reason in ("end_turn", "max_tokens")


async def test_anthropic_count_tokens_is_the_messages_input_tokens(ant):
    request = {"model": MODEL, "system": "Answer briefly.", "messages": USER, "tools": ANTHROPIC_TOOLS,
               "tool_choice": {"type": "tool", "name": "weather"}}
    counted = await ant.messages.count_tokens(**request)
    reply = await ant.messages.create(**request, max_tokens=2)
    assert counted.input_tokens == reply.usage.input_tokens > 0


# ---------------------------------------------------------------- tool calls streamed as they are generated

async def openai_stream(oai, **request):  # type: ignore[no-untyped-def]
    """The chunks' first choices (as the SDK's stream helper yields them) and its joined completion."""
    async with oai.chat.completions.stream(**request) as stream:
        chunks = [event.chunk.choices[0] async for event in stream if event.type == "chunk" and event.chunk.choices]
        final = await stream.get_final_completion()
    return chunks, final


def argument_chunks(chunks) -> list[str]:  # type: ignore[no-untyped-def]
    """The argument pieces that arrived before the finish chunk, one entry per chunk."""
    return [c.delta.tool_calls[0].function.arguments for c in chunks
            if c.delta.tool_calls and c.finish_reason is None and c.delta.tool_calls[0].function.arguments]


async def test_openai_forced_tool_call_streams_its_arguments_in_pieces(oai):
    # One tool, so "required" is a call of it; seeded, so streamed and whole are the same output.
    request = dict(model=MODEL, messages=USER, max_tokens=80, tools=OPENAI_TOOLS[:1], tool_choice="required",
                   parallel_tool_calls=False, seed=5)
    whole = await oai.chat.completions.create(**request)
    chunks, final = await openai_stream(oai, **request)
    (call,) = whole.choices[0].message.tool_calls
    (streamed,) = final.choices[0].message.tool_calls
    first = next(c.delta.tool_calls[0] for c in chunks if c.delta.tool_calls)
    assert (first.id, first.type, first.function.name) == (streamed.id, "function", "weather")
    assert len(argument_chunks(chunks)) >= 3  # one piece per generated token, not the call whole at the end
    assert (streamed.function.name, streamed.function.arguments) == (call.function.name, call.function.arguments)
    assert final.choices[0].finish_reason == whole.choices[0].finish_reason == "tool_calls"
    # A named function: finish_reason "stop" (as OpenAI says it), arguments in pieces all the same.
    named = dict(request, tool_choice={"type": "function", "function": {"name": "weather"}})
    whole = await oai.chat.completions.create(**named)
    chunks, final = await openai_stream(oai, **named)
    assert len(argument_chunks(chunks)) >= 3 and final.choices[0].finish_reason == "stop"
    assert final.choices[0].message.tool_calls[0].function.arguments == \
        whole.choices[0].message.tool_calls[0].function.arguments


async def test_openai_auto_tool_calls_stream_through_vllms_parser(oai):
    # The model's own text (random weights call nothing) streams as content deltas, as it comes.
    # (The SDK's stream helper refuses to join an answer cut at max_tokens: the chunks are joined here.)
    plain = dict(model=MODEL, messages=USER, max_tokens=12, tools=OPENAI_TOOLS, seed=11)
    whole = await oai.chat.completions.create(**plain)
    chunks = [c.choices[0] async for c in await oai.chat.completions.create(**plain, stream=True) if c.choices]
    texts = [c.delta.content for c in chunks if c.delta.content]
    assert len(texts) >= 3 and not any(c.delta.tool_calls for c in chunks)
    assert "".join(texts) == whole.choices[0].message.content and whole.choices[0].message.tool_calls is None
    # Output forced into llama3_json's format is a call to vLLM's parser, streamed as that parser
    # streams it: the name once read, then the arguments piece by piece.
    called = dict(model=MODEL, messages=USER, max_tokens=80, tools=OPENAI_TOOLS, tool_choice="auto", seed=5,
                  response_format={"type": "json_schema", "json_schema": {"name": "call", "schema": LLAMA3_CALL}})
    whole = await oai.chat.completions.create(**called)
    chunks, final = await openai_stream(oai, **called)
    named = [c for c in chunks if c.delta.tool_calls and c.delta.tool_calls[0].function.name]
    assert named and named[0].finish_reason is None and len(argument_chunks(chunks)) >= 3
    (call,), (streamed,) = whole.choices[0].message.tool_calls, final.choices[0].message.tool_calls
    assert (streamed.function.name, streamed.function.arguments) == (call.function.name, call.function.arguments)
    assert final.choices[0].finish_reason == whole.choices[0].finish_reason == "tool_calls"


async def test_anthropic_tool_use_streams_input_json_deltas(ant):
    request = dict(model=MODEL, messages=USER, max_tokens=60, tools=ANTHROPIC_TOOLS, metadata={"seed": 5},
                   tool_choice={"type": "tool", "name": "weather"})
    whole = await ant.messages.create(**request)
    async with ant.messages.stream(**request) as stream:
        events = [event async for event in stream]
        final = await stream.get_final_message()
    kinds = [e.type for e in events]
    start = next(e for e in events if e.type == "content_block_start")
    assert (start.content_block.type, start.content_block.name, start.content_block.input) == ("tool_use", "weather", {})
    pieces = [e.partial_json for e in events if e.type == "input_json"]
    assert len(pieces) >= 3 and kinds.index("content_block_stop") > kinds.index("input_json")
    assert final.stop_reason == whole.stop_reason == "tool_use"
    assert [(b.type, b.name, b.input) for b in final.content] == [(b.type, b.name, b.input) for b in whole.content]


# ---------------------------------------------------------------- prefill and /v1/completions

async def test_anthropic_prefill_is_continued(ant, tokenizer):
    chat = [*USER, {"role": "assistant", "content": "The answer is"}]
    reply = await ant.messages.create(model=MODEL, messages=chat, max_tokens=3)
    text = await asyncio.to_thread(tokenizer.apply_chat_template, chat, tokenize=False,
                                   add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("The answer is")
    assert reply.usage.input_tokens == len(tokenizer.encode(text, add_special_tokens=False))


async def test_completions_endpoint(oai, tokenizer):
    reply = await oai.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, n=2, logprobs=2)
    assert reply.object == "text_completion" and sorted(c.index for c in reply.choices) == [0, 1]
    assert reply.usage.prompt_tokens == len(tokenizer.encode("Once upon a time", add_special_tokens=True))
    for choice in reply.choices:
        assert len(choice.logprobs.tokens) == len(choice.logprobs.token_logprobs) >= 1
        assert all(len(top) <= 2 + 1 for top in choice.logprobs.top_logprobs)
    stream = await oai.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4, stream=True)
    pieces = [c async for c in stream]
    assert pieces[-1].choices[0].finish_reason in ("stop", "length")


# ---------------------------------------------------------------- what vllm serve's users send (issue 31)

async def test_seeds_across_the_64_bit_range_are_served_and_outside_it_are_400s(oai):
    import openai

    for seed in (-2**63, 2**63 - 1):
        reply = await oai.completions.create(model=MODEL, prompt="Once", max_tokens=2, seed=seed)
        assert reply.choices[0].finish_reason in ("stop", "length")
    for seed in (-2**63 - 1, 2**63):
        with pytest.raises(openai.BadRequestError, match="seed must be an integer in"):
            await oai.completions.create(model=MODEL, prompt="Once", max_tokens=2, seed=seed)


async def test_required_tool_choice_with_pydantic_defs_is_served(oai):
    parameters = {"type": "object", "additionalProperties": False, "required": ["city", "options"],
                  "$defs": {"WeatherOptions": {"type": "object", "additionalProperties": False,
                                               "required": ["unit"], "properties": {"unit": {"enum": ["C", "F"]}}}},
                  "properties": {"city": {"enum": ["Oslo", "Lima"]}, "options": {"$ref": "#/$defs/WeatherOptions"}}}
    tools = [{"type": "function", "function": {"name": "weather", "parameters": parameters}}]
    reply = await oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=120, tools=tools,
                                              tool_choice="required", parallel_tool_calls=False, seed=3)
    (call,) = reply.choices[0].message.tool_calls
    assert json.loads(call.function.arguments)["options"]["unit"] in ("C", "F")


async def test_completions_prompt_lists_token_ids_echo_and_logprobs(oai, tokenizer):
    import openai

    ids = tokenizer.encode("Once upon a time", add_special_tokens=True)
    reply = await oai.completions.create(model=MODEL, prompt=["Once upon", "A long time ago"], max_tokens=3, n=2)
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    by_ids = await oai.completions.create(model=MODEL, prompt=[ids, ids[:3]], max_tokens=2, echo=True)
    assert by_ids.choices[0].text.startswith(tokenizer.decode(ids))
    assert by_ids.usage.prompt_tokens == len(ids) + 3
    only = await oai.completions.create(model=MODEL, prompt="Once upon", max_tokens=0, echo=True)
    assert only.choices[0].text == "Once upon" and only.usage.completion_tokens == 0
    wide = await oai.completions.create(model=MODEL, prompt=ids, max_tokens=2, logprobs=10)
    assert all(len(top) >= 10 for top in wide.choices[0].logprobs.top_logprobs)
    with pytest.raises(openai.BadRequestError, match="token id 10000000 is out of vocabulary"):
        await oai.completions.create(model=MODEL, prompt=[1, 10_000_000], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="logprobs"):  # above vLLM's max_logprobs (20)
        await oai.completions.create(model=MODEL, prompt="Once", max_tokens=2, logprobs=21)


@pytest.mark.parametrize("spec, check", [
    ({"choice": ["alpha", "beta"]}, lambda text: text in ("alpha", "beta")),
    ({"regex": "[0-9]{3}"}, lambda text: len(text) == 3 and text.isdigit()),
    ({"grammar": 'root ::= "yes" | "no"'}, lambda text: text in ("yes", "no")),
])
async def test_structured_outputs_constrain_the_text(oai, spec, check):
    reply = await oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=8,
                                              extra_body={"structured_outputs": spec})
    assert check(reply.choices[0].message.content)


async def test_chat_template_kwargs_reach_vllms_template_filter(oai):
    reply = await oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=2,
                                              extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert reply.choices[0].finish_reason in ("stop", "length")


async def test_continuous_usage_cached_tokens_and_model_cards(oai, server):
    long = "zero layer " * 100
    for _ in range(2):  # the second finds the first's blocks in vLLM's prefix cache
        reply = await oai.completions.create(model=MODEL, prompt=long, max_tokens=2)
    assert reply.usage.prompt_tokens_details.cached_tokens > 0
    stream = await oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=3, stream=True,
                                               stream_options={"include_usage": True,
                                                               "continuous_usage_stats": True})
    chunks = [c async for c in stream]
    assert all(c.usage is not None for c in chunks)
    assert chunks[-1].usage.completion_tokens == max(c.usage.completion_tokens for c in chunks[:-1])
    (card,) = (await oai.models.list()).data
    assert card.model_extra["max_model_len"] == 1024 and card.model_extra["root"].endswith(MODEL)


async def test_vllms_sampling_extensions_are_served(oai, tokenizer):
    (the,) = tokenizer.encode(" the", add_special_tokens=False)
    stopped = await oai.completions.create(model=MODEL, prompt="Once", max_tokens=6, logit_bias={str(the): 100},
                                           extra_body={"stop_token_ids": [the]})
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == 1
    held = await oai.completions.create(model=MODEL, prompt="Once", max_tokens=5, seed=1,
                                        extra_body={"min_tokens": 5, "min_p": 0.05, "repetition_penalty": 1.1,
                                                    "skip_special_tokens": False})
    assert held.usage.completion_tokens == 5
