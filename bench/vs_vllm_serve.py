"""zerolayer against `vllm serve` and against LiteLLM's proxy in front of it, driven by `vllm bench serve`.

Same model (the tiny generated Llama, random weights: ``python -m zerolayer.runtime.node.tinymodel``),
same engine settings (max_model_len 1024, max_num_seqs 16, a 64 MiB KV cache, eager, float32,
vLLM's priority scheduling policy, which zerolayer always sets), same client, three stacks:

  vllm-serve   vLLM's own OpenAI server (``vllm serve`` with ``--api-key``);
  zerolayer    ``zerolayer runtime`` with the vLLM engine in its process: API-key auth, a tenant
               with token/request/concurrency quotas checked on every request, two-stage
               admission by the micro-scheduler and token metering (``--audit-spool`` counters
               and the in-process journal);
  zl-native    (``--native``) the same runtime with ``server.core: native``, the compiled server core
               (native/h2core; docs/server-core.md), in a process of its own with its own engine;
  litellm      LiteLLM's proxy (master key auth) forwarding to the ``vllm serve`` above: the
               middle layer zerolayer replaces. LiteLLM lives in its own virtual environment
               (``--litellm``, default ``~/.cache/zerolayer/bench-venvs/litellm``) so it cannot
               change this environment's packages.

With ``--api-processes 1 2`` each of vllm-serve, zerolayer and zl-native also runs with two API
processes sharing one engine core: ``vllm serve --api-server-count 2`` as vllm-serve-x2 and the
runtime with ``server.api_processes: 2`` (docs/api-processes.md) as zerolayer-x2 / zl-native-x2,
each compared with vllm-serve-x2.

All stacks run at once; for each concurrency the client runs against each stack back to back,
``--rounds`` times with the order rotated, and the tables show each metric's median over the
rounds (the per-round throughput ratios are printed too: on a shared 2-core machine one run
can be off by 2x). Client: ``vllm bench serve --backend openai-chat
--endpoint /v1/chat/completions --dataset-name random --random-input-len 64
--random-output-len 32`` (streaming, the key as ``OPENAI_API_KEY``). Server CPU per request
is the user+system time of each stack's whole process tree (API server and engine core; for
LiteLLM, LiteLLM plus the vllm serve behind it) over the run ÷ completed requests, and the front end's part of it:
the same less the engine's processes (``VLLM::EngineCore``, ``VLLM::Worker``).

With ``--ceiling`` each round ends with ``engine-only`` (bench/engine_ceiling.py): the same engine
in-process with no server and no client process, the most any front end reaches on this machine; the
report gives each stack's throughput as a share of it.

``--servers-on CPUS`` starts every server under ``taskset -c CPUS`` (vllm serve and the runtime alike; the
engine core inherits it) and binds the worker's OpenMP threads to the other CPUs this process may use
(``VLLM_CPU_OMP_THREADS_BIND``, for both stacks). By default (``auto``) vLLM's CPU backend binds them to the
cores it does not reserve (on 2 cores, core 0 computes and core 1 is reserved for the rest) but leaves the API
server and the engine core free to run on the worker's core; ``--servers-on 1`` keeps them on the reserved
one. The load generator is not pinned.

    python bench/vs_vllm_serve.py [--concurrency 1 4 16] [--prompts 64] [--rounds 3] [--native] [--litellm '']
                                   [--api-processes 1 2] [--ceiling] [--servers-on CPUS]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Iterator

import benchlib

MODEL_DIR = benchlib.HERE.parent / ".models" / "tiny-llama"
SERVED = "tiny-llama"
ENGINE = {"max_model_len": 1024, "max_num_seqs": 16, "kv_cache_memory_bytes": 64 * 1024 * 1024,
          "enforce_eager": True, "dtype": "float32"}
VLLM_CLI = [sys.executable, str(benchlib.HERE / "vllm_cli.py")]
DEFAULT_LITELLM = pathlib.Path(os.environ.get("ZEROLAYER_CACHE", pathlib.Path.home() / ".cache" / "zerolayer"),
                               "bench-venvs", "litellm")


def vllm_serve_cmd(port: int, api_servers: int = 1) -> list[str]:
    count = ["--api-server-count", str(api_servers)] if api_servers > 1 else []
    return [*VLLM_CLI, "serve", str(MODEL_DIR), *count, "--served-model-name", SERVED, "--host", "127.0.0.1",
            "--port", str(port), "--api-key", benchlib.KEY, "--max-model-len", str(ENGINE["max_model_len"]),
            "--max-num-seqs", str(ENGINE["max_num_seqs"]), "--kv-cache-memory-bytes",
            str(ENGINE["kv_cache_memory_bytes"]), "--enforce-eager", "--dtype", "float32",
            "--scheduling-policy", "priority", "--disable-uvicorn-access-log"]


def zerolayer_cmd(port: int, spool: str, core: str = "python", api_processes: int = 1) -> tuple[list[str], str]:
    engine = {"kind": "vllm", "model_path": str(MODEL_DIR), "served_name": SERVED, **ENGINE}
    server = {"core": core,  # named: the default is native where it is installed
              **({"api_processes": api_processes} if api_processes > 1 else {})}
    extra = {"server": server}
    config = benchlib.write_config(benchlib.runtime_config(port, engine, **extra))
    return benchlib.runtime_cmd(config, "--audit-spool", spool, "--audit-journal"), config


def litellm_config(upstream_port: int) -> str:
    config = {
        "model_list": [{"model_name": SERVED, "litellm_params": {
            "model": f"openai/{SERVED}", "api_base": f"http://127.0.0.1:{upstream_port}/v1",
            "api_key": benchlib.KEY}}],
        "general_settings": {"master_key": benchlib.KEY},
        "litellm_settings": {"drop_params": True, "telemetry": False},
    }
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        json.dump(config, f)
    return f.name


def wait_ready(port: int, timeout: float = 300) -> None:
    """Until GET /v1/models answers 200 with the key (the engine is loaded, not just the port bound)."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            r = httpx.get(f"http://127.0.0.1:{port}/v1/models", headers={"authorization": f"Bearer {benchlib.KEY}"})
            if r.status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(1)
    raise RuntimeError(f"port {port}: /v1/models never answered 200")


