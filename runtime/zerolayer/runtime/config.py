"""Standalone configuration: one YAML file describes a whole node (docs/runtime.md).

``load_config(path)`` validates the file into :class:`RuntimeConfig`; ``build_server``
turns that into a :class:`~zerolayer.runtime.serving.server.RuntimeServer` with its engine,
micro-scheduler, tenants and GPU source. Every error names the offending key.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import pathlib
from typing import Any, Mapping, Sequence

import yaml

from zerolayer.contract import Priority
from zerolayer.runtime.errors import ConfigError
from zerolayer.runtime.limits import Limits
from zerolayer.runtime.scheduler.api import TenantPolicy
from zerolayer.runtime.tenants import Tenant, key_hash

log = logging.getLogger(__name__)

ENGINE_KINDS = ("synthetic", "vllm")
GPU_SOURCES = ("none", "auto", "cpu", "simulated", "nvml")


@dataclasses.dataclass(frozen=True)
class RuntimeConfig:
    host: str
    port: int
    tls_cert: str | None
    tls_key: str | None
    engine: Mapping[str, Any]  # with several models, the first of ``engines``
    tenants: tuple[Tenant, ...]
    scheduler: Mapping[str, Any]
    gpu: Mapping[str, Any]
    limits: Limits
    sample_interval_s: float
    base_dir: pathlib.Path
    required_headers: tuple[str, ...] = ()
    reuse_port: bool = False  # listen.reuse_port: SO_REUSEPORT, several processes on one port
    engines: tuple[Mapping[str, Any], ...] = ()  # ``engines:``: one engine per base model (else ``engine`` alone)
    tracing: "TracingSettings | None" = None  # telemetry.tracing: OpenTelemetry spans over OTLP; None: off
    server_core: str = "python"  # server.core: the protocol cores, "python" (h2conn, h1conn) or "native" (Rust h2, llhttp)
    api_processes: int = 1  # server.api_processes: processes serving the port, sharing one engine core and one quota board
    connection_balance: str = "exact"  # server.connection_balance: how API processes share connections (serving/handoff.py)
    # server.max_connection_age_s / _grace_s: a connection older than the age (+-10 %) is drained, and
    # closed once the grace has passed too (serving/transport.py ConnectionAge); None: never / limits.drain_timeout_s.
    max_connection_age_s: float | None = None
    max_connection_age_grace_s: float | None = None


@dataclasses.dataclass(frozen=True)
class TracingSettings:
    """``telemetry.tracing`` (docs/observability.md, "Traces")."""

    otlp_endpoint: str  # OTLP/HTTP traces URL, e.g. http://otel-collector.monitoring:4318/v1/traces
    service_name: str = "zerolayer-runtime"


def parse_tracing(data: Any) -> TracingSettings | None:
    """``telemetry.tracing`` or None (off: no key, or no ``otlp_endpoint``)."""
    tracing = _mapping(data, "telemetry.tracing")
    unknown = sorted(set(tracing) - {"otlp_endpoint", "service_name"})
    if unknown:
        raise ConfigError(f"telemetry.tracing: unknown keys {', '.join(unknown)} (known: otlp_endpoint, service_name)")
    endpoint = tracing.get("otlp_endpoint")
    if endpoint is None:
        return None
    if not isinstance(endpoint, str) or not endpoint.startswith(("http://", "https://")):
        raise ConfigError(f"telemetry.tracing.otlp_endpoint: an http(s) URL, got {endpoint!r}")
    name = tracing.get("service_name", "zerolayer-runtime")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"telemetry.tracing.service_name: a non-empty string, got {name!r}")
    return TracingSettings(endpoint, name)


def _mapping(data: Any, where: str) -> dict[str, Any]:
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(data).__name__}")
    return data


def _opt_int(data: Mapping[str, Any], key: str, where: str) -> int | None:
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{where}.{key}: expected a non-negative integer, got {value!r}")
    return value


def parse_tenant(data: Any, index: int, environ: Mapping[str, str]) -> Tenant:
    where = f"tenants[{index}]"
    data = _mapping(data, where)
    name = data.get("name")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{where}.name: required")
    hashes: set[str] = set()
    for j, key in enumerate(data.get("keys") or []):
        kw = f"{where}.keys[{j}]"
        key = _mapping(key, kw)
        if "sha256" in key:
            digest = str(key["sha256"]).lower()
            if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
                raise ConfigError(f"{kw}.sha256: expected 64 hex digits")
            hashes.add(digest)
        elif "env" in key:
            value = environ.get(str(key["env"]))
            if not value and key.get("optional"):
                continue
            if not value:
                raise ConfigError(f"{kw}.env: environment variable {key['env']} is not set")
            hashes.add(key_hash(value))
        else:
            raise ConfigError(f"{kw}: give sha256 (hex digest of the key) or env (a variable holding the key)")
    if not hashes:
        raise ConfigError(f"{where}.keys: a tenant needs at least one key")
    try:
        priorities = frozenset(Priority.parse(p) for p in data.get("priorities") or ["high", "normal", "low"])
    except ValueError as exc:
        raise ConfigError(f"{where}.priorities: {exc}") from exc
    models = data.get("models")
    policy = TenantPolicy(
        tenant=name,
        tokens_per_minute=_opt_int(data, "tokens_per_minute", where),
        requests_per_minute=_opt_int(data, "requests_per_minute", where),
        max_concurrent_streams=_opt_int(data, "max_concurrent_streams", where),
        allowed_priorities=priorities,
        allowed_models=frozenset(str(m) for m in models) if models else None,
    )
    return Tenant(name, frozenset(hashes), policy)


def parse_config(data: Any, base_dir: pathlib.Path, environ: Mapping[str, str] | None = None) -> RuntimeConfig:
    environ = os.environ if environ is None else environ
    data = _mapping(data, "config")
    known = {"listen", "tls", "engine", "engines", "tenants", "scheduler", "gpu", "limits", "telemetry", "headers",
             "server"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"unknown top-level keys: {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    listen = _mapping(data.get("listen"), "listen")
    port = listen.get("port", 8080)
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < 65536:
        raise ConfigError(f"listen.port: expected 0..65535, got {port!r}")
    reuse_port = listen.get("reuse_port", False)
    if not isinstance(reuse_port, bool):
        raise ConfigError(f"listen.reuse_port: expected true or false, got {reuse_port!r}")
    tls = _mapping(data.get("tls"), "tls")
    if tls and not (tls.get("cert") and tls.get("key")):
        raise ConfigError("tls: give both cert and key")
    engines = parse_engines(data)
    tenants_raw = data.get("tenants") or []
    if not isinstance(tenants_raw, list):
        raise ConfigError("tenants: expected a list")
    tenants = tuple(parse_tenant(t, i, environ) for i, t in enumerate(tenants_raw))
    names = [t.name for t in tenants]
    if len(set(names)) != len(names):
        raise ConfigError("tenants: names must be unique")
    gpu = _mapping(data.get("gpu"), "gpu") or {"source": "none"}
    if gpu.get("source", "none") not in GPU_SOURCES:
        raise ConfigError(f"gpu.source: one of {', '.join(GPU_SOURCES)}, got {gpu.get('source')!r}")
    from zerolayer.runtime.serving.headers import REQUIRABLE

    required = _mapping(data.get("headers"), "headers").get("required") or []
    if not isinstance(required, list) or any(r not in REQUIRABLE for r in required):
        raise ConfigError(f"headers.required: a list of {', '.join(REQUIRABLE)}, got {required!r}")
    telemetry = _mapping(data.get("telemetry"), "telemetry")
    interval_ms = telemetry.get("sample_interval_ms", 200)
    if not isinstance(interval_ms, (int, float)) or interval_ms <= 0:
        raise ConfigError("telemetry.sample_interval_ms: expected a positive number")
    server = _mapping(data.get("server"), "server")
    return RuntimeConfig(
        host=str(listen.get("host", "127.0.0.1")),
        port=port,
        tls_cert=tls.get("cert"),
        tls_key=tls.get("key"),
        engine=engines[0],
        engines=engines if "engines" in data else (),
        tenants=tenants,
        scheduler=_mapping(data.get("scheduler"), "scheduler"),
        gpu=gpu,
        limits=Limits.from_mapping(_mapping(data.get("limits"), "limits")),
        sample_interval_s=float(interval_ms) / 1000.0,
        base_dir=base_dir,
        required_headers=tuple(required),
        reuse_port=reuse_port,
        tracing=parse_tracing(telemetry.get("tracing")),
        server_core=parse_server_core(server),  # first: it refuses unknown server keys
        api_processes=parse_api_processes(server),
        connection_balance=parse_connection_balance(server),
        **parse_connection_age(server),
    )


SERVER_CORES = ("python", "native")
SERVER_KEYS = ("core", "api_processes", "connection_balance", "max_connection_age_s", "max_connection_age_grace_s")


def native_core_available() -> bool:
    """Whether the compiled cores' extension (``zerolayer_h2core``, native/h2core) is installed."""
    try:
        import zerolayer_h2core  # noqa: F401
    except ImportError:
        return False
    return True


