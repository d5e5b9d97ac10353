#!/usr/bin/env bash
# What a lent GPU machine can check in under 5 minutes (nothing in CI runs this):
#   1. NVML readings through the real source and the GPU map (bench/nvml_smoke.py);
#   2. the GPU source an operator-deployed runtime would pick here (gpu.source: auto);
#   3. one gpu-defragd scan, dry run (report only, never signal or reset);
#   4. where `pip install vllm==0.32.0` works (or vLLM is already installed): the tiny generated
#      model on the GPU with zerolayer's GPU engine defaults, printing a table; then two models and a
#      LoRA adapter as an InferenceNode with one GPU deploys them (both engines on GPU 0, half the
#      memory fraction each).
# Run from the repository root:  bash bench/gpu_device_check.sh
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
$PY -c "import zerolayer" 2>/dev/null || step "install zerolayer" 120 $PY -m pip install -q -e . nvidia-ml-py

step "NVML readings and GPU map" 30 $PY bench/nvml_smoke.py --seconds 3
step "GPU source selection (auto)" 20 $PY -c '
import os, sys
from zerolayer.runtime.gpu.select import choose_source
source, why = choose_source(os.environ)
print(f"gpu.source auto -> {source}: {why}")
sys.exit(0 if source == "nvml" else 1)'
step "defragd dry run (one scan)" 30 $PY -m zerolayer.cli defragd --once --dry-run --pod-root $$ --log-level INFO

if ! $PY -c "import vllm" 2>/dev/null; then
  step "pip install vllm==0.32.0" 150 $PY -m pip install -q "vllm==0.32.0"
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
