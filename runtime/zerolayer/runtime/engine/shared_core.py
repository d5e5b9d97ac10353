"""One vLLM engine core for N API processes (``server.api_processes``), the way ``vllm serve
--api-server-count N`` does it, with vLLM's own launcher.

The parent (:mod:`zerolayer.runtime.apiprocs`) binds vLLM's ZMQ listeners for N clients and starts
the engine core (:meth:`SharedEngineCore.launch`); each API process then builds its ``AsyncLLM`` as
client *i* of N of that core (:class:`CoreClient`, given to
:class:`~zerolayer.runtime.engine.vllm_engine.VllmEngine`). Requests still go from the runtime's
HTTP/2 stream to the engine core over vLLM's own ZMQ channel: no hop is added.

vLLM's scheduler statistics (running, waiting, KV-cache use) reach whichever client's outputs a step
carries, so one process may see none for a while; :class:`SharedEngineStats` keeps the freshest
sample any process received, for every process's pressure view.

With ``prefix_digest: kv_events`` the launcher gives the engine core ``ipc://`` KV-event sockets in a
directory it makes (:meth:`SharedEngineCore.kv_events_config`), which vLLM binds; every API process's
subscriber connects to them (:mod:`zerolayer.runtime.engine.kv_events`).

LoRA adapters: each process builds the ``LoRARequest`` of the requests it admits, under the id every
process gives that adapter (:func:`~zerolayer.runtime.engine.lora.adapter_id`), so the engine core
loads an adapter once; in a cluster each process runs its own adapter sync (docs/api-processes.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import shutil
import tempfile
import time
from typing import Any, Iterator

from zerolayer.engine_prefixes import EngineCachedPrefixes
from zerolayer.runtime.engine import kv_events
from zerolayer.runtime.engine.base import EngineStats
from zerolayer.runtime.errors import ConfigError, EngineError


@dataclasses.dataclass
class CoreClient:
    """What API process ``index`` of ``count`` needs to join the shared engine core: vLLM's client
    config (ZMQ addresses and the listening sockets the parent bound), as ``AsyncLLM`` takes it, and
    the scheduler sample every process shares."""

    index: int
    count: int
    addresses: dict[str, Any]
    stats: "SharedEngineStats | None" = None
    # prefix_digest: kv_events: where the engine core binds its KV-event sockets (kv_events.shared_events_config)
    kv_events: dict[str, Any] | None = None


class SharedEngineStats:
    """The engine core's latest scheduler sample, in shared memory: (monotonic time, running,
    waiting, KV-cache use). Every process writes what it receives and reads the freshest."""

    def __init__(self, context: Any = None) -> None:
        ctx = context or multiprocessing.get_context("spawn")
        self._values = ctx.RawArray("d", 4)
        self._lock = ctx.Lock()

    def put(self, stats: EngineStats) -> None:
        with self._lock:
            values = self._values
            values[0], values[1], values[2], values[3] = (time.monotonic(), stats.running, stats.waiting,
                                                          stats.kv_cache_usage)

    def freshest(self, own: EngineStats, own_at: float) -> EngineStats:
        """``own`` (received at ``own_at``), or the shared sample when another process's is newer."""
        with self._lock:
            at, running, waiting, usage = self._values[:]
        if at <= own_at:
            return own
        return dataclasses.replace(own, running=int(running), waiting=int(waiting), kv_cache_usage=usage)


class StatsBox:
    """An engine's latest scheduler sample; with ``shared``, the freshest any API process received."""

    def __init__(self, shared: SharedEngineStats | None = None) -> None:
        self.latest = EngineStats(running=0, waiting=0, kv_cache_usage=0.0)
        self.at = 0.0
        self.shared = shared

    def put(self, stats: EngineStats) -> None:
        self.latest, self.at = stats, time.monotonic()
        if self.shared is not None:
            self.shared.put(stats)

    def get(self) -> EngineStats:
        return self.latest if self.shared is None else self.shared.freshest(self.latest, self.at)


