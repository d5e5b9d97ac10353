#!/usr/bin/env bash
# crds/ is the source of truth; the chart carries a byte-identical copy (tests/unit/test_crds.py checks it).
# InferenceFleet's model-set fields are copied from InferenceNode's first (hack/fleet_crd.py).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 hack/fleet_crd.py
rm -f helm/zerolayer/crds/*.yaml
cp crds/*.yaml helm/zerolayer/crds/
