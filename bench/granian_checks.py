"""What zerolayer needs of an HTTP/2 core, checked on the wire against granian and against the runtime.

Every check opens a real TCP connection and writes raw frames (hyperframe + hpack), so it
tests the server, not a client library's manners:

* header-time refusal: HEADERS of a 1 MB POST that the server must refuse from its headers
  alone (granian: bench/floor_apps.py:rsgi_header_gate on ``x-bench-refuse``; the runtime: a
  wrong API key), no body byte sent — does a final response arrive, and how?
* floods (CVE-2023-44487 rapid reset; the 2019 SETTINGS/PING/empty-frame floods; the 2024
  CONTINUATION flood): how many frames the server takes before it ends the connection, with
  which GOAWAY code, and what the flood cost it in CPU and resident memory;
* h2spec (the conformance suite the runtime's tests run).

``python bench/granian_checks.py`` prints the table; bench/granian_core.py includes it.
"""

from __future__ import annotations

import glob
import os
import pathlib
import re
import shutil
import socket
import subprocess
import sys
import threading
import time

import hpack
from hyperframe.frame import (ContinuationFrame, DataFrame, HeadersFrame, PingFrame, RstStreamFrame,
                              SettingsFrame, WindowUpdateFrame)

import benchlib

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
H2_ERRORS = {0: "NO_ERROR", 1: "PROTOCOL_ERROR", 2: "INTERNAL_ERROR", 3: "FLOW_CONTROL_ERROR",
             7: "REFUSED_STREAM", 8: "CANCEL", 11: "ENHANCE_YOUR_CALM", 13: "HTTP_1_1_REQUIRED"}


class Wire:
    """One raw HTTP/2 connection. ``read=False`` leaves the server's answers unread until ``drain``."""

    def __init__(self, port: int, *, read: bool = True) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.settimeout(5)
        self.encoder = hpack.Encoder()
        self.frames: list[tuple[int, int, int, bytes, float]] = []  # type, flags, stream, payload, time
        self.eof = threading.Event()
        self.sent_frames = 0
        self.send_failed: str | None = None
        self._buf = b""
        self._reader: threading.Thread | None = None
        self.send(PREFACE + SettingsFrame(0).serialize() + WindowUpdateFrame(0, window_increment=2**30).serialize(),
                  count=0)
        if read:
            self._start_reader()

    def _start_reader(self) -> None:
        if self._reader is None:
            self._reader = threading.Thread(target=self._read, daemon=True)
            self._reader.start()

    def _read(self) -> None:
        self.sock.settimeout(None)
        while True:
            try:
                data = self.sock.recv(1 << 16)
            except OSError:
                data = b""
            if not data:
                self.eof.set()
                return
            self._buf += data
            while len(self._buf) >= 9:
                length = int.from_bytes(self._buf[:3], "big")
                if len(self._buf) < 9 + length:
                    break
                ftype, flags = self._buf[3], self._buf[4]
                stream = int.from_bytes(self._buf[5:9], "big") & 0x7FFFFFFF
                self.frames.append((ftype, flags, stream, self._buf[9:9 + length], time.monotonic()))
                self._buf = self._buf[9 + length:]

    def send(self, data: bytes, count: int = 1) -> bool:
        if self.send_failed:
            return False
        try:
            self.sock.sendall(data)
        except socket.timeout:
            self.send_failed = "server stopped reading (send blocked 5 s)"
            return False
        except OSError as exc:
            self.send_failed = f"connection closed ({exc.__class__.__name__})"
            return False
        self.sent_frames += count
        return True

    def headers(self, stream: int, fields: list[tuple[str, str]], *, end_stream: bool, end_headers: bool = True) -> bytes:
        flags = (["END_HEADERS"] if end_headers else []) + (["END_STREAM"] if end_stream else [])
        return HeadersFrame(stream, data=self.encoder.encode(fields), flags=flags).serialize()

    def drain(self, timeout: float) -> None:
        """Read until the server closes the connection or ``timeout`` passes."""
        self._start_reader()
        self.eof.wait(timeout)

    def goaway(self) -> tuple[str, int] | None:
        """The first GOAWAY's error code and last stream id."""
        for ftype, _, _, payload, _ in self.frames:
            if ftype == 7:
                code = int.from_bytes(payload[4:8], "big")
                return H2_ERRORS.get(code, str(code)), int.from_bytes(payload[:4], "big") & 0x7FFFFFFF
        return None

    def answered(self, ftype: int, ack: bool = False) -> int:
        """How many frames of ``ftype`` the server sent (``ack``: with the ACK flag)."""
        return sum(1 for t, f, _, _, _ in self.frames if t == ftype and (not ack or f & 0x1))

    def close(self) -> None:
        self.sock.close()


