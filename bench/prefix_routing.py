"""Prefix-aware routing by the SDK on a shared-prefix workload: round-robin vs session hashing vs prefix vs precise.

    python bench/prefix_routing.py                      # the table (synthetic prefill model, ~6 min)
    python bench/prefix_routing.py --quick              # a smaller run (~2 min)
    python bench/prefix_routing.py --vllm-small         # the real vLLM engine, small and quick
    python bench/prefix_routing.py --vllm-prefill       # the real vLLM engine where prefill dominates (~25 min)

Three runtimes run as their own processes (``RuntimeServer`` on the real HTTP/2 path, as
``tests/integration/client/runtime_node.py`` starts them). The client is the SDK itself
(``zerolayer.client.AsyncClient``, four independent client instances, as four application pods
would be, each request with its own session), whose :class:`~zerolayer.client.routing.Router`
policy is the only thing that changes between rows:

- ``round_robin``: what a Kubernetes Service gives;
- ``session``: today's session hashing (a consistent-hash ring on the session id);
- ``prefix``: prefix-aware choice from the SDK's own record of where it sent which blocks;
- ``precise``: the same, reading each node's gossiped ``status.prefixCache`` digest;
- ``oracle``: the same choice rule (bounded load, longest match, the ring for a new prefix) fed by
  every node's exact prefix cache at the moment of the choice: each node streams its cache changes
  to the bench as they happen, the bench renders each prompt to the token blocks the node will
  hash, and the client keeps no record of its own. Synthetic engine: blocks stored (including
  prompts queued for prefill) and evicted by the prefill model, prompts rendered with its template.
  Real engine (needs ``--prefix-digest kv_events``): every token block vLLM's own KV cache events
  say it stored or evicted, keyed as :mod:`zerolayer.engine_prefixes` keys them, prompts rendered
  with the model's tokenizer and chat template as the runtime renders them. The yardstick for
  "precise within 10 % of an oracle"; ``oracle prompts not seen at a node`` checks the rendering.

Gossip: each node runs the real :class:`~zerolayer.runtime.gossip.publisher.GossipPublisher`
(its change/heartbeat policy and the 2 s digest throttle) with a file in place of the API server;
the SDK's node map reads those files every 0.5 s (a watch's latency). The run reports the patches
each node made, which is what the API server would receive.

The engine. This machine has 2 shared CPU cores: vLLM on CPU with a model big enough that prefill
dominates TTFT cannot serve three replicas at a useful rate here. The nodes therefore run the
*synthetic* engine with a **prefill model**: one GPU per node that prefills one prompt at a time
(``--prefill-ms-per-token`` per uncached token), a vLLM-like prefix cache (chained hashes of
16-token blocks, LRU, ``--cache-blocks`` per node) and paced decoding. The routing decisions,
the HTTP/2 path, the gossip and the SDK are the real ones; TTFT is the modelled prefill plus the
real queueing. The hit rate is the engines' own (cached prompt tokens / prompt tokens).
``--vllm-small`` runs the real vLLM instead (a ~5M-parameter random Llama, 16 MiB of KV cache per
node so that six groups do not fit one node's cache but two do), smaller and slower: the check
that the synthetic model's direction holds on the real engine, with vLLM's own hit counters.
``--vllm-prefill`` is the real engine where prefill dominates TTFT (a random Llama of 8 layers x
hidden 512, ~830-token prompts: the no-shared-prefix rows' P50 TTFT, an uncached prefill, is ~5x
the prefix rows', mostly cached), 12 groups, each node's KV cache holding about five groups' prompts, precise mode and
the oracle from vLLM's KV cache events: the peers' shape at the size 2 shared cores allow. Its
shared rows start with one unmeasured request per group (``--warm-groups``): the peers' runs send
hundreds of requests per prefix, so the one cold prefill each group costs every policy is far
below their P90; with 90 requests over 12 groups it would be the P90 of every row.

Workload: the kubernetes-sigs inference-perf ``shared_prefix`` shape (``num_groups`` groups,
each a long shared system prompt, short distinct questions, ``output_len`` tokens out), Poisson
arrivals; and a no-shared-prefix workload (every prompt its own, same lengths).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import hashlib
import json
import os
import pathlib
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Iterator, Sequence

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

KEY = "sk-prefix-bench"
MODEL = "m"
BLOCK_TOKENS = 16
POLICIES = ("round_robin", "session", "prefix", "precise", "oracle")
ORACLE_LINE = "ORACLE "  # a node's cache change on its stdout: ORACLE +|- hash,hash,...


def token_blocks(ids: Sequence[int]) -> list[bytes]:
    """The prefill model's chained hashes of a prompt's full ``BLOCK_TOKENS`` blocks (vLLM's scheme)."""
    blocks, parent = [], b""
    for start in range(0, len(ids) // BLOCK_TOKENS * BLOCK_TOKENS, BLOCK_TOKENS):
        parent = hashlib.blake2b(parent + repr(ids[start:start + BLOCK_TOKENS]).encode(), digest_size=8).digest()
        blocks.append(parent)
    return blocks


# =========================================================================== the node (a subprocess)
def run_node(args: argparse.Namespace) -> None:
    from zerolayer.prefix import ServedPrefixes  # the engine keeps one: the digest
    from zerolayer.runtime.engine.base import EngineStats
    from zerolayer.runtime.engine.synthetic import SyntheticEngine
    from zerolayer.runtime.gossip import prefix_cache_of
    from zerolayer.runtime.gossip.publisher import GossipPublisher
    from zerolayer.runtime.gossip.status import GossipSettings, Load
    from zerolayer.runtime.scheduler.api import TenantPolicy
    from zerolayer.runtime.scheduler.config import SchedulerConfig
    from zerolayer.runtime.scheduler.core import MicroScheduler
    from zerolayer.runtime.serving.server import RuntimeServer
    from zerolayer.runtime.tenants import Tenant, key_hash

    def tell(sign: str, blocks: Sequence[bytes]) -> None:
        if blocks:  # for the oracle row (stdout is read line by line by the bench)
            print(f"{ORACLE_LINE}{sign} {','.join(b.hex() for b in blocks)}", flush=True)

    class PrefillModelEngine(SyntheticEngine):
        """The synthetic engine with one modelled GPU: serial prefill of uncached tokens, an LRU prefix cache."""

        def __init__(self) -> None:
            super().__init__((MODEL,), output_tokens=args.output_tokens, tokens_per_second=args.decode_tps,
                             kv_capacity_tokens=10**9)
            self.cache: collections.OrderedDict[int, None] = collections.OrderedDict()
            self.gpu = asyncio.Lock()
            self.queued = 0
            self.prompt_tokens = 0
            self.hit_tokens = 0
            self.requests = 0

        async def generate(self, prompt, options, request_id, priority):  # type: ignore[no-untyped-def]
            ids = prompt.token_ids
            blocks = token_blocks(ids)
            tell("+", blocks)  # queued: cached before any later prompt prefills (the lock is FIFO)
            self.queued += 1
            try:
                async with self.gpu:
                    hit = 0
                    for block in blocks:
                        if block not in self.cache:
                            break
                        hit += 1
                    await asyncio.sleep((len(ids) - hit * BLOCK_TOKENS) * args.prefill_ms_per_token / 1000)
                    tell("+", [b for b in blocks if b not in self.cache])
                    for block in blocks:
                        self.cache[block] = None
                        self.cache.move_to_end(block)
                    evicted = []
                    while len(self.cache) > args.cache_blocks:
                        evicted.append(self.cache.popitem(last=False)[0])
                    tell("-", evicted)
            finally:
                self.queued -= 1
            self.requests += 1
            self.prompt_tokens += len(ids)
            self.hit_tokens += hit * BLOCK_TOKENS
            async for delta in super().generate(prompt, options, request_id, priority):
                yield delta

        def stats(self) -> EngineStats:
            base = super().stats()
            return EngineStats(running=base.running, waiting=self.queued, kv_cache_usage=0.0)

    class FileSink:
        """The API server's place: each patch replaces a JSON file (atomically); counts what it was sent."""

        def __init__(self, path: str) -> None:
            self.path = path
            self.patches = 0
            self.bytes = 0
            self.status: dict[str, Any] = {}

        def get(self, name: str) -> dict[str, Any]:
            return {"metadata": {"name": name}, "spec": {}}

        def patch_status(self, name: str, status: Any) -> dict[str, Any]:
            body = json.dumps({"status": status}, separators=(",", ":"))
            self.patches += 1
            self.bytes += len(body)
            self.status = {**self.status, **status}
            tmp = self.path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(self.status, f)
            os.replace(tmp, self.path)
            return {"metadata": {"name": name}, "spec": {}, "status": self.status}

    def vllm_engine() -> Any:
        from zerolayer.runtime.engine.vllm_engine import VllmEngine, VllmSettings

        class CountingVllm(VllmEngine):
            requests = 0
            prompt_tokens = 0

            async def generate(self, prompt, options, request_id, priority):  # type: ignore[no-untyped-def]
                self.requests += 1
                self.prompt_tokens += prompt.token_count
                async for delta in super().generate(prompt, options, request_id, priority):
                    yield delta

        engine = CountingVllm(args.model_path, served_name=MODEL, prefix_digest=args.prefix_digest,
                              settings=VllmSettings(max_model_len=args.max_model_len, max_num_seqs=8,
                                                    kv_cache_memory_bytes=args.kv_cache_bytes, enforce_eager=True,
                                                    dtype="float32", enable_prefix_caching=True))
        if args.prefix_digest == "kv_events":
            # The same record, telling the oracle every token block vLLM's events say it stored or evicted
            # (by the record's token chain keys, which the bench computes from each prompt's token ids).
            engine.served_prefixes = TellingRecord(engine_blocks=engine.served_prefixes.engine_blocks)
        return engine

    from zerolayer.engine_prefixes import EngineCachedPrefixes

    class TellingRecord(EngineCachedPrefixes):
        """:class:`EngineCachedPrefixes` that prints the token keys it starts or stops holding (for the oracle)."""

        def _told(self, change: Any, *call: Any) -> None:
            before = set(self._held)
            change(*call)
            after = set(self._held)
            tell("+", [k.to_bytes(8, "big") for k in after - before])
            tell("-", [k.to_bytes(8, "big") for k in before - after])

        def stored(self, hashes, parent, token_ids, block_size):  # type: ignore[no-untyped-def]
            self._told(super().stored, hashes, parent, token_ids, block_size)

        def removed(self, hashes):  # type: ignore[no-untyped-def]
            self._told(super().removed, hashes)

        def cleared(self) -> None:
            self._told(super().cleared)

    def engine_counts(engine: Any) -> dict[str, Any]:
        if args.engine == "synthetic":
            return {"requests": engine.requests, "prompt_tokens": engine.prompt_tokens, "hit_tokens": engine.hit_tokens}
        from vllm.v1.metrics.reader import get_metrics_snapshot

        found = {"vllm:prefix_cache_queries": 0.0, "vllm:prefix_cache_hits": 0.0}
        for metric in get_metrics_snapshot():
            if metric.name in found:
                found[metric.name] += float(getattr(metric, "value", 0.0))
        # vLLM's own counters (tokens queried / hit in its prefix cache), not our record
        return {"requests": engine.requests, "prompt_tokens": found["vllm:prefix_cache_queries"],
                "hit_tokens": found["vllm:prefix_cache_hits"]}

    async def main() -> None:
        engine = PrefillModelEngine() if args.engine == "synthetic" else vllm_engine()
        if args.engine == "synthetic":
            # The modelled GPU's prefix cache is what this engine's KV cache is (the runtime sizes its
            # record from an engine's kv_capacity_tokens; the prefill model keeps its own cache).
            engine.served_prefixes = ServedPrefixes(cache_tokens=lambda: args.cache_blocks * BLOCK_TOKENS)
        if args.digest_blocks:
            engine.served_prefixes = ServedPrefixes(capacity=args.digest_blocks)
        config = SchedulerConfig(adopt_engine_kv_capacity=False, preempt_after_samples=10**6)
        tenant = Tenant("bench", frozenset({key_hash(KEY)}), TenantPolicy("bench"))
        server = RuntimeServer(engine=engine, scheduler=MicroScheduler(config), tenants=[tenant], port=0,
                               sample_interval_s=0.2)
        await server.start()
        sink = FileSink(args.status_file)
        publisher = GossipPublisher(
            args.name, sink, readings=lambda: (), endpoint=server.base_url, models=engine.models,
            load=lambda: Load(engine.stats().running, engine.stats().waiting, 0.0),
            prefix_cache=prefix_cache_of(engine), tick_s=0.2,
            settings=GossipSettings(heartbeat_s=1.0, stale_after_s=10.0, max_patches_per_s=2.0,
                                    prefix_digest_s=args.digest_seconds),
        ).start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        started = time.monotonic()

        def write_stats() -> None:
            tmp = args.stats_file + ".tmp"
            pathlib.Path(tmp).write_text(json.dumps({
                **engine_counts(engine), "patches": sink.patches, "patch_bytes": sink.bytes,
                "seconds": time.monotonic() - started, "digest_blocks": len(engine.served_prefixes)}))
            os.replace(tmp, args.stats_file)

        print(f"READY {server.port}", flush=True)
        if args.engine == "vllm":  # the engine's tokens per KV block, for the oracle's token keys (read after READY)
            print(f"{ORACLE_LINE}bs {engine._llm.vllm_config.cache_config.block_size}", flush=True)
        while not stop.is_set():  # the bench reads these between policies when it reuses the nodes
            write_stats()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)
        publisher.stop(final=False)
        write_stats()
        await server.stop(drain_timeout_s=1.0)

    asyncio.run(main())


# =========================================================================== the bench (the SDK side)
class FileNodeMap:
    """The SDK's node map from the nodes' gossip files, re-read every ``interval_s`` (a watch's latency).
    ``digests=False`` hides ``prefixCache`` (the approximate mode must not see it)."""

    def __init__(self, files: dict[str, str], *, digests: bool, interval_s: float = 0.5) -> None:
        from zerolayer.client.nodes import node_from_status

        self._files, self._digests, self._read = files, digests, node_from_status
        self._nodes: tuple[Any, ...] = ()
        self._stop = threading.Event()
        self.interval_s = interval_s
        self.poll()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def poll(self) -> None:
        nodes = []
        for name, path in self._files.items():
            try:
                status = json.loads(pathlib.Path(path).read_text())
            except (OSError, ValueError):
                continue
            if not self._digests:
                status.pop("prefixCache", None)
            node = self._read(name, status)
            if node is not None:
                nodes.append(node)
        self._nodes = tuple(nodes)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.poll()

    def nodes(self) -> Sequence[Any]:
        return self._nodes

    def close(self) -> None:
        self._stop.set()


class OracleCaches:
    """Every node's exact prefix cache (token blocks held or queued for prefill), from the ``ORACLE``
    lines each node prints as its cache changes; ``ever`` is every block any node was sent."""

    def __init__(self) -> None:
        self.held: dict[str, set[bytes]] = collections.defaultdict(set)
        self.ever: set[bytes] = set()
        self.block_size: int | None = None  # the real engine's tokens per KV block (its nodes say)

    def follow(self, name: str, stream: Any) -> None:
        for line in stream:
            if not line.startswith(ORACLE_LINE):
                continue
            sign, _, hashes = line[len(ORACLE_LINE):].strip().partition(" ")
            if sign == "bs":
                self.block_size = int(hashes)
                continue
            blocks = [bytes.fromhex(h) for h in hashes.split(",") if h]
            if sign == "+":
                self.held[name].update(blocks)
                self.ever.update(blocks)
            else:
                self.held[name].difference_update(blocks)


class OracleDigest:
    """A node's ``prefix_digest`` for the oracle row: the leading token blocks of the prompt (looked up
    by the SDK's byte-block hashes in ``prompts``) that the node holds right now."""

    def __init__(self, held: set[bytes], prompts: dict[tuple[int, ...], list[bytes]]) -> None:
        self.held, self.prompts = held, prompts

    def matched(self, blocks: Sequence[int]) -> int:
        count = 0
        for block in self.prompts[tuple(blocks)]:
            if block not in self.held:
                break
            count += 1
        return count


class OracleNodeMap:
    """The gossiped map with each node's digest replaced by its :class:`OracleDigest`."""

    def __init__(self, inner: FileNodeMap, caches: OracleCaches, prompts: dict[tuple[int, ...], list[bytes]]):
        self.inner, self.caches, self.prompts = inner, caches, prompts

    def nodes(self) -> Sequence[Any]:
        import dataclasses

        return [dataclasses.replace(n, prefix_digest=OracleDigest(self.caches.held[n.name], self.prompts))
                for n in self.inner.nodes()]

    def close(self) -> None:
        self.inner.close()


class NoRecord:
    """The oracle client's record of its own sends: none (it knows the caches)."""

    def add(self, node: str, blocks: Sequence[int], now: float) -> None:
        pass

    def matched(self, node: str, blocks: Sequence[int], since: float = 0.0) -> int:
        return 0

    def forget(self, node: str) -> None:
        pass


async def oracle_prompts(requests: list[tuple[float, str, str]], args: argparse.Namespace,
                         caches: OracleCaches) -> dict[tuple[int, ...], list[bytes]]:
    """Each request's SDK byte-block hashes -> the token blocks the node's engine will hash for it.

    Synthetic engine: its own template and :func:`token_blocks`. Real engine: the model's tokenizer
    and chat template as :meth:`VllmEngine.render` applies them, cut into the engine's KV blocks and
    keyed as :mod:`zerolayer.engine_prefixes` keys vLLM's events (what the nodes tell the oracle)."""
    from zerolayer import prefix
    from zerolayer.runtime.engine.base import ChatMessage

    out = {}
    if args.engine == "vllm":
        from transformers import AutoTokenizer

        from zerolayer.engine_prefixes import token_keys

        if caches.block_size is None:
            raise RuntimeError("the nodes did not say their KV block size")
        tokenizer = AutoTokenizer.from_pretrained(args.model_path)
        for _, system, question in requests:
            body = {"system": system, "messages": [{"role": "user", "content": question}]}
            chat = [{"role": "system", "content": system}, {"role": "user", "content": question}]
            text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
            ids = tokenizer.encode(text, add_special_tokens=False)
            out[prefix.chat_block_hashes(prefix.chat_turns(body))] = [
                k.to_bytes(8, "big") for k in token_keys(ids, caches.block_size)]
        return out
    from zerolayer.runtime.engine.synthetic import SyntheticEngine

    engine = SyntheticEngine((MODEL,))
    for _, system, question in requests:
        body = {"system": system, "messages": [{"role": "user", "content": question}]}
        rendered = await engine.render(MODEL, [ChatMessage("system", system), ChatMessage("user", question)])
        out[prefix.chat_block_hashes(prefix.chat_turns(body))] = token_blocks(rendered.token_ids)
    return out


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(VOCAB) for _ in range(n))


