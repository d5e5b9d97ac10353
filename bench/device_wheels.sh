#!/usr/bin/env bash
# The pure-Python wheels the runtime's request path needs besides torch, PyYAML and the standard library,
# into bench/.device-wheels/ (git-ignored, ~0.3 MB), for a GPU machine without network: run it here, then
# carry bench/.device-wheels with the device run; bench/gpu_device_check.sh puts them on PYTHONPATH
# (pure wheels import from the zip). Pinned to what this project's image installs.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download --quiet --no-deps --only-binary=:all: -d bench/.device-wheels \
  h11==0.16.0 h2==4.4.1 hpack==4.2.0 hyperframe==6.1.0 prometheus_client==0.26.0 nvidia-ml-py==13.615.71
ls -l bench/.device-wheels