def bench_serve(port: int, concurrency: int, prompts: int, pid: int, pids_extra: int | None = None) -> dict:
    """One ``vllm bench serve`` run; its saved result JSON plus the server CPU per request."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [*VLLM_CLI, "bench", "serve", "--backend", "openai-chat", "--base-url", f"http://127.0.0.1:{port}",
               "--endpoint", "/v1/chat/completions", "--model", SERVED, "--tokenizer", str(MODEL_DIR),
               "--dataset-name", "random", "--random-input-len", "64", "--random-output-len", "32",
               "--max-concurrency", str(concurrency), "--num-prompts", str(prompts), "--num-warmups",
               str(min(concurrency, 4)), "--percentile-metrics", "ttft,tpot,e2el", "--metric-percentiles", "50,99",
               "--seed", "0", "--disable-tqdm", "--save-result", "--save-detailed", "--result-dir", tmp,
               "--result-filename", "r.json"]
        meters = [benchlib.SplitCpuMeter(p) for p in (pid, pids_extra) if p]
        env = {**os.environ, "OPENAI_API_KEY": benchlib.KEY}
        # The client imports vLLM for a while before it sends anything: start the meters late enough not to
        # matter (the servers are idle meanwhile) but before the first request.
        for m in meters:
            m.start()
        done, group = benchlib.run_client(cmd, env=env, cwd=tmp)  # outranks the servers: see run_client
        split = [m.stop() for m in meters]
        front = sum(s["front"] for s in split)
        cpu = front + sum(s["engine"] for s in split)
        if done.returncode != 0 or not pathlib.Path(tmp, "r.json").exists():
            raise RuntimeError(f"vllm bench serve failed:\n{(done.stdout + done.stderr)[-3000:]}")
        result = json.loads(pathlib.Path(tmp, "r.json").read_text())
    keep = ("completed", "failed", "duration", "total_output_tokens", "request_throughput", "output_throughput",
            "median_ttft_ms", "p50_ttft_ms", "p99_ttft_ms", "mean_ttft_ms", "median_tpot_ms", "p50_tpot_ms",
            "p99_tpot_ms", "median_e2el_ms", "p99_e2el_ms")
    out = {k: result[k] for k in keep if k in result}
    errors = [e for e in result.get("errors", []) if e]
    if not out.get("completed"):
        raise RuntimeError(f"port {port}: every request failed, e.g. {errors[:1]}")
    out["first_error"] = errors[0] if errors else None
    out["client_group"] = group
    out.update(first_token_metrics(result))
    out["server_cpu_s"] = cpu
    out["cpu_ms_per_req"] = cpu * 1000 / out["completed"] if out.get("completed") else None
    out["front_cpu_ms_per_req"] = front * 1000 / out["completed"] if out.get("completed") else None
    out["command"] = " ".join(["vllm", *cmd[len(VLLM_CLI):]]).replace(str(MODEL_DIR), "MODEL").replace(
        f"--result-dir {tmp} ", "")
    return out


CEILING = "engine-only"


def engine_only(concurrency: int, prompts: int) -> dict:
    """One bench/engine_ceiling.py run in a process of its own: the engine with no server in front."""
    cmd = [sys.executable, str(benchlib.HERE / "engine_ceiling.py"), "--concurrency", str(concurrency),
           "--prompts", str(prompts), "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=benchlib.HERE, timeout=1800)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"engine_ceiling.py failed:\n{(done.stdout + done.stderr)[-3000:]}")
    out = json.loads(lines[-1])
    out.update(p50_ttft_ms=out["p50_ttft_token_ms"], p50_tpot_token_ms=float("nan"),
               command=" ".join(["python", "bench/engine_ceiling.py", *cmd[2:-1]]))
    return out


def first_token_metrics(result: dict) -> dict:
    """TTFT to the first *token* chunk, and TPOT from it, per request from the detailed result.

    ``vllm bench serve`` stamps TTFT at the first SSE chunk carrying ``choices``. Both servers'
    first chunk is the role chunk (``{"role": "assistant", "content": ""}``), but vLLM sends it
    with the first token while the zerolayer runtime sends it as soon as the stream is admitted,
    before the engine has produced anything. The first token is in the second chunk for both, so
    TTFT(token) = ttft + itl[0]; TPOT(token) = (latency - TTFT(token)) / (output tokens - 1)."""
    ttfts, tpots = [], []
    for ttft, itl, latency, n, err in zip(result["ttfts"], result["itls"], result["latencies"],
                                          result["output_lens"], result["errors"]):
        if err or not itl:
            continue
        first = ttft + itl[0]
        ttfts.append(first * 1000)
        if n and n > 1:
            tpots.append((latency - first) / (n - 1) * 1000)
    return {"p50_ttft_token_ms": benchlib.percentile(ttfts, 0.5), "p99_ttft_token_ms": benchlib.percentile(ttfts, 0.99),
            "p50_tpot_token_ms": benchlib.percentile(tpots, 0.5)}


def cpu_set(text: str) -> set[int]:
    """``taskset -c``'s list form: ``1``, ``0,2``, ``1-3``."""
    cpus: set[int] = set()
    for part in text.split(","):
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return cpus


