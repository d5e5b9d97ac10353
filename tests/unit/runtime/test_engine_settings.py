"""vLLM engine settings: GPU defaults, typed knobs, the engine_args pass-through and its checks,
from the standalone file and from an InferenceNode. Nothing here starts vLLM."""

from __future__ import annotations

import dataclasses
import pathlib
import subprocess
import sys

import pytest

from zerolayer import engine_args, vllm_args
from zerolayer.runtime.config import VLLM_KEYS, build_engine, load_mapping, parse_config, vllm_settings
from zerolayer.runtime.engine.base import SamplingOptions
from zerolayer.runtime.engine.vllm_engine import VllmEngine, VllmSettings, trace_headers
from zerolayer.runtime.errors import ConfigError
from zerolayer.runtime.node.incluster import config_from_inferencenode

REPO = pathlib.Path(__file__).resolve().parents[3]
MODEL = {"name": "m", "source": {"path": "/models/m"}}


def args(**settings):  # type: ignore[no-untyped-def]
    return VllmSettings(**settings).vllm_args("/models/m", "m")


def test_defaults_target_a_gpu():
    got = args()
    assert got == {"model": "/models/m", "served_model_name": "m", "dtype": "auto", "enforce_eager": False,
                   "tensor_parallel_size": 1, "scheduling_policy": "priority", "gpu_memory_utilization": 0.9}
    # max_model_len, max_num_seqs, the KV-cache size... are vLLM's (the model's limit, the GPU's memory)
    assert not {"max_model_len", "max_num_seqs", "kv_cache_memory_bytes"} & got.keys()


def test_a_fixed_kv_cache_replaces_the_memory_fraction():
    got = args(kv_cache_memory_bytes=64 << 20)
    assert got["kv_cache_memory_bytes"] == 64 << 20 and "gpu_memory_utilization" not in got
    assert args(gpu_memory_utilization=0.5)["gpu_memory_utilization"] == 0.5
    with pytest.raises(ConfigError, match="set one"):
        VllmSettings(kv_cache_memory_bytes=1 << 26, gpu_memory_utilization=0.5)


def test_typed_knobs_and_passthrough_reach_vllm():
    got = args(quantization="awq", max_num_seqs=4, enable_prefix_caching=False, max_num_batched_tokens=512,
               tensor_parallel_size=2, enforce_eager=True, dtype="bfloat16", max_model_len=1024,
               engine_args={"block_size": 32, "kv_cache_memory_bytes": 1 << 26})
    assert {k: got[k] for k in ("quantization", "max_num_seqs", "enable_prefix_caching", "max_num_batched_tokens",
                                "tensor_parallel_size", "enforce_eager", "dtype", "max_model_len", "block_size")} == {
        "quantization": "awq", "max_num_seqs": 4, "enable_prefix_caching": False, "max_num_batched_tokens": 512,
        "tensor_parallel_size": 2, "enforce_eager": True, "dtype": "bfloat16", "max_model_len": 1024,
        "block_size": 32}
    # a size passed through still replaces the default fraction
    assert got["kv_cache_memory_bytes"] == 1 << 26 and "gpu_memory_utilization" not in got


