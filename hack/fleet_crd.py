#!/usr/bin/env python3
"""Copy InferenceNode's spec fields (models, runtime, scheduler, gossip, defrag, audit) into the
InferenceFleet CRD, so a fleet's model set has exactly an InferenceNode's shape. hack/sync-crds.sh runs
it; tests/unit/operator/test_fleet.py checks the copies are identical."""

from __future__ import annotations

import pathlib

import yaml

REPO = pathlib.Path(__file__).resolve().parent.parent
FIELDS = ("models", "runtime", "scheduler", "gossip", "defrag", "audit")
HEADER = ("# Source of truth for the InferenceFleet CRD. spec.models, runtime, scheduler, gossip, defrag and audit are\n"
          "# copies of InferenceNode's spec fields written by hack/fleet_crd.py (run by hack/sync-crds.sh).\n")


def main() -> None:
    inode = yaml.safe_load((REPO / "crds/inferencenodes.zerolayer.io.yaml").read_text())
    target = REPO / "crds/inferencefleets.zerolayer.io.yaml"
    fleet = yaml.safe_load(target.read_text())
    source = inode["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    spec = fleet["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    for field in FIELDS:
        spec[field] = source[field]
    target.write_text(HEADER + yaml.safe_dump(fleet, sort_keys=False, width=120))


if __name__ == "__main__":
    main()
