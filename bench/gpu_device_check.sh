#!/usr/bin/env bash
# What a lent GPU machine can check in under 10 minutes (nothing in CI runs this):
#   1. NVML readings through the real source and the GPU map (bench/nvml_smoke.py);
#   2. the GPU source an operator-deployed runtime would pick here (gpu.source: auto);
#   3. one gpu-defragd scan, dry run (report only, never signal or reset);
#   3b. the pressure signal and the GPU map on a GPU held the way vLLM holds it (torch only, no vLLM:
#      ~90 % of GPU 0's memory pre-allocated and matmuls keeping it busy, read through the real NVML
#      source; bench/gpu_pressure_check.py);
#   3c. the real runtime on that GPU (bench/gpu_kv_pressure_check.py, torch only, no vLLM): an engine whose
#      KV cache is a pool of ~90 % of GPU 0 with matmuls while it serves; high-priority streams fill the
#      KV cache step by step while NVML reads ~0.9 memory and ~100 % utilisation throughout. Proves: the
#      server's pressure follows the KV cache (not NVML memory), low-priority requests are refused with
#      RESOURCE_EXHAUSTED exactly from 0.92, and the published GPU map admits while utilisation is ~1.0
#      and leaves at the same mark, with sane NVML fields;
#   4. only where vLLM imports or `pip install vllm==0.32.0` can reach the package index: the tiny
#      generated model on the GPU with zerolayer's GPU engine defaults (CUDA graphs), then two models and
#      a LoRA adapter as an InferenceNode with one GPU deploys them. Without network (the lent machines
#      so far) this step says so and costs nothing.
# Run from the repository root:  bash bench/gpu_device_check.sh   (OUT=dir: JSON results there)
# No install needed: PYTHONPATH is the checkout; where the runtime's pure-Python dependencies are missing,
# bench/device_wheels.sh (run beforehand on a machine with network) puts them in bench/.device-wheels,
# which must travel with the checkout; they are used from there.
# Each step is bounded; a failed step is reported and the next one still runs. Exit 1 if any failed.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
failed=()
step() {  # step NAME SECONDS CMD...
  local name=$1 limit=$2; shift 2
  echo "=== $name (limit ${limit}s)"
  local began=$SECONDS
  if timeout "$limit" "$@"; then
    echo "--- $name: ok in $((SECONDS - began))s"
  else
    echo "--- $name: FAILED (rc $?) after $((SECONDS - began))s"
    failed+=("$name")
  fi
}

nvidia-smi --query-gpu=index,name,memory.used,memory.total,driver_version --format=csv 2>/dev/null \
  || echo "(nvidia-smi not available)"
wheels=$(ls bench/.device-wheels/*.whl 2>/dev/null | tr '\n' ':')
export PYTHONPATH=".:operator:runtime:client:bpf:${wheels}${PYTHONPATH:-}"

step "NVML readings and GPU map" 30 $PY bench/nvml_smoke.py --seconds 3
step "GPU source selection (auto)" 20 $PY -c '
import os, sys
from zerolayer.runtime.gpu.select import choose_source
source, why = choose_source(os.environ)
print(f"gpu.source auto -> {source}: {why}")
sys.exit(0 if source == "nvml" else 1)'
step "defragd dry run (one scan)" 30 $PY -m zerolayer.cli defragd --once --dry-run --pod-root $$ --log-level INFO
step "pressure signal and GPU map under a vLLM-like hold (torch)" 90 \
  $PY bench/gpu_pressure_check.py --fraction 0.9 --seconds 8 ${OUT:+--json "$OUT/gpu_pressure_check.json"}
step "the runtime on the GPU: pressure follows the KV cache, shedding at 0.92, gossip" 180 \
  $PY bench/gpu_kv_pressure_check.py --fraction 0.9 ${OUT:+--json "$OUT/gpu_kv_pressure_check.json"}

if ! $PY -c "import vllm" 2>/dev/null; then
  if timeout 20 $PY -m pip download -q --no-deps -d "${TMPDIR:-/tmp}/zl-index-probe" "h11==0.16.0" >/dev/null 2>&1; then
    step "pip install vllm==0.32.0" 240 $PY -m pip install -q "vllm==0.32.0"
  else
    echo "=== no package index reachable from here: vLLM cannot be installed, the engine steps are skipped"
  fi
fi
if $PY -c "import vllm" 2>/dev/null; then
  step "tiny model on the GPU with the GPU defaults" 150 $PY bench/gpu_engine_check.py --requests 16 --max-tokens 64
  step "two models and a LoRA adapter sharing GPU 0" 150 $PY bench/gpu_multi_model_check.py --gpus 1
else
  echo "=== vLLM not installable here: engine check skipped"
fi

if [ ${#failed[@]} -gt 0 ]; then
  echo "FAILED: ${failed[*]}"
  exit 1
fi
echo "all device checks passed"