def parse_server_core(server: Mapping[str, Any]) -> str:
    """``server.core``: which HTTP/2 core serves h2 connections (docs/server-core.md, "The native core")."""
    unknown = sorted(set(server) - set(SERVER_KEYS))
    if unknown:
        raise ConfigError(f"server: unknown keys {', '.join(unknown)} (known: {', '.join(SERVER_KEYS)})")
    if "core" not in server:
        return "native" if native_core_available() else "python"
    core = server["core"]
    if core not in SERVER_CORES:
        raise ConfigError(f"server.core: one of {', '.join(SERVER_CORES)}, got {core!r}")
    if core == "native" and not native_core_available():
        raise ConfigError("server.core: native needs the compiled core: run `python3 -m pip install ./native/h2core`")
    return core


MAX_API_PROCESSES = 64


def parse_api_processes(server: Mapping[str, Any]) -> int:
    """``server.api_processes``: how many API processes serve the port (docs/api-processes.md), 1 by
    default. They share one vLLM engine core per engine (per base model with ``engines:``)."""
    count = server.get("api_processes", 1)
    if not isinstance(count, int) or isinstance(count, bool) or not 1 <= count <= MAX_API_PROCESSES:
        raise ConfigError(f"server.api_processes: an integer from 1 to {MAX_API_PROCESSES}, got {count!r}")
    return count


