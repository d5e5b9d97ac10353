"""N API processes on one port, one engine core, one admission view (``server.api_processes``).

One runtime process is one Python interpreter: its HTTP, admission and streaming work is bounded by
one core. ``vllm serve --api-server-count N`` answers that with N API processes that are clients of
one engine core; this module does the same for the runtime (docs/api-processes.md):

- the parent (``zerolayer runtime`` with N > 1) creates the shared admission state, starts vLLM's
  engine core with vLLM's own launcher (:class:`~zerolayer.runtime.engine.shared_core.SharedEngineCore`;
  one per model with ``engines:``, each process a client of every one), then spawns N API processes;
- each API process is a whole runtime (:func:`zerolayer.runtime.compose.from_args` with an
  :class:`ApiProcess`): it binds the serving port with SO_REUSEPORT, admits with a quota ledger that
  sees every process's charges (:mod:`zerolayer.runtime.scheduler.board`), reads the engine's
  freshest scheduler sample whichever process received it, and claims its own slice of fleet-wide
  quotas (claimant ``<node>/api-<i>``); process 0 alone gossips the node's GPU map;
- the parent answers ``--metrics-port`` with every process's series, labelled ``api_process``, and
  stops everything when one process dies (the pod restarts, as vllm serve does).

With the synthetic engine each API process has its own engine (there is no engine core to share);
admission is shared all the same.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
from multiprocessing.connection import wait
from typing import Any, Iterator

from zerolayer.runtime.errors import RuntimeServerError
from zerolayer.runtime.serving.handoff import Acceptor, channel_pair

log = logging.getLogger("zerolayer.runtime.apiprocs")


@dataclasses.dataclass
class ApiProcess:
    """What API process ``index`` of ``count`` shares with the others (it pickles into the spawn)."""

    index: int
    count: int
    board: Any  # scheduler.board.QuotaBoard
    metrics_socket: str
    # engine.shared_core.CoreClient of each engine, in the config's order (None for one with no core to
    # share: the synthetic engine); empty when no engine has one
    core_clients: tuple[Any, ...] = ()
    # server.connection_balance exact: this process's end of the acceptor's channel, and the shared
    # count of connections each process has closed (serving/handoff.py); None with kernel balance.
    channel: socket.socket | None = None
    closed: Any = None
    running_board: Any = None  # scheduler.running.RunningBoard: memory-pressure shedding picks node-wide
    prefix_board: Any = None  # gossip.prefix_board.PrefixBoard: process 0 gossips every process's prefixes

    def running(self) -> Any:
        """This process's view of the node's running streams, for node-wide shedding."""
        from zerolayer.runtime.scheduler.running import SharedRunning

        return SharedRunning(self.running_board, self.index) if self.running_board is not None else None

    def handoff(self) -> Any:
        """Where this process's connections come from: the parent's acceptor (exact balance), or None
        (kernel balance: it binds the shared port with SO_REUSEPORT)."""
        if self.channel is None:
            return None
        from zerolayer.runtime.serving.handoff import HandoffReceiver

        return HandoffReceiver(self.channel, self.closed, self.index)

    def ledger(self, config: Any) -> Any:
        """This process's view of the node's tenant quotas."""
        from zerolayer.runtime.scheduler.board import SharedQuotaLedger

        return SharedQuotaLedger(self.board, self.index, config.quota_window_s, config.concurrency_retry_after_s)

    def engine_wiring(self) -> dict[str, Any]:
        """``build_engine``'s keywords: each vLLM engine joins its shared core (none for the synthetic one)."""
        return {"core_clients": self.core_clients} if self.core_clients else {}

    def agent_args(self, args: argparse.Namespace) -> argparse.Namespace:
        """The node agent's flags: process 0 gossips the node's status; the others do not, and read the
        fleet map (on demand, for alternatives on their refusals) as process 0 does."""
        if self.index == 0:
            return args
        return argparse.Namespace(**{**vars(args), "gossip": False})

    def prefix_share(self) -> Any:
        """This process's part in the node's one prefix-cache digest (process 0 gossips it)."""
        from zerolayer.runtime.gossip.prefix_board import PrefixShare

        return PrefixShare(self.prefix_board, self.index) if self.prefix_board is not None else None

    def claimant(self, node: str) -> str:
        """The name this process's fleet-quota claims go under: each process holds its own slice."""
        return node if self.index == 0 else f"{node}/api-{self.index}"


