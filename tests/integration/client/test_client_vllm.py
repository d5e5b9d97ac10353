"""The SDK against a runtime serving the real tiny vLLM (`zerolayer runtime --config standalone-vllm`).

The runtime runs as its own process group, as a user would start it; random weights produce noise,
so the checks are on structure: token counts, stop reasons, streaming events, the header contract
reaching the engine's priority queue, and typed errors from the real server.
"""

from __future__ import annotations

import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
import warnings

import httpx
import pytest
import yaml

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    pytest.importorskip("vllm", reason="the vllm engine extra is not installed")

from zerolayer.client import Client, PermissionDeniedError  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.engine, pytest.mark.timeout(400)]
REPO = pathlib.Path(__file__).resolve().parents[3]
KEY = "sk-zerolayer-demo"
MESSAGES = [{"role": "user", "content": "Say something about zero layers."}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def vllm_node(tmp_path_factory):
    config = yaml.safe_load((REPO / "examples" / "standalone-vllm.yaml").read_text())
    port = _free_port()
    config["listen"]["port"] = port
    config["engine"]["model_path"] = str(REPO / ".models" / "tiny-llama")
    config["tenants"][0]["priorities"] = ["normal", "low"]  # so `high` is a permission error
    path = tmp_path_factory.mktemp("vllm-node") / "runtime.yaml"
    path.write_text(yaml.safe_dump(config))
    log = open(path.parent / "runtime.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "zerolayer.cli", "runtime", "--config", str(path)],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"runtime exited: {(path.parent / 'runtime.log').read_text()[-3000:]}")
            try:
                if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            pytest.fail("runtime with vLLM did not become ready in 240 s")
        yield url
    finally:
        # The whole process group: vLLM's engine-core and worker processes go with the runtime.
        with _suppress():
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            with _suppress():
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        log.close()


class _suppress:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return exc[0] is not None and issubclass(exc[0], ProcessLookupError)


def test_create_and_stream_on_the_real_engine(vllm_node):
    with Client(api_key=KEY, base_url=vllm_node, priority="normal", deadline=120.0) as client:
        message = client.messages.create(model="tiny-llama", max_tokens=12, messages=MESSAGES)
        assert message.usage.output_tokens == 12 and message.stop_reason == "max_tokens"
        assert message.usage.input_tokens > 0

        with client.messages.create(model="tiny-llama", max_tokens=10, messages=MESSAGES, stream=True) as stream:
            events = list(stream)
        types = [e.type for e in events]
        assert types[0] == "message_start" and types[-1] == "message_stop"
        assert "content_block_delta" in types
        deltas = [e for e in events if e.type == "message_delta"]
        assert deltas and deltas[-1].usage["output_tokens"] == 10


def test_typed_error_from_the_real_server(vllm_node):
    with Client(api_key=KEY, base_url=vllm_node, priority="high", deadline=60.0) as client:
        with pytest.raises(PermissionDeniedError):
            client.messages.create(model="tiny-llama", max_tokens=4, messages=MESSAGES)
