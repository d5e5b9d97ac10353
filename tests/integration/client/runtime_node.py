"""Run one real zerolayer runtime (synthetic engine) as its own process, for SDK integration tests.

    python runtime_node.py --port 0 [--tps 200] [--kv-capacity 4096] ...

Prints ``READY <port>`` once it listens and serves until SIGTERM (drain) or SIGKILL
(a node dying). Fault injection, on the real server path: after SIGUSR1 the engine
raises an EngineError for every request (the runtime answers INTERNAL_ERROR); SIGUSR2
heals it. Tenant ``t1`` authenticates with the key ``tenant-key``.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

from zerolayer.runtime.engine.synthetic import SyntheticEngine
from zerolayer.runtime.errors import EngineError
from zerolayer.runtime.scheduler.api import TenantPolicy
from zerolayer.runtime.scheduler.config import SchedulerConfig
from zerolayer.runtime.scheduler.core import MicroScheduler
from zerolayer.runtime.serving.server import RuntimeServer
from zerolayer.runtime.tenants import Tenant, key_hash

API_KEY = "tenant-key"


class FaultableEngine(SyntheticEngine):
    """The synthetic engine with a switch that makes it fail like a broken GPU would."""

    broken = False

    async def generate(self, prompt, options, request_id, priority):
        if self.broken:
            raise EngineError("injected engine failure")
        async for delta in super().generate(prompt, options, request_id, priority):
            yield delta


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--tps", type=float, default=None, help="tokens per second per stream")
    parser.add_argument("--ttft", type=float, default=0.0)
    parser.add_argument("--kv-capacity", type=int, default=65536)
    parser.add_argument("--low-shed-at", type=float, default=0.92)
    parser.add_argument("--low-resume-below", type=float, default=0.88)
    parser.add_argument("--retry-after", type=float, default=0.05, help="pressure refusals' retry-after (s)")
    parser.add_argument("--sample-interval", type=float, default=0.02)
    parser.add_argument("--broken", action="store_true", help="start with the engine failing")
    args = parser.parse_args()

    engine = FaultableEngine(
        ("tiny", "tiny-lite"),
        output_tokens=args.output_tokens,
        ttft_s=args.ttft,
        tokens_per_second=args.tps,
        kv_capacity_tokens=args.kv_capacity,
    )
    engine.broken = args.broken
    config = SchedulerConfig(
        low_shed_at=args.low_shed_at,
        low_resume_below=args.low_resume_below,
        pressure_retry_after_s=args.retry_after,
        preempt_after_samples=10**6,  # shed new streams only: preemption is not what these tests measure
        # Sample-driven shedding only: with projection the tiny modelled cache refuses ~75 % instead of
        # the ~20 % these tests are about.
        adopt_engine_kv_capacity=False,
    )
    tenant = Tenant("t1", frozenset({key_hash(API_KEY)}), TenantPolicy("t1"))
    server = RuntimeServer(
        engine=engine, scheduler=MicroScheduler(config), tenants=[tenant], port=args.port,
        sample_interval_s=args.sample_interval,
    )  # fmt: skip
    await server.start()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, lambda: setattr(engine, "broken", True))
    loop.add_signal_handler(signal.SIGUSR2, lambda: setattr(engine, "broken", False))
    print(f"READY {server.port}", flush=True)
    await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main())
    sys.exit(0)