VOCAB = ("invoice tenant refund ledger quota token cluster region billing account credit debit balance "
         "statement period usage model node stream priority deadline budget cost price tax discount "
         "contract renewal payment overdue reminder currency exchange rate audit report summary").split()


def workload(kind: str, n: int, *, groups: int, system_len: int, question_len: int, rate: float,
             seed: int) -> list[tuple[float, str, str]]:
    """``(arrival_s, system, question)``: inference-perf's shared_prefix shape, Poisson arrivals."""
    rng = random.Random(seed)
    systems = group_systems(groups, system_len, seed)
    out, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(rate)
        system = rng.choice(systems) if kind == "shared" else f"request {i}: " + words(rng, system_len)
        out.append((t, system, f"question {i}: " + words(rng, question_len)))
    return out


def group_systems(groups: int, system_len: int, seed: int) -> list[str]:
    """The shared system prompts of :func:`workload`'s groups."""
    return [f"group {g}: " + words(random.Random(seed * 1000 + g), system_len) for g in range(groups)]


@contextlib.contextmanager
def fleet(args: argparse.Namespace,
          workdir: pathlib.Path) -> Iterator[tuple[dict[str, str], list[pathlib.Path], "OracleCaches"]]:
    procs, files, stats = [], {}, []
    caches = OracleCaches()
    try:
        for i in range(args.nodes):
            name = f"node-{i}"
            status, stat = workdir / f"{name}.json", workdir / f"{name}.stats.json"
            for p in (status, stat):
                p.unlink(missing_ok=True)
            cmd = [sys.executable, __file__, "node", "--name", name, "--status-file", str(status),
                   "--stats-file", str(stat), "--prefill-ms-per-token", str(args.prefill_ms_per_token),
                   "--cache-blocks", str(args.cache_blocks), "--output-tokens", str(args.output_tokens),
                   "--decode-tps", str(args.decode_tps), "--engine", args.engine,
                   "--model-path", args.model_path, "--kv-cache-bytes", str(args.kv_cache_bytes),
                   "--max-model-len", str(args.max_model_len),
                   "--digest-blocks", str(args.digest_blocks), "--digest-seconds", str(args.digest_seconds),
                   "--prefix-digest", args.prefix_digest]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, start_new_session=True))
            files[name] = str(status)
            stats.append(stat)
        for name, proc in zip(files, procs):  # vLLM: ~20 s each on an idle CPU, minutes on a shared one
            line = "?"
            while line and not line.startswith("READY"):  # vLLM logs to stdout too
                line = proc.stdout.readline()  # type: ignore[union-attr]
            if not line:
                raise RuntimeError(f"a node exited before it was ready (rc {proc.wait()})")
            # keep reading (a chatty engine would fill the pipe and block): the oracle's cache changes
            threading.Thread(target=caches.follow, args=(name, proc.stdout), daemon=True).start()
        deadline = time.monotonic() + 10
        while not all(pathlib.Path(f).exists() for f in [*files.values(), *map(str, stats)]):
            if time.monotonic() > deadline:
                raise RuntimeError("a node published no status")
            time.sleep(0.05)
        yield files, stats, caches
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
            with contextlib.suppress(ProcessLookupError):  # its engine's processes (vLLM: 2 more)
                os.killpg(proc.pid, signal.SIGKILL)


