"""One real model on the GPU with zerolayer's GPU engine defaults; prints what vLLM resolved and a
short throughput run as a table. Part of bench/gpu_device_check.sh (a lent GPU machine; no CI).

    python bench/gpu_engine_check.py [--model DIR] [--requests 16] [--max-tokens 64]

``--model`` defaults to the tiny generated Llama (random weights, written under $TMPDIR): the
point is the engine settings on a real GPU (dtype auto, CUDA graphs, the KV cache sized from
gpu_memory_utilization, tensor_parallel_size 1), not the text. Exit status 2 when vLLM or the
GPU is missing.
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import sys
import tempfile
import time
from typing import Any


def rows_of(engine: Any) -> list[tuple[str, Any]]:
    config = engine._llm.vllm_config  # what vLLM resolved from our arguments
    comp = config.compilation_config
    return [
        ("dtype (auto)", config.model_config.dtype),
        ("enforce_eager", config.model_config.enforce_eager),
        ("cudagraph_mode", getattr(comp, "cudagraph_mode", "?")),
        ("tensor_parallel_size", config.parallel_config.tensor_parallel_size),
        ("gpu_memory_utilization", config.cache_config.gpu_memory_utilization),
        ("kv_cache_memory_bytes", config.cache_config.kv_cache_memory_bytes),
        ("max_model_len (model's own)", engine.max_model_len),
        ("max_num_seqs", config.scheduler_config.max_num_seqs),
        ("enable_prefix_caching", config.cache_config.enable_prefix_caching),
        ("KV-cache capacity, tokens", engine.kv_capacity_tokens),
    ]


async def run(model: str, requests: int, max_tokens: int) -> list[tuple[str, Any]]:
    from zerolayer.runtime.engine.base import ChatMessage, SamplingOptions
    from zerolayer.runtime.engine.vllm_engine import VllmEngine

    engine = VllmEngine(model, served_name="check")  # no settings: the GPU defaults
    started = time.monotonic()
    await engine.start()
    rows = [("engine start, s", round(time.monotonic() - started, 1))] + rows_of(engine)
    try:
        prompt = await engine.render("check", [ChatMessage("user", "Say something about GPUs.")])
        options = SamplingOptions(max_tokens=max_tokens, temperature=1.0, seed=0)

        async def one(i: int) -> int:
            tokens = 0
            async for delta in engine.generate(prompt, options, f"check-{i}", priority=0):
                tokens += delta.token_count
            return tokens

        began = time.monotonic()
        counts = await asyncio.gather(*(one(i) for i in range(requests)))
        elapsed = time.monotonic() - began
        rows += [("requests x max_tokens", f"{requests} x {max_tokens}"), ("tokens generated", sum(counts)),
                 ("batched tokens/s", round(sum(counts) / elapsed)), ("engine stats", engine.stats())]
        try:
            from zerolayer.runtime.gpu.nvml import NvmlSource

            source = NvmlSource()
            for reading in source.sample():
                # vLLM pre-allocates up to gpu_memory_utilization: this fraction against the scheduler's
                # and the GPU map's 0.92 mark says whether NVML memory may drive admission on this GPU.
                rows.append((f"GPU {reading.index} memory used (NVML)",
                             f"{reading.memory_used_bytes / 2**30:.1f} / {reading.memory_total_bytes / 2**30:.1f} GiB"
                             f" = {reading.memory_fraction:.3f} (shed mark 0.92)"))
            source.close()
        except Exception as exc:  # noqa: BLE001 - a report line, not a failure of the engine check
            rows.append(("NVML reading", f"failed: {exc}"))
    finally:
        await engine.close()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model directory (default: generate the tiny Llama)")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    try:
        import vllm  # noqa: F401
    except ImportError:
        print("vLLM is not installed: engine check skipped", file=sys.stderr)
        return 2
    model = args.model
    if model is None:
        from zerolayer.runtime.node import tinymodel

        model = str(tinymodel.generate(pathlib.Path(tempfile.gettempdir()) / "zerolayer-tiny-llama"))
    rows = asyncio.run(run(model, args.requests, args.max_tokens))
    width = max(len(k) for k, _ in rows)
    print(f"{'setting / reading'.ljust(width)}  value")
    for key, value in rows:
        print(f"{key.ljust(width)}  {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