def test_every_argument_zerolayer_passes_is_a_vllm_argument():
    full = args(**{f: 1 for f in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size")},
                quantization="fp8", enable_prefix_caching=True, kv_cache_memory_bytes=1 << 26)
    assert set(full) <= vllm_args.NAMES
    assert set(VllmSettings.TYPED) <= vllm_args.NAMES


def test_typed_and_passthrough_may_not_set_the_same_argument():
    with pytest.raises(ConfigError, match="max_num_seqs"):
        VllmSettings(max_num_seqs=4, engine_args={"max_num_seqs": 8})


def test_engine_keywords_build_settings_and_context_length():
    engine = VllmEngine("/models/m", served_name="m", max_model_len=512, enforce_eager=True)
    assert engine.settings == VllmSettings(max_model_len=512, enforce_eager=True)
    assert engine.max_model_len == 512  # before start: the configured length
    assert VllmEngine("/models/m").max_model_len is None  # the model's own, known once vLLM has read it


def spec(**engine):  # type: ignore[no-untyped-def]
    return {"kind": "vllm", "model_path": "/models/m", **engine}


@pytest.mark.parametrize("engine, message", [
    ({"engine_args": {"max_num_seq": 4}}, "engine.engine_args.max_num_seq: not an engine argument of vLLM "
                                          f"{vllm_args.VLLM_VERSION} (did you mean 'max_num_seqs'?)"),
    ({"engine_args": {"gpu_memory_utilisation": 0.5}}, "did you mean 'gpu_memory_utilization'?"),
    ({"engine_args": {"model": "/other"}}, "engine.engine_args.model: set by zerolayer"),
    ({"engine_args": {"scheduling_policy": "fcfs"}}, "engine.engine_args.scheduling_policy: set by zerolayer"),
    ({"max_num_seqs": 4, "engine_args": {"max_num_seqs": 8}}, "engine.engine_args.max_num_seqs: also set by "
                                                              "engine.max_num_seqs"),
    ({"engine_args": ["block_size"]}, "engine.engine_args: expected a mapping"),
    ({"kv_cache_memory_bytes": 1 << 26, "gpu_memory_utilization": 0.5}, "not both"),
    ({"dtype": "fp32"}, "engine.dtype: expected one of auto"),
    ({"enforce_eager": "yes"}, "engine.enforce_eager: expected true or false"),
    ({"gpu_memory_utilization": 1.5}, "engine.gpu_memory_utilization: expected a number in (0, 1]"),
    ({"max_num_seqs": 0}, "engine.max_num_seqs: expected a positive integer"),
    ({"tensor_parallel_size": True}, "engine.tensor_parallel_size: expected a positive integer"),
    ({"quantisation": "awq"}, "engine: unknown keys for the vllm engine: quantisation"),
])
def test_bad_engine_settings_are_config_errors_at_load(engine, message):
    with pytest.raises(ConfigError) as err:
        parse_config({"engine": spec(**engine)}, REPO, environ={})
    assert message in str(err.value)


def test_closest_name_only_when_something_is_close():
    assert engine_args.closest("enable_prefix_cache") == "enable_prefix_caching"
    assert engine_args.closest("zzzzzz") is None
    [problem] = engine_args.problems({"zzzzzz": 1}, "x")
    assert "see vLLM's engine arguments" in problem


def test_standalone_settings_parse_into_vllm_settings():
    settings = vllm_settings(spec(max_num_seqs=4, quantization="gptq", enable_prefix_caching=True,
                                  max_num_batched_tokens=256, engine_args={"block_size": 16}))
    assert settings == VllmSettings(max_num_seqs=4, quantization="gptq", enable_prefix_caching=True,
                                    max_num_batched_tokens=256, engine_args={"block_size": 16})
    assert set(VllmSettings.TYPED) <= VLLM_KEYS


def test_the_cpu_example_sets_the_cpu_settings_itself():
    engine = load_mapping(REPO / "examples" / "standalone-vllm.yaml")["engine"]
    settings = vllm_settings(engine)
    assert settings.enforce_eager is True and settings.kv_cache_memory_bytes and settings.dtype == "float32"


def inode(runtime=None, models=None):  # type: ignore[no-untyped-def]
    return {"metadata": {"name": "n"}, "spec": {"nodeName": "n", "models": models or [MODEL],
                                                "runtime": {"engine": "vllm", **(runtime or {})}}}


def engine_of(runtime=None, models=None):  # type: ignore[no-untyped-def]
    return config_from_inferencenode(inode(runtime, models))["engine"]


def test_inferencenode_gpu_defaults_follow_gpus_and_the_memory_fraction():
    # what the API server stores for a bare spec: gpus 1 and gpuMemoryUtilization 0.9 are CRD defaults
    engine = engine_of({"gpus": 4, "gpuMemoryUtilization": 0.9})
    assert engine == {"kind": "vllm", "model_path": "/models/m", "served_name": "m", "tensor_parallel_size": 4,
                      "gpu_memory_utilization": 0.9}
    assert engine_of({"gpus": 0})["tensor_parallel_size"] == 1
    assert engine_of({"gpus": 4, "engineArgs": {"tensor_parallel_size": 2}}) == {
        "kind": "vllm", "model_path": "/models/m", "served_name": "m", "engine_args": {"tensor_parallel_size": 2}}


def test_inferencenode_kv_cache_bytes_wins_over_the_default_fraction():
    engine = engine_of({"kvCacheBytes": 1 << 26, "gpuMemoryUtilization": 0.9})
    assert engine["kv_cache_memory_bytes"] == 1 << 26 and "gpu_memory_utilization" not in engine


def test_inferencenode_typed_knobs_map_to_vllm_names_and_parse():
    runtime = {"gpus": 2, "gpuMemoryUtilization": 0.8, "dtype": "bfloat16", "enforceEager": True,
               "quantization": "awq", "maxNumSeqs": 32, "maxNumBatchedTokens": 4096, "enablePrefixCaching": False,
               "engineArgs": {"block_size": 32}}
    mapping = config_from_inferencenode(inode(runtime, [{**MODEL, "maxModelLen": 8192}]))
    settings = vllm_settings(mapping["engine"])
    assert settings == VllmSettings(max_model_len=8192, gpu_memory_utilization=0.8, tensor_parallel_size=2,
                                    dtype="bfloat16", enforce_eager=True, quantization="awq", max_num_seqs=32,
                                    max_num_batched_tokens=4096, enable_prefix_caching=False,
                                    engine_args={"block_size": 32})


def test_inferencenode_engine_args_typo_is_refused_by_the_runtime_too():
    mapping = config_from_inferencenode(inode({"engineArgs": {"max_num_seq": 4}}))
    with pytest.raises(ConfigError, match="did you mean 'max_num_seqs'"):
        parse_config(mapping, REPO, environ={})


def test_generated_names_match_the_installed_vllm():
    """hack/gen_vllm_args.py --check: the shipped list is what the installed vLLM takes (~20 s: imports vLLM)."""
    pytest.importorskip("vllm")
    done = subprocess.run([sys.executable, str(REPO / "hack" / "gen_vllm_args.py"), "--check"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_settings_fields_are_the_typed_list():
    names = {f.name for f in dataclasses.fields(VllmSettings)} - {"engine_args", "otlp_traces_endpoint"}
    assert names == set(VllmSettings.TYPED)


def test_a_synthetic_base_engine_keeps_its_pace_and_takes_the_inferencenode_models():
    """The e2e fleet's runtimes stream slowly (a base config's tokens_per_second) so load is visible."""
    base = {"engine": {"kind": "synthetic", "tokens_per_second": 20, "output_tokens": 40, "models": ["x"]}}
    node = {"metadata": {"name": "n"}, "spec": {"nodeName": "n", "models": [MODEL], "runtime": {"engine": "synthetic"}}}
    assert config_from_inferencenode(node, base)["engine"] == {"kind": "synthetic", "tokens_per_second": 20,
                                                                "output_tokens": 40, "models": ["m"]}
    assert config_from_inferencenode(node, {"engine": {"kind": "vllm", "model_path": "/x"}})["engine"] == {
        "kind": "synthetic", "models": ["m"]}


def test_tracing_on_gives_vllm_the_same_otlp_endpoint_and_off_gives_it_none():
    """telemetry.tracing reaches vLLM's own request tracing (otlp_traces_endpoint); without it nothing does."""
    engine = {"kind": "vllm", "model_path": "/models/m"}
    url = "http://127.0.0.1:4318/v1/traces"
    traced = parse_config({"engine": engine, "telemetry": {"tracing": {"otlp_endpoint": url}}}, REPO, environ={})
    on = build_engine(traced)
    assert on.settings.otlp_traces_endpoint == url and on._args["otlp_traces_endpoint"] == url
    off = build_engine(parse_config({"engine": engine}, REPO, environ={}))
    assert off.settings.otlp_traces_endpoint is None and "otlp_traces_endpoint" not in off._args
    with pytest.raises(ConfigError, match="otlp_traces_endpoint"):
        VllmSettings(otlp_traces_endpoint=url, engine_args={"otlp_traces_endpoint": url})


def test_the_request_spans_context_reaches_vllm_only_when_set():
    options = SamplingOptions(max_tokens=4)
    assert trace_headers(options) is None  # tracing off: vLLM gets no headers
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    assert trace_headers(dataclasses.replace(options, traceparent=parent)) == {"traceparent": parent}
    assert dataclasses.replace(options, traceparent=parent).set_fields() == []  # not a sampling field