async def drive(policy: str, files: dict[str, str], requests: list[tuple[float, str, str]],
                args: argparse.Namespace, caches: OracleCaches) -> dict[str, Any]:
    from zerolayer.client import AsyncClient

    node_map: Any = FileNodeMap(files, digests=policy == "precise", interval_s=args.map_seconds)
    prompts = await oracle_prompts(requests, args, caches) if policy == "oracle" else {}
    if policy == "oracle":
        node_map = OracleNodeMap(node_map, caches, prompts)
    clients = [AsyncClient(api_key=KEY, nodes=node_map, deadline=600.0, timeout=600.0, max_retries=2)
               for _ in range(args.clients)]
    for client in clients:
        client.router.policy = "prefix" if policy in ("precise", "oracle") else policy
        if policy == "oracle":
            client.router.sent = NoRecord()  # type: ignore[assignment]
    ttfts: list[float] = []
    errors: list[str] = []
    rng = random.Random(7)
    start = time.monotonic()
    finished: list[float] = []

    async def one(i: int, at: float, system: str, question: str) -> None:
        await asyncio.sleep(max(0.0, start + at - time.monotonic()))
        client = clients[rng.randrange(len(clients))].with_options(session=f"user-{i}")
        sent = time.monotonic()
        try:
            stream = await client.messages.create(model=MODEL, max_tokens=args.output_tokens, stream=True,
                                                  system=system, messages=[{"role": "user", "content": question}])
            first = None
            async for event in stream:
                if first is None and event.get("type") == "content_block_delta":
                    first = time.monotonic() - sent
            if first is not None:
                ttfts.append(first)
            finished.append(time.monotonic())
        except Exception as exc:  # counted and shown: a bench must not stop at one failure
            errors.append(type(exc).__name__)

    await asyncio.gather(*(one(i, *r) for i, r in enumerate(requests)))
    for client in clients:
        await client.close()
    node_map.close()
    span = (max(finished) - start) if finished else float("nan")
    # The oracle's check that it rendered each prompt as the nodes did: every prompt's last block was seen.
    unseen = sum(1 for blocks in prompts.values() if blocks and blocks[-1] not in caches.ever)
    return {"ttfts": ttfts, "errors": errors, "completed": len(finished), "span_s": span, "oracle_unseen": unseen}