def parse_connection_balance(server: Mapping[str, Any]) -> str:
    """``server.connection_balance``: how API processes share the port's connections (docs/api-processes.md):
    ``exact`` (the parent accepts and hands each to the process with the fewest open ones) or ``kernel``
    (SO_REUSEPORT's hash). One API process takes every connection either way."""
    from zerolayer.runtime.serving.handoff import BALANCES

    balance = server.get("connection_balance", "exact")
    if balance not in BALANCES:
        raise ConfigError(f"server.connection_balance: one of {', '.join(BALANCES)}, got {balance!r}")
    return str(balance)


def parse_connection_age(server: Mapping[str, Any]) -> dict[str, float | None]:
    """``server.max_connection_age_s`` (> 0; unset or null: connections are never aged) and
    ``server.max_connection_age_grace_s`` (>= 0; unset or null: ``limits.drain_timeout_s``), docs/runtime.md."""
    return {"max_connection_age_s": parse_seconds(server, "max_connection_age_s"),
            "max_connection_age_grace_s": parse_seconds(server, "max_connection_age_grace_s", zero=True)}


def parse_seconds(server: Mapping[str, Any], key: str, *, zero: bool = False) -> float | None:
    """``server.<key>``, a finite number of seconds, > 0 (with ``zero``: >= 0); None when unset or null."""
    value = server.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < 0 or (value == 0 and not zero):
        floor = ">= 0" if zero else "> 0"
        raise ConfigError(f"server.{key}: a number of seconds {floor}, got {value!r}")
    return float(value)


