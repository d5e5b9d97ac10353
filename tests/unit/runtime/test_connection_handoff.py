"""Exact connection balance (serving/handoff.py): the parent's acceptor hands each accepted socket to
the API process with the fewest open connections, and a process counts the ones it has closed.

Real sockets in one process: an :class:`Acceptor` on a loopback listener, and two
:class:`HandoffReceiver` ends on this test's event loop standing for two API processes."""

from __future__ import annotations

import asyncio
import ctypes
import socket

import pytest

from zerolayer.runtime.serving.handoff import Acceptor, HandoffReceiver, channel_pair


class Recorder(asyncio.Protocol):
    """A connection's protocol that remembers which process took it and what it read."""

    def __init__(self, process: int, taken: list["Recorder"], ended: HandoffReceiver) -> None:
        self.process, self.data, self._ended = process, b"", ended
        self.transport: asyncio.Transport | None = None
        taken.append(self)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.data += data

    def connection_lost(self, exc: Exception | None) -> None:
        self._ended.ended()  # what transport.Connection does through ConnectionContext.ended


class Node:
    def __init__(self, processes: int = 2) -> None:
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.closed = (ctypes.c_uint64 * processes)()
        pairs = [channel_pair() for _ in range(processes)]
        self.acceptor = Acceptor(self.listener, [ours for ours, _ in pairs], self.closed)
        self.receivers = [HandoffReceiver(theirs, self.closed, i) for i, (_, theirs) in enumerate(pairs)]
        self.taken: list[Recorder] = []

    def start(self) -> None:
        for i, receiver in enumerate(self.receivers):
            receiver.start(lambda i=i, r=receiver: Recorder(i, self.taken, r), None)
        self.acceptor.start()

    async def connect(self, payload: bytes = b"") -> socket.socket:
        before = len(self.taken)
        client = socket.create_connection(("127.0.0.1", self.port))
        if payload:
            client.sendall(payload)
        for _ in range(200):
            if len(self.taken) > before:
                break
            await asyncio.sleep(0.01)
        assert len(self.taken) == before + 1, "the connection was not handed to any process"
        return client

    def stop(self) -> None:
        self.acceptor.stop()
        for receiver in self.receivers:
            receiver.close()
        self.listener.close()  # the acceptor's owner closes it (apiprocs.supervise)


async def settle(condition, timeout_s: float = 2.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


@pytest.mark.asyncio
async def test_each_connection_goes_to_the_process_with_the_fewest_open_ones() -> None:
    node = Node(2)
    node.start()
    clients = []
    try:
        for _ in range(4):
            clients.append(await node.connect())
        assert [r.process for r in node.taken] == [0, 1, 0, 1]
        assert node.acceptor.open_connections() == [2, 2]

        # Process 1 closes both of its connections (the peers went away): the next two go to it.
        for recorder in node.taken[1::2]:
            assert recorder.transport is not None
            recorder.transport.close()
        await settle(lambda: node.acceptor.open_connections() == [2, 0])
        for _ in range(2):
            clients.append(await node.connect())
        assert [r.process for r in node.taken[4:]] == [1, 1]
        assert node.acceptor.open_connections() == [2, 2]
    finally:
        for client in clients:
            client.close()
        node.stop()


@pytest.mark.asyncio
async def test_connections_opened_one_after_another_go_round() -> None:
    """A client that opens a connection per request, each closed before the next: every process is at 0
    open connections each time, and the tie goes round instead of always to process 0."""
    node = Node(3)
    node.start()
    try:
        for _ in range(6):
            client = await node.connect()
            client.close()
            await settle(lambda: node.acceptor.open_connections() == [0, 0, 0])
        assert [r.process for r in node.taken] == [0, 1, 2, 0, 1, 2]
    finally:
        node.stop()


@pytest.mark.asyncio
async def test_a_handed_connection_keeps_its_bytes_and_a_client_close_is_counted() -> None:
    node = Node(2)
    node.start()
    try:
        client = await node.connect(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        recorder = node.taken[0]
        await settle(lambda: recorder.data == b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        assert recorder.transport is not None
        recorder.transport.write(b"answer")
        assert client.recv(16) == b"answer"
        client.close()  # the peer closes: the process sees EOF, closes, and counts it
        await settle(lambda: node.acceptor.open_connections() == [0, 0])
    finally:
        node.stop()


@pytest.mark.asyncio
async def test_a_connection_that_never_starts_is_counted_closed() -> None:
    """A TLS handshake that fails never reaches the protocol (no connection_lost): the receiver counts
    it itself, so the acceptor does not believe that process busier than it is."""
    import ssl

    node = Node(1)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)  # no certificate: every handshake fails
    receiver = node.receivers[0]
    receiver.start(lambda: Recorder(0, node.taken, receiver), context)
    node.acceptor.start()
    client = socket.create_connection(("127.0.0.1", node.port))
    try:
        client.sendall(b"\x16\x03\x01\x00\x05hello")  # not a ClientHello the server can answer
        await settle(lambda: node.acceptor.handed == [1] and node.acceptor.open_connections() == [0], 5.0)
        assert all(r.transport is None for r in node.taken)  # the protocol was never started
    finally:
        client.close()
        node.stop()


@pytest.mark.asyncio
async def test_the_receiver_stops_when_the_acceptor_is_gone() -> None:
    node = Node(1)
    node.start()
    node.acceptor.stop()  # closes its ends of the channels
    try:
        await settle(lambda: node.receivers[0].channel.fileno() == -1)
    finally:
        node.stop()


def test_the_acceptor_waits_when_it_runs_out_of_descriptors() -> None:
    """EMFILE leaves the connection queued, so accept fails again at once: the thread must pause, not spin."""
    import errno
    import threading
    import time

    class OutOfDescriptors:
        def __init__(self) -> None:
            self.calls = 0
            self.stopped = threading.Event()

        def listen(self, backlog: int) -> None:
            pass

        def setblocking(self, flag: bool) -> None:
            pass

        def accept(self):  # type: ignore[no-untyped-def]
            self.calls += 1
            if self.stopped.is_set():
                raise OSError(errno.EINVAL, "shut down")
            raise OSError(errno.EMFILE, "Too many open files")

        def shutdown(self, how: int) -> None:
            self.stopped.set()

    listener = OutOfDescriptors()
    acceptor = Acceptor(listener, [], [])  # type: ignore[arg-type]
    acceptor.start()
    time.sleep(0.3)
    calls = listener.calls
    acceptor._stopping = True
    listener.stopped.set()
    assert calls == 1  # one failed accept, then the pause (ACCEPT_RETRY_S); a spin makes thousands
