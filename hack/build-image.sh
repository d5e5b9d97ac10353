#!/usr/bin/env bash
# Build (or reuse from the cache) the runtime image without Docker or a registry, and print
# "<tag> <archive>". The archive is a docker-archive tarball for `ctr -n k8s.io images import`.
#   hack/build-image.sh                        # zerolayer/zerolayer:<version>-cpu
#   hack/build-image.sh --flavour gpu          # zerolayer/zerolayer:<version>-gpu (official CUDA vLLM)
#   hack/build-image.sh --import-to /path/to/containerd.sock
# Needs root and mmdebstrap (apt-get install -y mmdebstrap). Cache: ${ZEROLAYER_CACHE:-~/.cache/zerolayer}/images.
# The logic (and its contract) is in zerolayer/cluster/image.py; see docs/image.md.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python3 -m zerolayer.cluster.image "$@"