def parse_engines(data: Mapping[str, Any]) -> tuple[dict[str, Any], ...]:
    """``engine:`` (one engine) or ``engines:`` (one per base model), each checked as it would start:
    kinds, keys, vLLM settings, that no model name is served twice and no GPU is given to two."""
    if "engine" in data and "engines" in data:
        raise ConfigError("give engine (one model) or engines (several), not both")
    if "engines" in data:
        raw = data["engines"]
        if not isinstance(raw, list) or not raw:
            raise ConfigError("engines: expected a non-empty list of engine mappings")
        specs = [(_mapping(e, f"engines[{i}]"), f"engines[{i}]") for i, e in enumerate(raw)]
    else:
        specs = [(_mapping(data.get("engine"), "engine") or {"kind": "synthetic"}, "engine")]
    served: dict[str, str] = {}
    gpus: dict[int, list[tuple[str, Mapping[str, Any]]]] = {}
    for spec, where in specs:
        kind = spec.get("kind", "synthetic")
        if kind not in ENGINE_KINDS:
            raise ConfigError(f"{where}.kind: one of {', '.join(ENGINE_KINDS)}, got {spec.get('kind')!r}")
        prefix_digest(spec, where)
        if kind == "vllm":
            if not spec.get("model_path"):
                raise ConfigError(f"{where}.model_path: required for the vllm engine")
            vllm_settings(spec, where)  # refuse bad engine settings when the file is loaded, not at engine start
            names = [str(spec.get("served_name") or pathlib.Path(str(spec["model_path"])).name)]
            names += [a.name for a in lora_adapters(spec, where)]
            for device in engine_gpus(spec, where) or ():
                gpus.setdefault(device, []).append((where, spec))
        else:
            names = [str(m) for m in spec.get("models") or ("synthetic",)]
        for name in names:
            if name in served:
                raise ConfigError(f"{where}: model {name!r} is also served by {served[name]}")
            served[name] = where
    for device, sharing in sorted(gpus.items()):
        _check_sharing(device, sharing)
    return tuple(dict(spec) for spec, _ in specs)


def _check_sharing(device: int, sharing: list[tuple[str, Mapping[str, Any]]]) -> None:
    """Engines on one GPU must each be given a part of its memory, and the parts must fit: vLLM's
    default fraction (0.9) for each would ask for more than the device has."""
    if len(sharing) < 2:
        return
    fractions = 0.0
    for where, spec in sharing:
        if spec.get("gpu_memory_utilization") is None and spec.get("kv_cache_memory_bytes") is None:
            others = ", ".join(w for w, _ in sharing if w != where)
            raise ConfigError(f"{where}: shares GPU {device} with {others}; give each engine on it "
                              "gpu_memory_utilization (their sum at most 1) or kv_cache_memory_bytes")
        fractions += float(spec.get("gpu_memory_utilization") or 0.0)
    if fractions > 1.0:
        raise ConfigError(f"engines on GPU {device} ask for gpu_memory_utilization {fractions:g} in all; "
                          "at most 1")


