"""Keys and prompts never leave the runtime in its logs, its audit spool or its answers (issue 17).

A real ``zerolayer runtime`` process (synthetic engine, DEBUG logging, the audit spool with the
in-process journal) serves one tenant whose key, a wrong key a client tries, and the prompts are
unique marker strings. Clients send good requests (both APIs, HTTP/1.1 and HTTP/2, streamed and
not), a wrong key, a key as ``Authorization: Bearer``, malformed bodies that carry the prompt
marker, requests over the tenant's quota, and a client that disconnects mid-stream. Then every
byte the run wrote is searched: stdout, stderr, every file under the spool, every response's
headers and body. None may hold a key, the key's SHA-256 (only the config does) or a prompt.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import uuid

import httpx
import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120), pytest.mark.asyncio(loop_scope="session")]

RUN = uuid.uuid4().hex[:12]
KEY = f"sk-secretmarker-{RUN}"
WRONG_KEY = f"sk-wrongkeymarker-{RUN}"
PROMPT = f"promptmarker{RUN}"
QUOTA = 21  # requests per minute: what the good and bad requests below are charged, so the next ones get 429


def config(requests_per_minute: int) -> str:
    return json.dumps({  # YAML is a superset of JSON
        "listen": {"host": "127.0.0.1", "port": 0},
        "engine": {"kind": "synthetic", "models": ["synthetic"], "output_tokens": 40, "tokens_per_second": 100},
        "tenants": [{"name": "markers", "keys": [{"env": "ZL_TEST_TENANT_KEY"}],
                     "requests_per_minute": requests_per_minute, "max_concurrent_streams": 4}],
    })


def body(api: str, *, stream: bool = False, prompt: str = PROMPT) -> bytes:
    messages = [{"role": "user", "content": f"tell me about {prompt} please"}]
    if api == "openai":
        return json.dumps({"model": "synthetic", "max_tokens": 8, "stream": stream, "messages": messages,
                           "stop": [prompt]}).encode()
    return json.dumps({"model": "synthetic", "max_tokens": 8, "stream": stream, "messages": messages,
                       "system": f"system {prompt}", "stop_sequences": [prompt]}).encode()


PATHS = {"anthropic": "/v1/messages", "openai": "/v1/chat/completions"}


async def exchange(responses: list[bytes], client: httpx.AsyncClient, url: str, content: bytes,
                   headers: dict[str, str]) -> int:
    response = await client.post(url, content=content, headers=headers)
    responses.append(f"{response.status_code} {response.http_version}\n".encode()
                     + b"".join(f"{k}: {v}\n".encode() for k, v in response.headers.items()) + response.content)
    return response.status_code


async def disconnect_mid_stream(port: int, responses: list[bytes]) -> None:
    """HTTP/1.1 by hand: read the first bytes of an SSE answer, then close the socket."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    payload = body("anthropic", stream=True)
    writer.write(b"POST /v1/messages HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 + f"x-api-key: {KEY}\r\ncontent-length: {len(payload)}\r\n\r\n".encode() + payload)
    await writer.drain()
    responses.append(await asyncio.wait_for(reader.read(2048), 10))
    writer.close()


async def test_keys_and_prompts_appear_nowhere_a_run_writes(tmp_path):
    spool = tmp_path / "spool"
    (tmp_path / "runtime.yaml").write_text(config(requests_per_minute=QUOTA))
    out, err = (tmp_path / "stdout.log").open("wb"), (tmp_path / "stderr.log").open("wb")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "zerolayer.cli", "runtime", "--config", str(tmp_path / "runtime.yaml"),
        "--log-level", "DEBUG", "--audit-spool", str(spool), "--audit-journal",
        stdout=out, stderr=err, cwd=tmp_path, env={**os.environ, "ZL_TEST_TENANT_KEY": KEY})
    responses: list[bytes] = []
    statuses: list[int] = []
    try:
        url = await serving_url(tmp_path, proc)
        port = int(url.rsplit(":", 1)[1])
        async with httpx.AsyncClient(http2=True) as h2, httpx.AsyncClient() as h1:
            for client in (h2, h1):
                for api, path in PATHS.items():
                    good = {"x-api-key": KEY, "content-type": "application/json"}
                    statuses.append(await exchange(responses, client, url + path, body(api), good))
                    statuses.append(await exchange(responses, client, url + path, body(api, stream=True), good))
                    statuses.append(await exchange(responses, client, url + path, body(api),
                                                   {"authorization": f"Bearer {KEY}"}))
                    statuses.append(await exchange(responses, client, url + path, body(api),
                                                   {"x-api-key": WRONG_KEY}))
                    statuses.append(await exchange(responses, client, url + path, body(api)[:-7], good))  # bad JSON
                    statuses.append(await exchange(responses, client, url + path, json.dumps(
                        {"model": "synthetic", "max_tokens": 4, "messages": [{"role": "user", "content": PROMPT}],
                         "temperature": PROMPT}  # a string where a number belongs: 400 in both APIs (a custom
                    ).encode(), good))  # message role is valid on OpenAI's, as in vLLM) and the value is secret
            await disconnect_mid_stream(port, responses)
            for _ in range(6):  # past requests_per_minute: 429s
                statuses.append(await exchange(responses, h2, url + PATHS["anthropic"], body("anthropic"),
                                               {"x-api-key": KEY}))
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 20) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        out.close()
        err.close()
    # The run exercised what it claims: answers, refusals of each kind, then the quota hit.
    assert statuses[:12] == [200, 200, 200, 401, 400, 400] * 2 and statuses[12:24] == statuses[:12], statuses
    assert statuses[-6:] == [429] * 6, statuses
    assert responses[24].startswith(b"HTTP/1.1 200"), responses[24][:100]  # the client that went away mid-stream
    written = {"stdout": (tmp_path / "stdout.log").read_bytes(), "stderr": (tmp_path / "stderr.log").read_bytes()}
    spooled = [p for p in spool.rglob("*") if p.is_file()]
    assert spooled, "the runtime wrote nothing to its audit spool"
    written.update({str(p.relative_to(tmp_path)): p.read_bytes() for p in spooled})
    written.update({f"response {i}": r for i, r in enumerate(responses)})
    assert len(written["stdout"] + written["stderr"]) > 0
    secrets = {"key": KEY, "wrong key": WRONG_KEY, "prompt": PROMPT,
               "key sha256": hashlib.sha256(KEY.encode()).hexdigest()}
    leaks = [(what, where) for what, marker in secrets.items() for where, data in written.items()
             if marker.encode() in data or marker.encode("utf-16-le") in data]
    assert not leaks, leaks


async def serving_url(tmp_path: pathlib.Path, proc: asyncio.subprocess.Process) -> str:
    log = tmp_path / "stdout.log"
    for _ in range(300):
        for line in log.read_text(errors="replace").splitlines() + \
                (tmp_path / "stderr.log").read_text(errors="replace").splitlines():
            if "serving on " in line:
                return line.split("serving on ")[1].split()[0]
        assert proc.returncode is None, "runtime exited before serving"
        await asyncio.sleep(0.1)
    raise AssertionError("runtime did not start serving in 30 s")
