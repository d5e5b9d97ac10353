"""Exact connection balance across API processes: one acceptor hands each connection to the least busy.

With ``server.api_processes`` N > 1, SO_REUSEPORT lets the kernel spread new connections over the
processes by a hash of the connection's addresses and ports. That is even over many clients, but an
HTTP/2 client multiplexes all its requests on one or a few connections, so a handful of clients can
land on one process while another idles (docs/api-processes.md, "Connection balance").
``server.connection_balance: exact`` (the default) instead has the parent listen and accept, and hand
each accepted socket (SCM_RIGHTS over a Unix socket pair) to the process with the fewest open
connections, as Envoy's ``exact_balance`` does between its workers:

- :class:`Acceptor` (the parent): accepts in a thread; a process's open connections are the
  connections handed to it minus those it has closed, which each process counts in its own slot of a
  shared array. No lock: one writer per slot, and the acceptor only reads them.
- :class:`HandoffReceiver` (an API process): reads the handed sockets on its event loop and starts
  each as if its own listener had accepted it (``loop.connect_accepted_socket``); :meth:`ended` counts
  a connection that has closed, whether it was served, refused at a connection cap, or failed its TLS
  handshake.

The cost is one ``accept`` and one ``sendmsg`` in the parent per connection, nothing per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
import ssl
import threading
import time
from typing import Any, Callable, Sequence

log = logging.getLogger(__name__)

BALANCES = ("exact", "kernel")
BACKLOG = socket.SOMAXCONN
ACCEPT_RETRY_S = 1.0  # after an accept that failed for want of descriptors or memory (asyncio waits 1 s too)


def channel_pair() -> tuple[socket.socket, socket.socket]:
    """(the acceptor's end, the API process's end): a Unix socket pair that keeps one message per socket."""
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)


class Acceptor:
    """Accepts on ``listener`` and hands each connection to the process with the fewest open ones.

    ``channels[i]`` is the acceptor's end of process *i*'s channel; ``closed[i]`` (shared memory,
    written by process *i* alone) counts the connections process *i* has closed.
    """

    def __init__(self, listener: socket.socket, channels: Sequence[socket.socket], closed: Sequence[int]) -> None:
        self.listener = listener
        self.channels = list(channels)
        self.closed = closed
        self.handed = [0] * len(self.channels)
        self._last = -1  # the process the last connection went to (ties rotate from the one after it)
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="zerolayer-acceptor", daemon=True)

    def start(self) -> "Acceptor":
        self.listener.listen(BACKLOG)
        self.listener.setblocking(True)
        self._thread.start()
        return self

    def open_connections(self) -> list[int]:
        """Per process: connections handed to it that it has not closed yet."""
        return [handed - self.closed[i] for i, handed in enumerate(self.handed)]

    def choose(self) -> int:
        """The process with the fewest open connections; among equals, the next after the last chosen, so
        clients that open a connection per request (each closed before the next) still go round."""
        counts = self.open_connections()
        fewest = min(counts)
        n = len(counts)
        self._last = next(i for i in ((self._last + k) % n for k in range(1, n + 1)) if counts[i] == fewest)
        return self._last

    def hand(self, conn: socket.socket) -> int:
        """Give ``conn`` to a process (its fd is duplicated into it; ours is closed); that process's index."""
        index = self.choose()
        try:
            socket.send_fds(self.channels[index], [b"c"], [conn.fileno()])
            self.handed[index] += 1
        finally:
            conn.close()
        return index

    def _run(self) -> None:
        while not self._stopping:
            try:
                conn, _ = self.listener.accept()
            except OSError as exc:
                if self._stopping:
                    return
                # ECONNABORTED: the next accept may succeed at once. EMFILE/ENFILE/ENOBUFS: the connection
                # stays queued and accept fails again at once until descriptors free up, so wait a moment
                # rather than spin this thread (asyncio's own accept loop pauses the same way).
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    log.warning("accepting connections: %s; retrying in %.1f s", exc, ACCEPT_RETRY_S)
                    time.sleep(ACCEPT_RETRY_S)
                continue
            try:
                self.hand(conn)
            except OSError as exc:  # a process's channel is gone: the node is stopping (apiprocs._watch)
                if not self._stopping:
                    log.error("cannot hand a connection to an API process: %s", exc)

    def stop(self) -> None:
        """Stop accepting (the processes drain the connections they hold) and close the channels."""
        self._stopping = True
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept
        self._thread.join(5)
        for channel in self.channels:
            channel.close()


class HandoffReceiver:
    """An API process's end of its channel: starts each handed socket as a connection on the event loop.

    ``slot``: this process's index in ``closed``, the shared array the acceptor reads.
    """

    def __init__(self, channel: socket.socket, closed: Any, slot: int) -> None:
        self.channel = channel
        self.closed = closed
        self.slot = slot
        self._loop: asyncio.AbstractEventLoop | None = None
        self._factory: Callable[[], asyncio.Protocol] | None = None
        self._ssl: ssl.SSLContext | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self, factory: Callable[[], asyncio.Protocol], ssl_context: ssl.SSLContext | None) -> None:
        self._loop = asyncio.get_running_loop()
        self._factory, self._ssl = factory, ssl_context
        self.channel.setblocking(False)
        self._loop.add_reader(self.channel.fileno(), self._receive)

    def ended(self) -> None:
        """One handed connection has closed (the acceptor counts it out of this process's open ones)."""
        self.closed[self.slot] += 1

    def _receive(self) -> None:
        while True:
            try:
                _, fds, _, _ = socket.recv_fds(self.channel, 1, 1)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.warning("connection hand-off channel failed: %s", exc)
                self.close()
                return
            if not fds:  # the acceptor closed its end: the node is stopping
                self.close()
                return
            for fd in fds:
                self._adopt(socket.socket(fileno=fd))

    def _adopt(self, sock: socket.socket) -> None:
        assert self._loop is not None and self._factory is not None
        sock.setblocking(False)
        task = self._loop.create_task(self._connect(self._loop, self._factory, sock))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _connect(self, loop: asyncio.AbstractEventLoop, factory: Callable[[], asyncio.Protocol],
                       sock: socket.socket) -> None:
        try:
            await loop.connect_accepted_socket(factory, sock, ssl=self._ssl)
        except Exception as exc:
            # The connection never reached its protocol (a failed TLS handshake, a peer already gone):
            # it is closed, and counted as such here since no connection_lost will.
            log.debug("handed connection failed before it started: %s", exc)
            sock.close()
            self.ended()

    def close(self) -> None:
        """Stop taking connections (the server is draining or the acceptor is gone)."""
        if self._loop is not None:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(self.channel.fileno())
            self._loop = None
        with contextlib.suppress(OSError):
            self.channel.close()
