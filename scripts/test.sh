#!/usr/bin/env bash
# The whole test suite: unit, integration and e2e tiers (e2e brings up the local control plane).
set -euo pipefail
cd "$(dirname "$0")/.."
exec python3 -m pytest -q "$@"