def lora_adapters(spec: Mapping[str, Any], where: str):  # type: ignore[no-untyped-def]
    """``loras:`` of a vllm engine: a list of ``{name, path}``, each served under its own name."""
    from zerolayer.runtime.engine.lora import LoraAdapter

    raw = spec.get("loras") or []
    if not isinstance(raw, list):
        raise ConfigError(f"{where}.loras: expected a list of {{name, path}}")
    out = []
    for i, item in enumerate(raw):
        item = _mapping(item, f"{where}.loras[{i}]")
        unknown = sorted(set(item) - {"name", "path"})
        if unknown or not isinstance(item.get("name"), str) or not item["name"] or not item.get("path"):
            raise ConfigError(f"{where}.loras[{i}]: give name and path (a PEFT adapter folder), nothing else")
        out.append(LoraAdapter(item["name"], str(pathlib.Path(str(item["path"])))))
    return tuple(out)


def engine_gpus(spec: Mapping[str, Any], where: str) -> tuple[int, ...] | None:
    """``gpus:`` of a vllm engine: the device indices its processes see (None: all of the node's)."""
    raw = spec.get("gpus")
    if raw is None:
        return None
    if (not isinstance(raw, list) or not raw or len(set(raw)) != len(raw)
            or any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in raw)):
        raise ConfigError(f"{where}.gpus: expected a non-empty list of distinct GPU indices, got {raw!r}")
    return tuple(raw)


def load_mapping(path: str | pathlib.Path) -> dict[str, Any]:
    path = pathlib.Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"config {path} is not valid YAML: {exc}") from exc
    return _mapping(data, str(path))


def load_config(path: str | pathlib.Path, environ: Mapping[str, str] | None = None) -> RuntimeConfig:
    return parse_config(load_mapping(path), pathlib.Path(path).resolve().parent, environ)


def _resolve(config: RuntimeConfig, value: str) -> str:
    """Relative paths in the file are relative to the working directory, like the CLI's own."""
    return str(pathlib.Path(value))


# The vllm engine's typed settings: key -> (check, what it must be). Defaults are VllmSettings's (GPU).
def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


VLLM_DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")
_VLLM_TYPED: dict[str, tuple[Any, str]] = {
    "max_model_len": (_positive_int, "a positive integer"),
    "max_num_seqs": (_positive_int, "a positive integer"),
    "max_num_batched_tokens": (_positive_int, "a positive integer"),
    "kv_cache_memory_bytes": (_positive_int, "a positive integer (bytes)"),
    "gpu_memory_utilization": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= 1,
                               "a number in (0, 1]"),
    "dtype": (lambda v: v in VLLM_DTYPES, f"one of {', '.join(VLLM_DTYPES)}"),
    "enforce_eager": (lambda v: isinstance(v, bool), "true or false"),
    "tensor_parallel_size": (_positive_int, "a positive integer"),
    "quantization": (lambda v: isinstance(v, str) and bool(v), "a vLLM quantization method name"),
    "enable_prefix_caching": (lambda v: isinstance(v, bool), "true or false"),
}
VLLM_KEYS = frozenset(_VLLM_TYPED) | {"model_path", "served_name", "generate_tiny_model", "engine_args",
                                      "tool_parser", "loras", "gpus", "prefix_digest"}
PREFIX_DIGESTS = ("served", "kv_events")


def prefix_digest(spec: Mapping[str, Any], where: str) -> str:
    """``prefix_digest``: where the gossiped prefix-cache digest comes from (docs/routing.md, "Precise
    mode"). ``served`` (default): the chats the runtime rendered; ``kv_events``: vLLM's KV cache events,
    so only the vllm engine, with prefix caching on, and not with its own ``kv_events_config``."""
    value = spec.get("prefix_digest", "served")
    if value not in PREFIX_DIGESTS:
        raise ConfigError(f"{where}.prefix_digest: one of {', '.join(PREFIX_DIGESTS)}, got {value!r}")
    if value == "kv_events":
        if spec.get("kind", "synthetic") != "vllm":
            raise ConfigError(f"{where}.prefix_digest: kv_events needs the vllm engine (vLLM's KV cache events); "
                              f"the {spec.get('kind', 'synthetic')} engine has none: use served")
        if spec.get("enable_prefix_caching") is False:
            raise ConfigError(f"{where}.prefix_digest: kv_events needs enable_prefix_caching (vLLM reports "
                              "cached blocks only with its prefix cache on)")
        passed = spec.get("engine_args")
        if isinstance(passed, Mapping) and "kv_events_config" in passed:
            raise ConfigError(f"{where}.engine_args kv_events_config: prefix_digest kv_events sets it (vLLM "
                              "publishes to one endpoint); set one or the other")
    return str(value)