def supervise(args: argparse.Namespace, count: int, build_engine: Any, listen: tuple[str, int],
              balance: str = "exact") -> int:
    """Run ``count`` API processes until SIGTERM/SIGINT or until one exits; the exit status. ``listen``:
    the config's address, which ``--port`` overrides; port 0 is resolved here, once, for all of them.
    ``balance`` (``server.connection_balance``): ``exact``, this process accepts and hands each
    connection to the API process with the fewest open ones; ``kernel``, each binds the port
    (SO_REUSEPORT) and the kernel's hash spreads them."""
    from zerolayer.runtime.scheduler.board import QuotaBoard
    from zerolayer.runtime.gossip.prefix_board import PrefixBoard
    from zerolayer.runtime.scheduler.running import RunningBoard

    reserved = _reserve_port(listen[0], args.port if args.port is not None else listen[1])
    args = argparse.Namespace(**{**vars(args), "port": reserved.getsockname()[1]})
    ctx = multiprocessing.get_context("spawn")
    board = QuotaBoard.create(count, context=ctx)
    running = RunningBoard.create(count, context=ctx)
    prefixes = PrefixBoard.create(count, context=ctx)
    channels = [channel_pair() for _ in range(count)] if balance == "exact" else []
    closed: Any = ctx.RawArray("Q", count) if channels else None
    acceptor = None
    sockets = tempfile.mkdtemp(prefix="zerolayer-api-")
    paths = [os.path.join(sockets, f"metrics-{i}.sock") for i in range(count)]
    _stop_on_signals()
    procs: list[Any] = []
    cores: list[Any] = []
    try:
        with _engine_cores(build_engine, count, cores) as (clients, launched):
            for i in range(count):
                api = ApiProcess(i, count, board, paths[i], clients[i] if clients else (),
                                 channels[i][1] if channels else None, closed, running, prefixes)
                procs.append(ctx.Process(target=child_main, args=(args, api), name=f"zerolayer-api-{i}"))
                procs[-1].start()
            for _, theirs in channels:
                theirs.close()  # each process has its own copy now
            for record in launched:
                record.watched_frontend_processes = procs  # an API process that dies aborts the engine's start
        print(f"zerolayer runtime: {count} API processes (pids {', '.join(str(p.pid) for p in procs)})"
              + (f", {_cores_named(len(cores))}" if cores else ""), flush=True)
        _metrics_thread(args.metrics_port, paths)
        if channels:
            acceptor = Acceptor(reserved, [ours for ours, _ in channels], closed).start()
        return _watch(procs, [s for core in cores for s in core.sentinels()])
    except SystemExit:
        return 0
    except RuntimeServerError as exc:
        print(f"zerolayer runtime: {exc}", file=sys.stderr)
        return 2
    finally:
        if acceptor is not None:
            acceptor.stop()  # no new connections; the processes drain the ones they hold
        _stop_all(procs)
        for core in cores:
            core.shutdown(timeout=10)
        shutil.rmtree(sockets, ignore_errors=True)
        reserved.close()


def _reserve_port(host: str, port: int) -> socket.socket:
    """A socket bound (not listening) to ``host:port`` with SO_REUSEPORT, so that port 0 becomes one port
    every API process binds, and the port stays this node's while they start. It never accepts."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise RuntimeServerError(f"cannot bind {host}:{port} for the API processes: {exc}") from exc
    return sock


def _stop_on_signals() -> None:
    """SIGTERM and SIGINT end :func:`supervise`'s wait (as SystemExit), once."""

    def stop(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)


def _watch(procs: list[Any], engine: list[Any]) -> int:
    """Wait until an API process or the engine core exits: the node stops (its pod restarts) with 1."""
    watched = {p.sentinel: p for p in procs}
    ready = wait([*watched, *engine])
    proc = next((watched[s] for s in ready if s in watched), None)
    if proc is None:
        log.error("the engine core exited: stopping the API processes")
    else:
        log.error("API process %s exited (%s): stopping the others", proc.name, proc.exitcode)
    return 1


