"""Real runtime processes for the SDK's integration tests (see runtime_node.py)."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys

import pytest

NODE = pathlib.Path(__file__).with_name("runtime_node.py")


class RuntimeNode:
    """One runtime process; ``kill()`` is SIGKILL (a node dying), ``break_engine()`` / ``heal_engine()``
    switch its engine's injected failure on and off."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(NODE), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
        )  # fmt: skip
        line = self.proc.stdout.readline()
        if not line.startswith("READY "):
            self.proc.kill()
            raise RuntimeError(f"runtime did not start: {line!r} {self.proc.stderr.read()[-2000:]}")
        self.port = int(line.split()[1])
        self.url = f"http://127.0.0.1:{self.port}"

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def break_engine(self) -> None:
        self.proc.send_signal(signal.SIGUSR1)

    def heal_engine(self) -> None:
        self.proc.send_signal(signal.SIGUSR2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc.stdout.close()
        self.proc.stderr.close()


@pytest.fixture
def runtimes():
    """``runtimes(*args)`` starts a runtime process; all are stopped at teardown."""
    started: list[RuntimeNode] = []

    def start(*args: str) -> RuntimeNode:
        node = RuntimeNode(*args)
        started.append(node)
        return node

    yield start
    for node in started:
        node.stop()