def pct(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def read_stats(paths: Sequence[pathlib.Path]) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in paths]


def delta(after: list[dict[str, Any]], before: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    if before is None:
        return after
    return [{k: (a[k] - b[k] if isinstance(a[k], (int, float)) and k != "digest_blocks" else a[k]) for k in a}
            for a, b in zip(after, before)]


def run_bench(args: argparse.Namespace) -> None:
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="zl-prefix-bench-"))
    rows: list[dict[str, Any]] = []
    shared_fleet = fleet(args, workdir) if args.reuse_nodes else None
    kept = shared_fleet.__enter__() if shared_fleet is not None else None
    try:
        run_rows(args, workdir, rows, kept)
    finally:
        if shared_fleet is not None:
            shared_fleet.__exit__(None, None, None)
    table = render(rows, args)
    print()
    print(table)
    if args.save:
        import benchlib

        suffix = "_prefill" if args.vllm_prefill else "_kv_events" if args.prefix_digest == "kv_events" else ""
        benchlib.save(f"prefix_routing_{args.engine}{suffix}", f"$ {benchlib.bench_argv()}\n{table}\n", rows)


def run_rows(args: argparse.Namespace, workdir: pathlib.Path, rows: list[dict[str, Any]], kept: Any) -> None:
    if kept is not None and args.engine == "vllm":
        # Warm every engine (its first forward passes are slower) so the first row does not pay for it.
        warm = workload("unique", 2 * args.nodes, groups=1, system_len=args.system_len,
                        question_len=args.question_len, rate=args.nodes * 1.0, seed=999)
        asyncio.run(drive("round_robin", kept[0], warm, args, kept[2]))
    for kind, rate in (("shared", args.rate), ("unique", args.unique_rate)):
        if kind not in args.workloads:
            continue
        # The real engine's oracle reads vLLM's KV events, which its nodes subscribe to with kv_events only.
        wanted = [p for p in POLICIES if p in args.policies
                  and not (p == "oracle" and args.engine == "vllm" and args.prefix_digest != "kv_events")]
        for n, policy in enumerate(wanted):
            # Reused nodes: each policy gets prompts of its own (another seed), so no row is served
            # from a cache an earlier row filled.
            requests = workload(kind, args.requests, groups=args.groups, system_len=args.system_len,
                                question_len=args.question_len, rate=rate,
                                seed=args.seed + (100 * n if kept is not None else 0))
            if kept is not None:
                files, stat_files, caches = kept
                if kind == "shared" and args.warm_groups:
                    # Each group's first prefill, unmeasured: every policy pays it once per group, and
                    # with few requests per group it would be the P90 of every row (12 of 90 here).
                    systems = group_systems(args.groups, args.system_len, args.seed + 100 * n)
                    asyncio.run(drive(policy, files, [(0.5 * g, system, f"warm-up {g}: " + words(
                        random.Random(g), args.question_len)) for g, system in enumerate(systems)], args, caches))
                before = read_stats(stat_files)
                started = time.monotonic()
                result = asyncio.run(drive(policy, files, requests, args, caches))
                time.sleep(1.0)  # one more stats write
                nodes = delta(read_stats(stat_files), before)
            else:
                with fleet(args, workdir) as (files, stat_files, caches):
                    result = asyncio.run(drive(policy, files, requests, args, caches))
                nodes = read_stats(stat_files)
            prompt = sum(n["prompt_tokens"] for n in nodes)
            row = {
                "workload": kind, "policy": policy, "rate": rate,
                "p50_ttft_s": pct(result["ttfts"], 0.5), "p90_ttft_s": pct(result["ttfts"], 0.9),
                "throughput_rps": result["completed"] / result["span_s"] if result["completed"] else 0.0,
                "hit_rate": sum(n["hit_tokens"] for n in nodes) / prompt if prompt else 0.0,
                "errors": len(result["errors"]), "oracle_unseen": result["oracle_unseen"],
                "per_node": [n["requests"] for n in nodes],
                "patches_per_node_s": statistics.mean(n["patches"] / n["seconds"] for n in nodes),
                "patch_bytes": statistics.mean(n["patch_bytes"] / max(1, n["patches"]) for n in nodes),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)