class SharedEngineCore:
    """vLLM's engine core for ``count`` API processes, started from the engine args of ``engine``
    (a :class:`~zerolayer.runtime.engine.vllm_engine.VllmEngine` built from the config, never started
    in the parent)."""

    def __init__(self, engine: Any, count: int) -> None:
        if count < 2:
            raise ConfigError("a shared engine core is for two API processes or more")
        self.engine = engine
        self.count = count
        self._manager: Any = None
        self._listeners: Any = None
        self._kv_dir: str | None = None  # prefix_digest: kv_events: the engine core's event sockets

    def kv_events_config(self) -> dict[str, Any] | None:
        """With ``prefix_digest: kv_events``: ``KVEventsConfig``'s fields for the engine core, which binds
        them in a directory made here (mode 0700, removed at :meth:`shutdown`); every API process's
        subscriber connects (engine/kv_events.py). None otherwise."""
        if not isinstance(self.engine.served_prefixes, EngineCachedPrefixes):
            return None
        if self._kv_dir is None:
            self._kv_dir = tempfile.mkdtemp(prefix="zerolayer-kv-")
        return kv_events.shared_events_config(self._kv_dir)

    def vllm_config(self, rank: int, events: dict[str, Any] | None = None) -> Any:
        """vLLM's config for API process ``rank`` (-1: the launcher), as ``run_multi_api_server`` builds it;
        ``events``: the engine core's ``kv_events_config`` fields (the launcher's only)."""
        from vllm.config import KVEventsConfig
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.usage.usage_lib import UsageContext

        args = self.engine.engine_args()
        if events is not None:
            args = {**args, "kv_events_config": KVEventsConfig(**events)}
        engine_args = AsyncEngineArgs(**args)
        engine_args._api_process_count = self.count
        engine_args._api_process_rank = rank
        return engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)

    @contextlib.contextmanager
    def launch(self) -> Iterator[tuple[list[CoreClient], Any]]:
        """Bind the listeners and start the engine core; yields each API process's :class:`CoreClient`
        and vLLM's launch record. Start the API processes inside the block (set the record's
        ``watched_frontend_processes`` to them): leaving it waits for the engine core to be up."""
        try:
            from vllm.v1.engine.utils import bind_engine_zmq_listeners, launch_core_engines
            from vllm.v1.executor import Executor
        except ImportError as exc:
            raise EngineError("the vllm engine needs vLLM installed (pip install 'zerolayer[engine]')") from exc
        from zerolayer.runtime.engine.vllm_engine import _visible_devices

        events = self.kv_events_config()
        vllm_config = self.vllm_config(-1, events)
        listeners = self._listeners = bind_engine_zmq_listeners(vllm_config, self.count)
        with _visible_devices(self.engine.devices):
            with launch_core_engines(vllm_config, Executor.get_class(vllm_config), True,
                                     listeners.addresses) as launched:
                self._manager = launched.engine_manager
                addresses = launched.addresses
                stats = SharedEngineStats()
                clients = []
                for i, (inp, out) in enumerate(zip(listeners.inputs, listeners.outputs, strict=True)):
                    config: dict[str, Any] = {"input_address": inp.address, "output_address": out.address,
                                              "input_listener": inp.socket, "output_listener": out.socket}
                    stats_address = getattr(addresses, "frontend_stats_publish_address", None)
                    if stats_address is not None:
                        config["stats_update_address"] = stats_address
                    if launched.tensor_queue is not None:
                        config["tensor_queue"] = launched.tensor_queue
                    clients.append(CoreClient(i, self.count, config, stats, events))
                yield clients, launched

    def sentinels(self) -> list[Any]:
        """The engine core processes' sentinels (for ``multiprocessing.connection.wait``)."""
        procs = getattr(self._manager, "processes", None) or []
        return [p.sentinel for p in procs]

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the engine core, then close the listeners (and remove their IPC paths)."""
        if self._manager is not None:
            manager, self._manager = self._manager, None
            manager.shutdown(timeout=timeout)
        if self._listeners is not None:
            listeners, self._listeners = self._listeners, None
            listeners.cleanup()
        if self._kv_dir is not None:
            kv_dir, self._kv_dir = self._kv_dir, None
            shutil.rmtree(kv_dir, ignore_errors=True)