def vllm_settings(spec: Mapping[str, Any], where: str = "engine"):  # type: ignore[no-untyped-def]
    """The vllm engine's settings from the ``engine:`` mapping; a ConfigError names the first bad key.

    Unknown keys, typed values of the wrong kind, ``engine_args`` names vLLM does not take (with
    the closest one it does), names zerolayer sets itself, and a name also set as a typed key
    are all refused here, before anything starts.
    """
    from zerolayer import engine_args as passthrough
    from zerolayer.runtime.engine.vllm_engine import VllmSettings

    unknown = sorted(set(spec) - VLLM_KEYS - {"kind"})
    if unknown:
        raise ConfigError(f"{where}: unknown keys for the vllm engine: {', '.join(unknown)} "
                          f"(known: {', '.join(sorted(VLLM_KEYS))})")
    typed: dict[str, Any] = {}
    for key, (ok, what) in _VLLM_TYPED.items():
        value = spec.get(key)
        if value is None:
            continue
        if not ok(value):
            raise ConfigError(f"{where}.{key}: expected {what}, got {value!r}")
        typed[key] = value
    if "kv_cache_memory_bytes" in typed and "gpu_memory_utilization" in typed:
        raise ConfigError(f"{where}: set kv_cache_memory_bytes or gpu_memory_utilization, not both (a fixed "
                          "KV-cache size makes vLLM ignore the memory fraction)")
    extra = spec.get("engine_args")
    problems = passthrough.problems(extra, f"{where}.engine_args", {k: f"{where}.{k}" for k in typed})
    parser = passthrough.tool_parser_problem(spec.get("tool_parser"), f"{where}.tool_parser")
    if parser:
        problems.append(parser)
    if problems:
        raise ConfigError("; ".join(problems))
    devices = engine_gpus(spec, where)
    if devices and "tensor_parallel_size" not in typed and "tensor_parallel_size" not in (extra or {}):
        typed["tensor_parallel_size"] = len(devices)  # the engine spans its GPUs unless told otherwise
    return VllmSettings(**typed, engine_args=dict(extra or {}))


def build_engine(config: RuntimeConfig, core_clients: Sequence[Any] = ()):  # type: ignore[no-untyped-def]
    """The engine ``engine:`` describes, or for ``engines:`` a :class:`ModelRouter` over one engine each.
    ``core_clients``: in one of several API processes, its client of each engine's shared vLLM engine
    core (``engine/shared_core.py``), in the engines' order; None (or nothing) for an engine with none."""
    specs = list(config.engines) or [config.engine]
    clients = list(core_clients) or [None] * len(specs)
    if len(clients) != len(specs):
        raise ConfigError(f"{len(clients)} engine core clients for {len(specs)} engines")
    if not config.engines:
        return _build_one(config, config.engine, "engine", clients[0])
    from zerolayer.runtime.engine.router import ModelRouter

    return ModelRouter([_build_one(config, spec, f"engines[{i}]", client)
                        for i, (spec, client) in enumerate(zip(specs, clients))])


