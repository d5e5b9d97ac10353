#!/usr/bin/env bash
# crds/ is the source of truth; the chart carries a byte-identical copy (tests/unit/test_crds.py checks it).
set -euo pipefail
cd "$(dirname "$0")/.."
rm -f helm/zerolayer/crds/*.yaml
cp crds/*.yaml helm/zerolayer/crds/
