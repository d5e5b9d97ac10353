"""Two models and a LoRA adapter in one runtime, as an InferenceNode with one GPU deploys them: both
engines share GPU 0, each with half of the 0.9 memory fraction. Prints what each vLLM engine resolved
and one greedy answer per served name, as a table. Part of bench/gpu_device_check.sh (a lent GPU
machine; no CI).

    python bench/gpu_multi_model_check.py [--gpus 1] [--cpu]

The runtime config comes from the same builder the in-cluster runtime uses
(``config_from_inferencenode``), so this checks the GPU plan end to end: ``CUDA_VISIBLE_DEVICES`` per
engine, tensor_parallel_size, the split memory fraction, LoRA on the first engine. ``--cpu`` runs the
same with a fixed KV cache on the CPU (no GPU: checks the script itself). Exit status 2 when vLLM is
missing.
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import sys
import tempfile
import time
from typing import Any


def inference_node(base: pathlib.Path, other: pathlib.Path, adapter: pathlib.Path, gpus: int, cpu: bool) -> dict:
    runtime: dict[str, Any] = {"engine": "vllm", "gpus": 0 if cpu else gpus}
    if cpu:
        runtime.update(kvCacheBytes=64 * 2**20, enforceEager=True, dtype="float32")
    return {"metadata": {"name": "check"}, "spec": {"nodeName": "check", "runtime": runtime, "models": [
        {"name": "base", "default": True, "source": {"path": str(base)},
         "loras": [{"name": "base-lora", "source": {"path": str(adapter)}}]},
        {"name": "other", "source": {"path": str(other)}}]}}


async def run(node: dict) -> list[tuple[str, Any]]:
    from zerolayer.runtime.config import build_engine, parse_config
    from zerolayer.runtime.engine.base import SamplingOptions
    from zerolayer.runtime.node.incluster import config_from_inferencenode

    mapping = config_from_inferencenode(node)
    mapping["tenants"] = [{"name": "check", "keys": [{"sha256": "0" * 64}]}]
    router = build_engine(parse_config(mapping, pathlib.Path.cwd(), environ={}))
    started = time.monotonic()
    await router.start()
    rows: list[tuple[str, Any]] = [("engines start (one after the other), s", round(time.monotonic() - started, 1))]
    try:
        for engine in router.engines:
            config = engine._llm.vllm_config  # what vLLM resolved from our arguments
            name = engine.models[0]
            rows += [(f"{name}: CUDA devices", engine.devices),
                     (f"{name}: tensor_parallel_size", config.parallel_config.tensor_parallel_size),
                     (f"{name}: gpu_memory_utilization", config.cache_config.gpu_memory_utilization),
                     (f"{name}: KV-cache capacity, tokens", engine.kv_capacity_tokens),
                     (f"{name}: LoRA", config.lora_config)]
        answers = {}
        for model in router.models:
            engine = router.for_model(model)
            prompt = await engine.encode(model, "The quick brown fox")
            text = "".join([d.text async for d in engine.generate(
                prompt, SamplingOptions(max_tokens=8, temperature=0.0, ignore_eos=True), f"check-{model}", 0)])
            answers[model] = text
            rows.append((f"greedy answer of {model}", repr(text)))
        rows.append(("three different answers (each name ran on its own weights)", len(set(answers.values())) == 3))
        rows.append(("vllm:lora_requests_info source (LoraStats)", router.engines[0].stats().lora))
    finally:
        await router.close()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=1, help="the pod's spec.runtime.gpus (both models share them)")
    parser.add_argument("--cpu", action="store_true", help="no GPU: a fixed KV cache on the CPU")
    args = parser.parse_args()
    try:
        import vllm  # noqa: F401
    except ImportError:
        print("vLLM is not installed: multi-model check skipped", file=sys.stderr)
        return 2
    from zerolayer.runtime.node import tinymodel

    root = pathlib.Path(tempfile.gettempdir()) / "zerolayer-multi-model-check"
    base = tinymodel.generate(root / "base")
    other = tinymodel.generate(root / "other", seed=7, init_std=0.5)
    adapter = tinymodel.generate_lora(base, root / "base-lora")
    rows = asyncio.run(run(inference_node(base, other, adapter, args.gpus, args.cpu)))
    width = max(len(k) for k, _ in rows)
    print(f"{'setting / reading'.ljust(width)}  value")
    for key, value in rows:
        print(f"{key.ljust(width)}  {value}")
    return 0 if dict(rows).get("three different answers (each name ran on its own weights)") else 1


if __name__ == "__main__":
    sys.exit(main())