def rss_kb(pid: int) -> int:
    total = 0
    for p in benchlib.process_tree(pid):
        try:
            for line in pathlib.Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total


def request_fields(port: int, path: str, method: str = "POST", extra: list[tuple[str, str]] | None = None,
                   ) -> list[tuple[str, str]]:
    return [(":method", method), (":scheme", "http"), (":authority", f"127.0.0.1:{port}"), (":path", path),
            *(extra or [])]


# --------------------------------------------------------------------------- checks
def header_time_refusal(port: int, refuse: list[tuple[str, str]]) -> str:
    """HEADERS of a 1 MB POST that must be refused; no body byte sent. What comes back, and when?"""
    wire = Wire(port)
    fields = request_fields(port, benchlib.CHAT_PATH, extra=[("content-type", "application/json"),
                                                             ("content-length", str(1 << 20)), *refuse])
    t0 = time.monotonic()
    wire.send(wire.headers(1, fields, end_stream=False))
    deadline = t0 + 3
    status = None
    while time.monotonic() < deadline and status is None:
        for ftype, flags, stream, payload, at in list(wire.frames):
            if ftype == 1 and stream == 1:
                decoded = dict(hpack.Decoder().decode(payload) if not flags & 0x8 else [])
                status = (decoded.get(":status") or decoded.get(b":status"), at - t0, bool(flags & 0x1))
        time.sleep(0.005)
    if status is None:
        wire.close()
        return "no response within 3 s with the body unsent (the app is not called before the body arrives)"
    code, after, _ = status
    code = code.decode() if isinstance(code, bytes) else code
    time.sleep(0.2)
    ended = any(t in (0, 1) and f & 0x1 and s == 1 for t, f, s, _, _ in wire.frames)
    resets = [H2_ERRORS.get(int.from_bytes(p[:4], "big"), "?") for t, _, s, p, _ in wire.frames if t == 3 and s == 1]
    # The client keeps sending the body it announced: the connection must survive and stay usable.
    wire.send(DataFrame(1, data=b"x" * 16000).serialize())
    wire.send(PingFrame(0, opaque_data=b"zerolyr1").serialize())
    time.sleep(0.5)
    pong = any(t == 6 and f & 0x1 for t, f, _, _, _ in wire.frames)
    wire.close()
    return (f"{code} after {after * 1000:.1f} ms, 0 body bytes sent; response {'complete' if ended else 'not ended'}; "
            f"RST_STREAM {resets[0] if resets else 'none'}; connection {'usable (PING answered)' if pong else 'dead'}"
            " after the client sent body")


def flood(port: int, pid: int, name: str, count: int) -> str:
    """Send ``count`` frames of one flood; report when and how the server stopped it, and its cost."""
    read = name in ("rapid reset",)
    wire = Wire(port, read=read)
    meter = benchlib.CpuMeter(pid)
    meter.start()
    rss0 = rss_kb(pid)
    batch = 100
    if name == "CONTINUATION":
        fields = request_fields(port, "/healthz", "GET")
        wire.send(wire.headers(1, fields, end_stream=True, end_headers=False))
    if name == "empty DATA":
        fields = request_fields(port, benchlib.CHAT_PATH, extra=[("content-type", "application/json")])
        wire.send(wire.headers(1, fields, end_stream=False))
    stream = 1
    for start in range(0, count, batch):
        chunk = []
        for i in range(start, min(count, start + batch)):
            if name == "rapid reset":
                stream = 2 * i + 1
                chunk.append(wire.headers(stream, request_fields(port, "/healthz", "GET"), end_stream=True)
                             + RstStreamFrame(stream, error_code=8).serialize())
            elif name == "SETTINGS":
                chunk.append(SettingsFrame(0, settings={0x4: 65535}).serialize())
            elif name == "PING":
                chunk.append(PingFrame(0, opaque_data=i.to_bytes(8, "big")).serialize())
            elif name == "CONTINUATION":
                chunk.append(ContinuationFrame(1, data=wire.encoder.encode([(f"x-c{i}", "v" * 40)])).serialize())
            elif name == "empty DATA":
                chunk.append(DataFrame(1, data=b"").serialize())
        if not wire.send(b"".join(chunk), count=len(chunk)):
            break
        if wire.eof.is_set():
            break
    wire.drain(3)
    cpu = meter.stop()
    rss = rss_kb(pid) - rss0
    goaway = wire.goaway()
    closed = wire.eof.is_set()
    wire.close()
    # What the server did for the flood before it stopped it: answers are the observable work.
    answers = {"rapid reset": f"{wire.answered(1)} responses",
               "SETTINGS": f"{wire.answered(4, ack=True) - 1} SETTINGS ACKs",
               "PING": f"{wire.answered(6, ack=True)} PING ACKs"}.get(name, "")
    if name == "rapid reset" and goaway:
        answers += f", last stream {goaway[1]} ({(goaway[1] + 1) // 2} streams opened)"
    if goaway:
        outcome = f"GOAWAY {goaway[0]}"
    elif closed:
        outcome = "closed without GOAWAY"
    elif wire.send_failed:
        outcome = f"no GOAWAY; {wire.send_failed}"
    else:
        outcome = "no GOAWAY, connection open"
    sent = f"{wire.sent_frames}/{count} frames written"
    return "; ".join(x for x in (outcome, sent, answers, f"server CPU {cpu * 1000:.0f} ms, RSS {rss / 1024:+.1f} MB")
                     if x)