def render(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    if args.engine == "vllm":
        engine = (f"{args.nodes} runtimes x real vLLM on CPU (random Llama, {args.model_layers} layers, hidden "
                  f"{args.model_hidden}, float32, {args.kv_cache_bytes // 2**20} MiB KV cache each, prefix caching on; "
                  f"nodes reused, fresh prompts per row; hit rate = vLLM's prefix_cache_hits / queries; "
                  f"digest: {args.prefix_digest})")
    else:
        engine = (f"{args.nodes} runtimes x synthetic engine with a prefill model ({args.prefill_ms_per_token} ms/uncached "
                  f"token, serial prefill, {args.cache_blocks} x {BLOCK_TOKENS}-token LRU prefix cache per node, "
                  f"{args.output_tokens} tokens out at {args.decode_tps:g} tok/s)")
    lines = [
        f"{engine}; SDK AsyncClient x{args.clients}, a session per request",
        f"shared: inference-perf shared_prefix shape, {args.groups} groups x {args.system_len}-word system prompt + "
        f"{args.question_len}-word question, Poisson {args.rate:g} req/s; unique: no shared prefix, "
        f"Poisson {args.unique_rate:g} req/s; {args.requests} requests each"
        + ("; shared rows after one unmeasured request per group" if args.warm_groups and args.reuse_nodes else ""),
        "",
        f"{'workload':9} {'policy':12} {'P50 TTFT':>9} {'P90 TTFT':>9} {'req/s':>6} {'hit':>5} "
        f"{'P50 vs RR':>9} {'P90 vs RR':>9} {'tput vs RR':>10} {'err':>4}  per node   patches/s/node",
    ]
    base = {r["workload"]: r for r in rows if r["policy"] == "round_robin"}
    for r in rows:
        b = base.get(r["workload"], r)  # without a round-robin row (--policies), the ratios are 1
        lines.append(
            f"{r['workload']:9} {r['policy']:12} {r['p50_ttft_s']:8.3f}s {r['p90_ttft_s']:8.3f}s "
            f"{r['throughput_rps']:6.2f} {r['hit_rate']:5.0%} {b['p50_ttft_s'] / r['p50_ttft_s']:8.1f}x "
            f"{b['p90_ttft_s'] / r['p90_ttft_s']:8.1f}x {r['throughput_rps'] / b['throughput_rps']:9.2f}x "
            f"{r['errors']:4d}  {'/'.join(map(str, r['per_node'])):10} {r['patches_per_node_s']:.2f} "
            f"({r['patch_bytes']:.0f} B)")
    lines.append("(vs RR: round-robin's TTFT / this row's, so >1 is better; throughput: this row / round-robin)")
    lines.extend(_versus_oracle(rows))
    return "\n".join(lines)


def _versus_oracle(rows: list[dict[str, Any]]) -> list[str]:
    """Precise mode against the oracle, per workload: the oracle's TTFT / precise's (1 = as good)."""
    out = []
    by = {(r["workload"], r["policy"]): r for r in rows}
    for kind in dict.fromkeys(r["workload"] for r in rows):
        precise, oracle = by.get((kind, "precise")), by.get((kind, "oracle"))
        if precise and oracle:
            out.append(f"{kind}: precise vs oracle: P50 TTFT {oracle['p50_ttft_s'] / precise['p50_ttft_s']:.2f}x, "
                       f"P90 {oracle['p90_ttft_s'] / precise['p90_ttft_s']:.2f}x, hit {precise['hit_rate']:.0%} "
                       f"vs {oracle['hit_rate']:.0%}, throughput {precise['throughput_rps'] / oracle['throughput_rps']:.2f}x"
                       f" (oracle prompts not seen at a node: {oracle['oracle_unseen']})")
    return out


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", nargs="?", default="bench", choices=("bench", "node"))
    parser.add_argument("--quick", action="store_true", help="fewer requests (a smoke run)")
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--clients", type=int, default=4, help="independent SDK client instances")
    parser.add_argument("--requests", type=int, default=480)
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--system-len", type=int, default=1500, help="shared system prompt, words (= tokens here)")
    parser.add_argument("--question-len", type=int, default=30)
    parser.add_argument("--output-tokens", type=int, default=8)
    parser.add_argument("--rate", type=float, default=14.0, help="shared-prefix arrivals, req/s")
    parser.add_argument("--unique-rate", type=float, default=5.0, help="no-shared-prefix arrivals, req/s")
    parser.add_argument("--prefill-ms-per-token", type=float, default=0.2)
    parser.add_argument("--cache-blocks", type=int, default=600, help="prefix-cache blocks per node")
    parser.add_argument("--decode-tps", type=float, default=200.0)
    parser.add_argument("--digest-blocks", type=int, default=0,
                        help="a fixed record of served blocks per node, not sized to the cache (0: the runtime's "
                             "default: at most 512, no more than the engine's cache holds)")
    parser.add_argument("--prefix-digest", choices=("served", "kv_events"), default="served",
                        help="the vLLM nodes' digest source (engine.prefix_digest; docs/routing.md): the chats "
                             "they served, or what vLLM's KV cache events say they hold")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--engine", choices=("synthetic", "vllm"), default="synthetic",
                        help="vllm: the real engine on CPU (--vllm-small sets a workload that fits this machine)")
    parser.add_argument("--vllm-small", action="store_true",
                        help="the real-vLLM run's shape: 6 groups x 150 words, 36 requests at 1.2 req/s, nodes reused")
    parser.add_argument("--vllm-prefill", action="store_true",
                        help="the real-vLLM run where prefill dominates TTFT: 8 layers x hidden 512, 12 groups x "
                             "300 words (~830 tokens), 160 MiB KV cache per node (5,120 tokens: about 5 groups' "
                             "prompts), 90 requests at 1 req/s (unique: 0.45), precise and oracle from KV events")
    parser.add_argument("--model-path", help="the random model's folder (default: /tmp/zl/prefix-model-<layers>x<hidden>, "
                                             "generated when missing)")
    parser.add_argument("--model-layers", type=int, default=6)
    parser.add_argument("--model-hidden", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--kv-cache-bytes", type=int, default=16 * 2**20)
    parser.add_argument("--reuse-nodes", action="store_true", help="start the nodes once for every row")
    parser.add_argument("--warm-groups", action="store_true",
                        help="with --reuse-nodes: before each shared row, one unmeasured request per group (its "
                             "first prefill, which every policy pays once)")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--workloads", default="shared,unique")
    parser.add_argument("--digest-seconds", type=float, default=2.0,
                        help="the nodes' spec.gossip.prefixDigestSeconds (the runtime's default: 2)")
    parser.add_argument("--map-seconds", type=float, default=0.5, help="how often the SDK's map re-reads the gossip")
    parser.add_argument("--save", action="store_true", help="write bench/results/prefix_routing_<engine>.{txt,json}")
    parser.add_argument("--name", default="node")
    parser.add_argument("--status-file")
    parser.add_argument("--stats-file")
    args = parser.parse_args(argv)
    if args.quick:
        args.requests = 160
    if args.vllm_small:
        args.engine, args.reuse_nodes = "vllm", True
        args.groups, args.system_len, args.question_len, args.requests = 6, 150, 10, 36
        args.rate, args.unique_rate = 1.2, 0.8
    if args.vllm_prefill:
        args.engine, args.reuse_nodes, args.prefix_digest = "vllm", True, "kv_events"
        args.model_layers, args.model_hidden, args.max_model_len = 8, 512, 2048
        args.groups, args.system_len, args.question_len, args.requests = 12, 300, 20, 90
        args.rate, args.unique_rate = 1.0, 0.45
        args.kv_cache_bytes, args.warm_groups = 160 * 2**20, True
    if args.prefix_digest == "kv_events" and (args.engine != "vllm" or args.digest_blocks):
        parser.error("--prefix-digest kv_events needs the vllm engine (--engine vllm or --vllm-small) and no "
                     "--digest-blocks")
    args.policies = tuple(args.policies.split(","))
    args.workloads = tuple(args.workloads.split(","))
    if args.model_path is None:
        args.model_path = f"/tmp/zl/prefix-model-{args.model_layers}x{args.model_hidden}"
    if args.engine == "vllm" and not pathlib.Path(args.model_path, "config.json").exists():
        from zerolayer.runtime.node.tinymodel import generate

        # 6 x 256: ~5M parameters, 18 MB; 8 x 512: ~18M, 70 MB (heads of 32 or 64, vLLM CPU's minimum is 32)
        generate(args.model_path, layers=args.model_layers, hidden=args.model_hidden,
                 heads=max(8, args.model_hidden // 64), max_positions=max(2048, args.max_model_len))
    return args


if __name__ == "__main__":
    ARGS = parse()
    if ARGS.mode == "node":
        run_node(ARGS)
    else:
        run_bench(ARGS)