def worker_cpus(servers_on: str) -> str:
    """The CPUs left to vLLM's worker when the servers run on ``servers_on``: the rest of this process's."""
    rest = sorted(os.sched_getaffinity(0) - cpu_set(servers_on))
    if not rest:
        raise SystemExit(f"--servers-on {servers_on} leaves no CPU for vLLM's worker")
    return ",".join(map(str, rest))


def suffix(processes: int) -> str:
    """A stack's name suffix for its number of API processes (none for one)."""
    return "" if processes == 1 else f"-x{processes}"


@contextlib.contextmanager
def stacks(litellm_venv: pathlib.Path | None, logs: pathlib.Path, native: bool = False,
           api_processes: tuple[int, ...] = (1,), servers_on: str | None = None
           ) -> Iterator[dict[str, tuple[int, int, int | None]]]:
    """Start every stack, for each number of API processes; yields name -> (port, pid to meter, second pid
    to meter or None). ``servers_on``: the CPUs (taskset) vllm serve and the runtime start on."""
    pin = ["taskset", "-c", servers_on] if servers_on else []
    bind = {"VLLM_CPU_OMP_THREADS_BIND": worker_cpus(servers_on)} if servers_on else {}
    with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory() as spool:
        found: dict[str, tuple[int, int, int | None]] = {}
        first_vllm: tuple[int, int] | None = None
        env = {"BENCH_KEY": benchlib.KEY, **bind}
        for n in api_processes:
            name = suffix(n)
            vport = benchlib.free_port()
            vproc = stack.enter_context(benchlib.server([*pin, *vllm_serve_cmd(vport, n)], vport, env=bind,
                                                        timeout=600, log=logs / f"vllm-serve{name}.log"))
            wait_ready(vport)
            found[f"vllm-serve{name}"] = (vport, vproc.pid, None)
            first_vllm = first_vllm or (vport, vproc.pid)
            for flavour, core in (("zerolayer", "python"), ("zl-native", "native")):
                if core == "native" and not native:
                    continue
                port = benchlib.free_port()
                cmd, config = zerolayer_cmd(port, spool, core=core, api_processes=n)
                stack.callback(os.unlink, config)
                proc = stack.enter_context(benchlib.server([*pin, *cmd], port, env=env, timeout=600,
                                                           log=logs / f"{flavour}{name}.log"))
                wait_ready(port)
                found[f"{flavour}{name}"] = (port, proc.pid, None)
        if litellm_venv is not None and first_vllm is not None:
            vport, vpid = first_vllm
            lport = benchlib.free_port()
            lconfig = litellm_config(vport)
            stack.callback(os.unlink, lconfig)
            lcmd = [str(litellm_venv / "bin" / "litellm"), "--config", lconfig, "--host", "127.0.0.1",
                    "--port", str(lport), "--num_workers", "1"]
            lenv = {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR", "LITELLM_TELEMETRY": "False"}
            lproc = stack.enter_context(benchlib.server(lcmd, lport, env=lenv, timeout=600, log=logs / "litellm.log"))
            wait_ready(lport)
            found["litellm"] = (lport, lproc.pid, vpid)
        yield found


def pairs_of(names: list[str]) -> list[tuple[str, str]]:
    """(runtime stack, the stack it is compared with): each runtime stack against ``vllm serve`` with as
    many API processes, and the one-process ones against LiteLLM."""
    out = []
    for name in names:
        flavour, _, count = name.partition("-x")
        if flavour.startswith(("zerolayer", "zl-native")) and not name.startswith("vllm"):
            base = "vllm-serve" + (f"-x{count}" if count else "")
            out += [(name, other) for other in (base, "litellm") if other in names and not (count and other == "litellm")]
    return out


def median_of(runs: list[dict]) -> dict:
    """Each numeric field's median over the rounds (other fields from the first round)."""
    out = dict(runs[0])
    for key, value in runs[0].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = statistics.median(r[key] for r in runs if r.get(key) is not None)
    return out


def client_groups(rounds: dict[int, dict[str, list[dict]]]) -> str:
    """The load generator's scheduling group(s) over the run, without the group number."""
    found = {r["client_group"].partition(" ")[2] or "unknown"  # "/autogroup-N nice -5" -> "nice -5"
             for by_name in rounds.values() for runs in by_name.values() for r in runs if "client_group" in r}
    return ", ".join(sorted(found)) or "n/a"


def report(results: dict[int, dict[str, dict]], args: argparse.Namespace,
           rounds: dict[int, dict[str, list[dict]]]) -> str:
    rev = os.environ.get("ZEROLAYER_BENCH_REV", "working tree")
    lines = [
        f"zerolayer vs vllm serve vs LiteLLM proxy -> vllm serve; tiny random-weight Llama on vLLM {vllm_version()} "
        f"(CPU), random dataset 64 in / 32 out tokens, {args.prompts} prompts per point, streaming "
        f"/v1/chat/completions; medians of {args.rounds} interleaved rounds; runtime at {rev}",
        benchlib.machine_line(),
        f"load generator: vllm bench serve in a session of its own, scheduling group {client_groups(rounds)} "
        "(benchlib.run_client: a client in another session than busy servers is starved on 2 cores)",
        *([f"servers started under taskset -c {args.servers_on}, vLLM's worker bound to CPU "
           f"{worker_cpus(args.servers_on)} (VLLM_CPU_OMP_THREADS_BIND); the load generator not pinned"]
          if args.servers_on else []),
        "",
        f"{'conc':>4} {'stack':<15} {'done':>5} {'out tok':>7} {'out tok/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} "
        f"{'TPOT p50':>9} {'CPU ms/req':>10} {'front ms/req':>12} {'1st-chunk p50':>13}",
    ]
    for c, rows in results.items():
        for name, r in rows.items():
            lines.append(f"{c:>4} {name:<15} {int(r['completed']):>5} {int(r['total_output_tokens']):>7} "
                         f"{r['output_throughput']:9.1f} {r['p50_ttft_token_ms']:9.1f} {r['p99_ttft_token_ms']:9.1f} "
                         f"{r['p50_tpot_token_ms']:9.1f} {r['cpu_ms_per_req']:10.1f} {r['front_cpu_ms_per_req']:12.1f} "
                         f"{r['p50_ttft_ms']:13.1f}")
    lines += ["", "TTFT = to the first token's chunk; TPOT from it (see first_token_metrics). 1st-chunk p50 is what",
              "vllm bench serve itself prints as TTFT: the first SSE chunk, which the runtime sends (role only) when",
              "the stream is admitted and vLLM sends with the first token, so it flatters the runtime; not used below.",
              "CPU ms/req is the whole server tree's CPU per completed request; front ms/req is that less the",
              "engine (VLLM::EngineCore*, VLLM::Worker*): the API process(es), the part a serving layer changes.",
              "", "ratios zerolayer / other (out tok/s: >1 = zerolayer faster; TTFT, TPOT, CPU/req: <1 = zerolayer "
                  "lower):",
              f"{'conc':>4} {'stack / against':<28} {'out tok/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} "
              f"{'CPU/req':>9} {'front/req':>9}"]
    pairs = pairs_of(list(next(iter(results.values()))))
    for c, rows in results.items():
        for flavour, other in pairs:
            if flavour not in rows or other not in rows:
                continue
            z, o = rows[flavour], rows[other]
            lines.append(f"{c:>4} {flavour + ' / ' + other:<28} "
                         f"{benchlib.ratio(z['output_throughput'], o['output_throughput']):>9} "
                         f"{benchlib.ratio(z['p50_ttft_token_ms'], o['p50_ttft_token_ms']):>9} "
                         f"{benchlib.ratio(z['p99_ttft_token_ms'], o['p99_ttft_token_ms']):>9} "
                         f"{benchlib.ratio(z['p50_tpot_token_ms'], o['p50_tpot_token_ms']):>9} "
                         f"{benchlib.ratio(z['cpu_ms_per_req'], o['cpu_ms_per_req']):>9} "
                         f"{benchlib.ratio(z['front_cpu_ms_per_req'], o['front_cpu_ms_per_req']):>9}")
    lines += ["", "runtime / vllm-serve (as many API processes) out tok/s in each round (the spread is the machine's "
                  "noise):"]
    for c, by_name in rounds.items():
        for flavour, other in pairs:
            if other != "litellm":
                per_round = [benchlib.ratio(z["output_throughput"], v["output_throughput"])
                             for z, v in zip(by_name[flavour], by_name[other])]
                lines.append(f"  c={c} {flavour} / {other}: {', '.join(per_round)}")
    if any(CEILING in rows for rows in results.values()):
        lines += ["", f"out tok/s as a share of {CEILING} (bench/engine_ceiling.py: the same engine, no server, no "
                      "client process; per round, then the median):"]
        for c, by_name in rounds.items():
            for name, runs in by_name.items():
                if name != CEILING:
                    per_round = [r["output_throughput"] / e["output_throughput"]
                                 for r, e in zip(runs, by_name[CEILING])]
                    lines.append(f"  c={c} {name:<15} {statistics.median(per_round):.2f} "
                                 f"({', '.join(f'{x:.2f}' for x in per_round)})")
    lines += ["", "goals (issue 14): vs vllm-serve out tok/s >= 1.00x and TTFT <= 1.00x at every concurrency; "
                  "vs litellm out tok/s >= 1.50x and TTFT p99 <= 0.50x.",
              "", "client command (per point; the key in OPENAI_API_KEY):",
              f"  {next(iter(next(iter(results.values())).values()))['command']}"]
    return "\n".join(lines)


def vllm_version() -> str:
    try:
        import vllm

        return str(vllm.__version__)
    except ImportError:
        return "?"


def plot(results: dict[int, dict[str, dict]], path: pathlib.Path) -> None:
    plt = benchlib.pyplot()
    if plt is None:
        return
    conc = list(results)
    names = list(next(iter(results.values())))
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for key, ax, label in (("output_throughput", axes[0], "output tokens/s"),
                           ("p50_ttft_token_ms", axes[1], "TTFT p50 (ms, first token)"),
                           ("p99_ttft_token_ms", axes[2], "TTFT p99 (ms, first token)")):
        for name in names:
            ax.plot(conc, [results[c][name][key] for c in conc], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xticks(conc, [str(c) for c in conc])
        ax.set_xlabel("client concurrency")
        ax.set_ylabel(label)
    axes[0].legend()
    fig.suptitle("tiny Llama on vLLM (CPU, 2 shared cores): zerolayer vs vllm serve vs LiteLLM -> vllm serve")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--prompts", type=int, default=64, help="prompts per concurrency, stack and round")
    parser.add_argument("--rounds", type=int, default=3,
                        help="runs per concurrency and stack, interleaved; the tables show medians")
    parser.add_argument("--litellm", default=str(DEFAULT_LITELLM),
                        help="LiteLLM's virtual environment ('' to skip LiteLLM)")
    parser.add_argument("--native", action="store_true",
                        help="also run the runtime with server.core: native (the compiled core) as zl-native")
    parser.add_argument("--api-processes", type=int, nargs="+", default=[1], metavar="N",
                        help="run vllm serve (--api-server-count N) and the runtime (server.api_processes N) for each "
                             "N; stacks with N > 1 are named -xN (default: 1)")
    parser.add_argument("--ceiling", action="store_true",
                        help="also run the engine with no server (bench/engine_ceiling.py) in each round, as "
                             "engine-only: the most any front end over this engine reaches at that concurrency")
    parser.add_argument("--servers-on", metavar="CPUS",
                        help="start vllm serve and the runtime under taskset -c CPUS (e.g. 1: the core vLLM's CPU "
                             "backend reserves for its API server and engine core on 2 cores)")
    parser.add_argument("--name", default="vs_vllm_serve")
    args = parser.parse_args()
    from zerolayer.runtime.node import tinymodel

    tinymodel.generate(MODEL_DIR)
    venv = pathlib.Path(args.litellm) if args.litellm else None
    if venv is not None and not (venv / "bin" / "litellm").exists():
        parser.error(f"no LiteLLM in {venv}: python3 -m venv {venv} && {venv}/bin/pip install 'litellm[proxy]'")
    rounds: dict[int, dict[str, list[dict]]] = {}
    with tempfile.TemporaryDirectory() as logs, stacks(venv, pathlib.Path(logs), args.native, tuple(args.api_processes),
                                                       args.servers_on) as found:
        try:
            for c in args.concurrency:
                rounds[c] = {name: [] for name in [*found, *([CEILING] if args.ceiling else [])]}
                for k in range(args.rounds):
                    # Rotate who goes first each round, so a burst of outside load does not always hit one stack.
                    order = list(found)[k % len(found):] + list(found)[:k % len(found)]
                    if args.ceiling:
                        order.append(CEILING)  # started fresh each round, after the servers' runs
                    for name in order:
                        if name == CEILING:
                            r = engine_only(c, args.prompts)
                        else:
                            port, pid, extra = found[name]
                            r = bench_serve(port, c, args.prompts, pid, extra)
                        rounds[c][name].append(r)
                        print(f"c={c} round {k + 1} {name}: {r['output_throughput']:.1f} tok/s, TTFT p50 "
                              f"{r['p50_ttft_token_ms']:.1f} ms", file=sys.stderr, flush=True)
        except Exception:
            for log in pathlib.Path(logs).glob("*.log"):
                print(f"--- {log.name}\n{log.read_text(errors='replace')[-3000:]}", file=sys.stderr)
            raise
    results = {c: {name: median_of(runs) for name, runs in by_name.items()} for c, by_name in rounds.items()}
    text = report(results, args, rounds)
    print(text)
    benchlib.save(args.name, text, {"results": results, "rounds": rounds, "command": benchlib.bench_argv(),
                                    "runtime_rev": os.environ.get("ZEROLAYER_BENCH_REV", "working tree")})
    plot(results, benchlib.RESULTS / f"{args.name}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
