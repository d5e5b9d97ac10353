"""Side by side: the same requests to `vllm serve` and to the zerolayer runtime (issue 31).

Both serve the tiny generated model (runtime/zerolayer/runtime/node/tinymodel.py) on vLLM's CPU build with
the same engine settings, chat template (one that renders tools) and tool-call parser. Each case is
sent as raw HTTP to both; the table shows, per case, each one's status and the answer's shape (the
JSON keys that matter, a stream's event count, an error's first words) and whether they agree:

- ``same``: same status class and shape;
- ``choice``: a documented difference (docs/api-fields.md says why), listed in :data:`CHOICES`;
- ``DIFF``: anything else, to look at.

No 5xx is allowed from zerolayer anywhere (the exit status is 1 if one is seen, or a DIFF)::

    python3 hack/vllm_serve_compat.py            # ~2-4 minutes on a CPU: two engines start

Text is never compared: the weights are random, and the two engines sample independently.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

import httpx

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "integration" / "runtime"))  # runtime_helpers: tenants, KEY

MODEL = "tiny-tools"
TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|start|>system<|sep|>Tools: {{ tools | tojson }}<|eot|>{% endif %}"
    "{% for message in messages %}"
    "<|start|>{{ message['role'] }}<|sep|>"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] %}{% for part in message['content'] %}{{ part['text'] }}{% endfor %}{% endif %}"
    "{% for call in message.get('tool_calls') or [] %}<tool_call>{{ call['function'] | tojson }}</tool_call>"
    "{% endfor %}<|eot|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant<|sep|>{% endif %}"
)
ENGINE = {"max_model_len": 1024, "max_num_seqs": 8, "kv_cache_memory_bytes": 64 * 1024 * 1024,
          "enforce_eager": True, "dtype": "float32"}
STRUCTURED = {"backend": "xgrammar", "disable_any_whitespace": True}
USER = [{"role": "user", "content": "Say something."}]
DEFS_PARAMETERS = {
    "type": "object", "required": ["city", "options"], "additionalProperties": False,
    "$defs": {"WeatherOptions": {"type": "object", "required": ["unit"], "additionalProperties": False,
                                 "properties": {"unit": {"enum": ["C", "F"]}}}},
    "properties": {"city": {"enum": ["Oslo", "Lima"]}, "options": {"$ref": "#/$defs/WeatherOptions"}}}
DEFS_TOOL = {"type": "function", "function": {"name": "weather", "parameters": DEFS_PARAMETERS}}


def chat(**fields: Any) -> tuple[str, dict[str, Any]]:
    return "/v1/chat/completions", {"model": MODEL, "messages": USER, "max_tokens": 4, **fields}


def completions(**fields: Any) -> tuple[str, dict[str, Any]]:
    return "/v1/completions", {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4, **fields}


CASES: dict[str, tuple[str, dict[str, Any] | None]] = {
    "chat": chat(),
    "chat stream": chat(stream=True),
    "chat n=2 logprobs": chat(n=2, logprobs=True, top_logprobs=3),
    "chat seed -2**63-1": chat(seed=-2**63 - 1),
    "chat seed 2**63": chat(seed=2**63),
    "chat seed 2**63-1": chat(seed=2**63 - 1),
    "chat stream false + stream_options": chat(stream=False, stream_options={"include_usage": True}),
    "chat logit_bias bad keys": chat(logit_bias={"abc": 1, "x": 2}),
    "chat required tool with $defs": chat(max_tokens=200, tools=[DEFS_TOOL], tool_choice="required"),
    "chat named tool with $defs": chat(max_tokens=200, tools=[DEFS_TOOL],
                                       tool_choice={"type": "function", "function": {"name": "weather"}}),
    "chat response_format json_schema": chat(max_tokens=60, response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": DEFS_PARAMETERS["$defs"]["WeatherOptions"]}}),
    "chat structured choice": chat(structured_outputs={"choice": ["yes", "no"]}),
    "chat structured regex": chat(structured_outputs={"regex": "[0-9]{3}"}),
    "chat structured grammar": chat(structured_outputs={"grammar": 'root ::= "a" | "b"'}),
    "chat structured json": chat(max_tokens=60, structured_outputs={"json": DEFS_PARAMETERS}),
    "chat_template_kwargs": chat(chat_template_kwargs={"enable_thinking": False}),
    "chat continuous usage": chat(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}),
    "chat custom role": chat(messages=[{"role": "observation", "content": "42"}, *USER]),
    "chat message name": chat(messages=[{"role": "user", "content": "hi", "name": "ada"}]),
    "chat message extra key": chat(messages=[{"role": "user", "content": "hi", "foo": 1}]),
    "chat top_logprobs 21": chat(logprobs=True, top_logprobs=21),
    "chat temperature 3": chat(temperature=3),
    "chat n 0": chat(n=0),
    "chat max_tokens 0": chat(max_tokens=0),
    "chat min_p etc.": chat(min_p=0.1, repetition_penalty=1.1, min_tokens=2, skip_special_tokens=False),
    "chat unknown field": chat(frobnicate=1),
    "completions": completions(),
    "completions stream": completions(stream=True),
    "completions prompt list": completions(prompt=["Once upon", "A long time"], n=2),
    "completions token ids": completions(prompt=[1, 2, 3]),
    "completions token id lists": completions(prompt=[[1, 2], [3, 4, 5]]),
    "completions echo": completions(echo=True),
    "completions echo max_tokens 0": completions(echo=True, max_tokens=0),
    "completions echo stream": completions(echo=True, stream=True),
    "completions echo logprobs": completions(echo=True, logprobs=2),
    "completions logprobs 10": completions(logprobs=10),
    "completions logprobs 21": completions(logprobs=21),
    "completions out-of-vocabulary id": completions(prompt=[1, 10_000_000]),
    "completions seed 2**63": completions(seed=2**63),
    "completions structured choice": completions(structured_outputs={"choice": ["yes", "no"]}),
    "models": ("/v1/models", None),
}

# Documented differences (docs/api-fields.md), by case: what zerolayer does and why, in a few words.
CHOICES = {
    "chat stream": "separate final finish chunk (OpenAI's shape)",
    "chat continuous usage": "separate final finish chunk (OpenAI's shape)",
    "completions stream": "separate final finish chunk (OpenAI's shape)",
    "completions echo stream": "prompt in a chunk of its own",
    "chat message extra key": "400 naming the key (vLLM drops it silently)",
    "chat unknown field": "400 naming the field (vLLM ignores it)",
    "completions echo logprobs": "400: prompt logprobs are not returned",
    "models": "owned_by zerolayer, no permission list",
}


def shape(status: int, body: bytes, stream: bool) -> str:
    """What to compare: never the text (random weights), only the structure."""
    if status >= 400:
        try:
            message = json.loads(body)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = body[:60].decode(errors="replace")
        return "error: " + " ".join(str(message).split())[:60]
    if stream:
        events = [line[6:] for line in body.decode().splitlines() if line.startswith("data: ")]
        chunks = [json.loads(e) for e in events if e != "[DONE]"]
        usage = sum(1 for c in chunks if c.get("usage"))
        finish = [c["choices"][0].get("finish_reason") for c in chunks if c.get("choices")]
        text_in_finish = any(c["choices"][0].get("finish_reason") and (c["choices"][0].get("text") or
                             (c["choices"][0].get("delta") or {}).get("content")) for c in chunks if c.get("choices"))
        return (f"{len(chunks)} chunks, usage in {usage}, finish {'set' if any(finish) else 'none'}"
                f"{', text with finish' if text_in_finish else ''}, {'[DONE]' if events[-1:] == ['[DONE]'] else 'no DONE'}")
    document = json.loads(body)
    if document.get("object") == "list":
        entry = document["data"][0]
        return "models: " + ",".join(sorted(k for k in entry if entry[k] is not None))
    choices = document.get("choices", [])
    first = choices[0] if choices else {}
    message = first.get("message") or {}
    parts = [f"{len(choices)} choices", "keys " + ",".join(sorted(k for k in first if first[k] is not None))]
    if message.get("tool_calls"):
        parts.append(f"{len(message['tool_calls'])} tool call(s)")
    usage = document.get("usage") or {}
    if usage.get("prompt_tokens_details"):
        parts.append("cached_tokens")
    return ", ".join(parts)


CACHED = ", cached_tokens"  # usage.prompt_tokens_details: zerolayer always sends it (OpenAI's shape)


def verdict(name: str, ours: tuple[int, str], theirs: tuple[int, str]) -> str:
    if ours[0] // 100 == theirs[0] // 100 and (ours[1] == theirs[1] or ours[0] >= 400):
        return "same"
    if name in CHOICES:
        return "choice"
    if ours[0] == theirs[0] and ours[1].replace(CACHED, "") == theirs[1]:
        return "choice"
    return "DIFF"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_dir(root: pathlib.Path) -> pathlib.Path:
    from zerolayer.runtime.node import tinymodel

    source = tinymodel.generate(REPO / ".models" / "tiny-llama")
    target = root / MODEL
    shutil.copytree(source, target)
    (target / "chat_template.jinja").write_text(TEMPLATE)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # llama3_json's start token (see the vLLM tests)
        path = target / name
        path.write_text(path.read_text().replace("<|eos|>", "<|python_tag|>"))
    return target


@contextlib.contextmanager
def vllm_serve(path: pathlib.Path, port: int, log: pathlib.Path):
    """`vllm serve` (its module: the CPU wheel's console script cannot read its own version)."""
    args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(path), "--port", str(port),
            "--served-model-name", MODEL, "--enable-auto-tool-choice", "--tool-call-parser", "llama3_json",
            "--structured-outputs-config", json.dumps(STRUCTURED)]
    for key, value in ENGINE.items():
        flag = "--" + key.replace("_", "-")
        args += [flag] if value is True else [flag, str(value)]
    with open(log, "w") as out:
        process = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                   env={**os.environ, "TORCHDYNAMO_DISABLE": "1"})
    try:
        yield process
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()


