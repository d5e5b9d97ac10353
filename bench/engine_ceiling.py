"""The engine with no server: what any front end in front of this vLLM engine could reach at most.

vLLM's ``AsyncLLM`` in this process, with vs_vllm_serve.py's engine settings (the tiny generated
Llama, max_num_seqs 16, a 64 MiB KV cache, eager, float32, priority scheduling), driven the way
``vllm bench serve`` drives a server: ``--prompts`` requests of random token ids, ``--input-len``
in and ``--output-len`` out (``ignore_eos``), at most ``--concurrency`` in flight, each streamed as
deltas (``RequestOutputKind.DELTA``, what a streaming server consumes). No HTTP, no JSON, no chat
template, no second process for the client: the front-end work left is vLLM's own input and output
processing (``AsyncLLM.generate``, the output handler, the detokenizer), which every front end on
this engine pays. So its output tokens/s bound what a server over this engine can give at this
concurrency on this machine, and ``vllm serve``'s tokens/s over it is the share its front end takes.

The prompts are 64 token ids without a chat template's tokens around them, a little shorter than
the chat requests ``vllm bench serve`` sends: the bound is, if anything, generous.

    python bench/engine_ceiling.py [--concurrency 32] [--prompts 256] [--json]

``--json`` prints one JSON object (vs_vllm_serve.py ``--ceiling`` reads it); otherwise a line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time

import benchlib
from vs_vllm_serve import ENGINE, MODEL_DIR, SERVED


def engine_args() -> dict:
    """vs_vllm_serve.py's engine settings, as ``AsyncEngineArgs`` keywords."""
    return {"model": str(MODEL_DIR), "served_model_name": [SERVED], **ENGINE, "scheduling_policy": "priority",
            "disable_log_stats": True}


def prompts(count: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab - 10) for _ in range(length)] for _ in range(count)]


async def drive(llm, ids: list[list[int]], output_len: int, concurrency: int) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=1.0,
                            output_kind=RequestOutputKind.DELTA)
    gate = asyncio.Semaphore(concurrency)
    ttfts: list[float] = []
    tokens = 0

    async def one(i: int, prompt: list[int]) -> None:
        nonlocal tokens
        async with gate:
            start = time.perf_counter()
            first = True
            async for out in llm.generate(TokensPrompt(prompt_token_ids=prompt), params, f"ceiling-{i}"):
                n = sum(len(c.token_ids) for c in out.outputs)
                if first and n:
                    ttfts.append(time.perf_counter() - start)
                    first = False
                tokens += n

    start = time.perf_counter()
    await asyncio.gather(*(one(i, p) for i, p in enumerate(ids)))
    duration = time.perf_counter() - start
    return {"completed": len(ids), "duration": duration, "total_output_tokens": tokens,
            "output_throughput": tokens / duration,  # percentiles as the servers' rows take them
            "p50_ttft_token_ms": benchlib.percentile(ttfts, 0.5) * 1000,
            "p99_ttft_token_ms": benchlib.percentile(ttfts, 0.99) * 1000}


async def run(args: argparse.Namespace) -> dict:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_args()))
    try:
        vocab = llm.model_config.get_vocab_size()
        await drive(llm, prompts(min(args.concurrency, 4), args.input_len, vocab, seed=1), args.output_len,
                    args.concurrency)  # warm-up, as vllm bench serve's --num-warmups
        meter = benchlib.SplitCpuMeter(os.getpid())
        meter.start()
        out = await drive(llm, prompts(args.prompts, args.input_len, vocab), args.output_len, args.concurrency)
        split = meter.stop()
    finally:
        llm.shutdown()
        del llm  # shut down here, not again from __del__ at interpreter exit
    out["cpu_ms_per_req"] = (split["front"] + split["engine"]) * 1000 / out["completed"]
    out["front_cpu_ms_per_req"] = split["front"] * 1000 / out["completed"]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    out = asyncio.run(run(args))
    if args.json:
        print(json.dumps(out))
    else:
        print(f"engine-only c={args.concurrency}: {out['output_throughput']:.1f} out tok/s, TTFT p50 "
              f"{out['p50_ttft_token_ms']:.1f} ms, p99 {out['p99_ttft_token_ms']:.1f} ms, CPU "
              f"{out['cpu_ms_per_req']:.1f} ms/req (in-process front {out['front_cpu_ms_per_req']:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