@contextlib.contextmanager
def _engine_cores(build_engine: Any, count: int, cores: list[Any]) -> Iterator[tuple[list[tuple[Any, ...]], list[Any]]]:
    """Start one shared vLLM engine core per vLLM engine of the config (``engines:`` lists one per base
    model), appending each to ``cores`` as it starts (the caller shuts them down); yields each API
    process's clients, one per engine in the config's order (None for a synthetic engine), and vLLM's
    launch records. Nothing to start (only synthetic engines): no clients, no records."""
    from zerolayer.runtime.engine.router import each_engine

    engines = each_engine(build_engine())
    if not any(e.kind == "vllm" for e in engines):
        yield [], []
        return
    from zerolayer.runtime.engine.shared_core import SharedEngineCore

    shared = [SharedEngineCore(e, count) if e.kind == "vllm" else None for e in engines]  # refusals first
    with contextlib.ExitStack() as stack:
        per_engine: list[list[Any] | None] = []
        launched = []
        for core in shared:
            if core is None:
                per_engine.append(None)
                continue
            cores.append(core)
            clients, record = stack.enter_context(core.launch())
            per_engine.append(clients)
            launched.append(record)
        yield [tuple(c[i] if c is not None else None for c in per_engine) for i in range(count)], launched


def _cores_named(n: int) -> str:
    return "one vLLM engine core" if n == 1 else f"{n} vLLM engine cores (one per model)"


def _stop_all(procs: list[Any], grace_s: float = 35.0) -> None:
    """SIGTERM every live API process (each drains: GOAWAY, in-flight streams finish), then kill stragglers."""
    for proc in procs:
        if proc.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGTERM)
    for proc in procs:
        proc.join(grace_s)
        if proc.is_alive():
            proc.kill()
            proc.join(5)


def child_main(args: argparse.Namespace, api: ApiProcess) -> None:
    """An API process: the runtime ``args`` describe, as process ``api.index`` of ``api.count``."""
    from zerolayer import logformat
    from zerolayer.runtime.compose import from_args, serve

    logformat.configure(args.log_level, args.log_format)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent turns ^C into SIGTERM for each process
    try:
        runtime = from_args(args, api=api)
    except RuntimeServerError as exc:
        print(f"zerolayer runtime (API process {api.index}): {exc}", file=sys.stderr)
        sys.exit(2)
    sys.exit(serve(runtime, f"API process {api.index}/{api.count}: "))


def _metrics_thread(port: int | None, sockets: list[str]) -> Any:
    """Answer ``GET /metrics`` on ``port`` (when given) with every API process's series, in a thread."""
    if not port:
        return None
    import threading

    from zerolayer.runtime.compose import metrics_answer

    async def main() -> None:
        async def render() -> bytes:
            return merge_metrics(await asyncio.gather(*(_scrape(path) for path in sockets)))

        server = await asyncio.start_server(_async_answer(metrics_answer, render), "0.0.0.0", port, limit=16384)
        async with server:
            await server.serve_forever()

    thread = threading.Thread(target=asyncio.run, args=(main(),), name="zerolayer-metrics", daemon=True)
    thread.start()
    return thread


def _async_answer(metrics_answer: Any, render: Any) -> Any:
    """``metrics_answer`` for a ``render`` that is a coroutine: render first, then answer with the bytes."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        body = await render()
        await metrics_answer(lambda: body)(reader, writer)

    return answer


async def _scrape(path: str) -> bytes:
    """One API process's ``/metrics`` over its Unix socket; empty if it does not answer."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(path), timeout=2)
    except (OSError, asyncio.TimeoutError):
        return b""
    try:
        writer.write(b"GET /metrics HTTP/1.1\r\nhost: local\r\n\r\n")
        data = await asyncio.wait_for(reader.read(), timeout=5)
    except (OSError, asyncio.TimeoutError):
        return b""
    finally:
        writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return body if head.startswith(b"HTTP/1.1 200") else b""


def merge_metrics(pages: list[bytes]) -> bytes:
    """The API processes' exposition pages as one, each sample labelled ``api_process`` (its index);
    each family once, its samples from every process together (the text format wants them grouped)."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families
    from prometheus_client.samples import Sample

    families: dict[str, Any] = {}
    for index, page in enumerate(pages):
        for family in text_string_to_metric_families(page.decode("utf-8", "replace")):
            kept = families.setdefault(family.name, family)
            samples = [Sample(s.name, {**s.labels, "api_process": str(index)}, s.value, s.timestamp, s.exemplar)
                       for s in family.samples]
            if kept is family:
                family.samples = samples
            else:
                kept.samples.extend(samples)

    class _Merged:
        def collect(self) -> Any:
            return list(families.values())

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged())
    return generate_latest(registry)