def _build_one(config: RuntimeConfig, engine: Mapping[str, Any], where: str,  # type: ignore[no-untyped-def]
               core_client: Any = None):
    spec = dict(engine)
    kind = spec.pop("kind", "synthetic")
    digest = prefix_digest({**spec, "kind": kind}, where)  # checked at load too; a config may be built in code
    if kind == "synthetic":
        from zerolayer.runtime.engine.synthetic import SyntheticEngine

        allowed = {"models", "output_tokens", "ttft_ms", "tokens_per_second", "kv_capacity_tokens", "prefix_digest"}
        unknown = sorted(set(spec) - allowed)
        if unknown:
            raise ConfigError(f"{where}: unknown keys for the synthetic engine: {', '.join(unknown)}")
        return SyntheticEngine(
            tuple(spec.get("models") or ("synthetic",)),
            output_tokens=int(spec.get("output_tokens", 16)),
            ttft_s=float(spec.get("ttft_ms", 0)) / 1000.0,
            tokens_per_second=spec.get("tokens_per_second"),
            kv_capacity_tokens=int(spec.get("kv_capacity_tokens", 65536)),
        )
    from zerolayer.runtime.engine.vllm_engine import VllmEngine

    model_path = _resolve(config, str(spec["model_path"]))
    settings = vllm_settings(spec, where)
    if config.tracing is not None:  # vLLM's own request spans go where ours go (docs/observability.md)
        settings = dataclasses.replace(settings, otlp_traces_endpoint=config.tracing.otlp_endpoint)
    if spec.get("generate_tiny_model"):
        from zerolayer.runtime.node import tinymodel

        tinymodel.generate(model_path)
    return VllmEngine(model_path, served_name=spec.get("served_name"), settings=settings,
                      tool_parser=spec.get("tool_parser"), loras=lora_adapters(spec, where),
                      devices=engine_gpus(spec, where), prefix_digest=digest, core_client=core_client)


def build_gpu_source(config: RuntimeConfig, engine, *,  # type: ignore[no-untyped-def]
                     environ: Mapping[str, str] | None = None, loadable=None):
    """The GPU source the ``gpu:`` section names. ``auto`` (what in-cluster runtimes get) is NVML
    when this process has NVIDIA GPUs, else the CPU source (:mod:`zerolayer.runtime.gpu.select`);
    an ``auto`` NVML that fails to start falls back to the CPU source with a warning, a configured
    ``nvml`` fails. ``environ`` and ``loadable`` replace the process's own for tests."""
    spec = dict(config.gpu)
    source = spec.get("source", "none")
    if source == "none":
        return None
    if source == "auto":
        from zerolayer.runtime.gpu.select import choose_source, nvml_loadable

        source, why = choose_source(os.environ if environ is None else environ, loadable or nvml_loadable)
        log.info("GPU source: %s (%s)", source, why)
        if source == "nvml":
            from zerolayer.runtime.gpu.api import GpuSourceError

            try:
                return _nvml_source(spec)
            except GpuSourceError as exc:
                log.warning("GPU source: NVML did not start (%s); reading the CPU source instead", exc)
                source = "cpu"
    if source == "cpu":
        from zerolayer.runtime.gpu.cpu import CpuSource

        return CpuSource(lambda: engine.stats().kv_cache_usage, kv_cache_bytes=spec.get("kv_cache_bytes"))
    if source == "simulated":
        from zerolayer.runtime.gpu.simulated import SimulatedGpuSource

        if "scenario" in spec:
            return SimulatedGpuSource.from_yaml(_resolve(config, str(spec["scenario"])))
        return SimulatedGpuSource.constant(float(spec.get("memory", 0.5)))
    return _nvml_source(spec)


def _nvml_source(spec: Mapping[str, Any]):  # type: ignore[no-untyped-def]
    from zerolayer.runtime.gpu.nvml import NvmlSource

    return NvmlSource(spec.get("indices"))


def build_server(config: RuntimeConfig, *, port: int | None = None,  # type: ignore[no-untyped-def]
                 metrics_on_serving_port: bool = True):
    """The server ``config`` describes (built by the composition root, :mod:`zerolayer.runtime.compose`)."""
    from zerolayer.runtime.compose import build_server as compose_server

    return compose_server(config, port=port, metrics_on_serving_port=metrics_on_serving_port)