def h2spec_binary() -> str | None:
    found = shutil.which("h2spec")
    if found:
        return found
    cache = os.environ.get("ZEROLAYER_CACHE", str(pathlib.Path.home() / ".cache" / "zerolayer"))
    matches = sorted(glob.glob(os.path.join(cache, "controlplane-*", "bin", "h2spec")))
    return matches[-1] if matches else None


def h2spec(port: int) -> str:
    binary = h2spec_binary()
    if binary is None:
        return "h2spec not found (zerolayer cluster up builds it into the control-plane cache)"
    done = subprocess.run([binary, "-h", "127.0.0.1", "-p", str(port), "--timeout", "3"], capture_output=True,
                          text=True, timeout=600)
    text = done.stdout + done.stderr
    summary = re.search(r"(\d+) tests, (\d+) passed, (\d+) skipped, (\d+) failed", text)
    if not summary:
        return f"no summary: {text[-300:]!r}"
    total, passed, skipped, failed = map(int, summary.groups())
    failures = []
    if failed:
        section = text[text.find("Failures:"):]
        failures = re.findall(r"^\s*(\d+\.\d+(?:\.\d+)*)\.\s", section, re.M)
    ids = sorted({f for f in failures if f.count(".") >= 1})
    return f"{passed}/{total} passed, {failed} failed" + (f" ({', '.join(ids[:12])})" if ids else "")


# Unread SETTINGS/PING floods must be large enough to outgrow the loopback socket buffers (a few MB),
# or the kernel absorbs the answers and the server's own limit is never reached.
FLOODS = (("rapid reset", 5000), ("SETTINGS", 300000), ("PING", 300000), ("CONTINUATION", 10000),
          ("empty DATA", 20000))


def checks_for(port: int, pid: int, refuse: list[tuple[str, str]]) -> dict[str, str]:
    out = {"header-time refusal": header_time_refusal(port, refuse)}
    for name, count in FLOODS:
        try:
            out[f"{name} flood"] = flood(port, pid, name, count)
        except OSError as exc:
            out[f"{name} flood"] = f"client error {exc!r}"
        time.sleep(0.5)
    out["h2spec"] = h2spec(port)
    return out


def run_all() -> str:
    """Start granian and the runtime, run every check on both, return the table."""
    import granian
    import granian_core

    results: dict[str, dict[str, str]] = {}
    port = benchlib.free_port()
    with benchlib.server(granian_core.granian_cmd(port, "2", "floor_apps:rsgi_header_gate"), port) as proc:
        time.sleep(0.5)
        results[f"granian {granian.__version__}"] = checks_for(port, proc.pid, [("x-bench-refuse", "1")])
    port = benchlib.free_port()
    config = benchlib.write_config(benchlib.runtime_config(port))
    try:
        with benchlib.server(benchlib.runtime_cmd(config), port, env={"BENCH_KEY": benchlib.KEY}) as proc:
            time.sleep(0.5)
            results["zerolayer runtime"] = checks_for(port, proc.pid, [("authorization", "Bearer wrong-key")])
    finally:
        os.unlink(config)
    lines = ["fitness checks on the wire (bench/granian_checks.py; raw frames, one connection per check):"]
    for server, checks in results.items():
        lines.append(f"  {server}:")
        for name, outcome in checks.items():
            lines.append(f"    {name:<22} {outcome}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(run_all())
    sys.exit(0)
