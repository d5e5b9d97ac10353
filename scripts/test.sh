#!/usr/bin/env bash
# The whole test suite on a fresh machine: set up what it needs (scripts/setup.sh, idempotent), then
# the unit, integration and e2e tiers (e2e brings up and takes down its own local control plane).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh tests/unit -x`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec python3 -m pytest -q --durations=30 "$@"