async def ask(client: httpx.AsyncClient, base: str, key: str, path: str, body: dict | None) -> tuple[int, str]:
    headers = {"authorization": f"Bearer {key}"}
    if body is None:
        response = await client.get(base + path, headers=headers)
    else:
        response = await client.post(base + path, json=body, headers=headers)
    return response.status_code, shape(response.status_code, response.content, bool(body and body.get("stream")))


async def main() -> int:
    from runtime_helpers import KEY, start_runtime

    from zerolayer.runtime.engine.vllm_engine import VllmEngine

    root = pathlib.Path(tempfile.mkdtemp(prefix="zl-compat-"))
    path = model_dir(root)
    port = free_port()
    with vllm_serve(path, port, root / "vllm-serve.log") as process:
        os.environ["TORCHDYNAMO_DISABLE"] = "1"
        engine = VllmEngine(str(path), served_name=MODEL, engine_args={"structured_outputs_config": STRUCTURED},
                            tool_parser="llama3_json", **ENGINE)
        async with start_runtime(engine=engine) as runtime, httpx.AsyncClient(timeout=120) as client:
            theirs_base = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 600
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(theirs_base + "/health")).status_code == 200:
                        break
                if process.poll() is not None or time.monotonic() > deadline:
                    print(f"vllm serve did not start: see {root / 'vllm-serve.log'}")
                    return 2
                await asyncio.sleep(2)
            rows = []
            for name, (route, body) in CASES.items():
                theirs = await ask(client, theirs_base, "unused", route, body)
                ours = await ask(client, runtime.base_url, KEY, route, body)
                rows.append((name, theirs, ours, verdict(name, ours, theirs)))
    width = max(len(name) for name in CASES)
    print(f"{'case':<{width}}  {'vllm serve':<70}  {'zerolayer':<70}  verdict")
    for name, theirs, ours, said in rows:
        note = f" ({CHOICES.get(name, 'usage.prompt_tokens_details, as OpenAI sends it')})" if said == "choice" else ""
        print(f"{name:<{width}}  {theirs[0]} {theirs[1]:<66}  {ours[0]} {ours[1]:<66}  {said}{note}")
    bad = [name for name, _, ours, said in rows if ours[0] >= 500 or said == "DIFF"]
    print(f"\n{len(rows)} cases: {sum(r[3] == 'same' for r in rows)} same, {sum(r[3] == 'choice' for r in rows)} "
          f"documented choices, {len(bad)} to look at{': ' + ', '.join(bad) if bad else ''}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
