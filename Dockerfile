# The GPU flavour of the zerolayer image, for users with Docker (or `buildah bud`): the official vLLM
# (CUDA) on NVIDIA's CUDA base. One image for every zerolayer component; the command picks the part:
#   operator Deployment:  zerolayer operator ...
#   runtime pod:          zerolayer runtime ... | zerolayer defragd ... | zerolayer auditor ...
#
#   docker build -t zerolayer/zerolayer:0.1.0-gpu .
#
# Pinned: the CUDA base (vLLM 0.32's wheels use torch 2.13 built for CUDA 13.0; the driver comes from
# the host through the NVIDIA container toolkit) and vLLM itself. Bump them together.
#
# Not built or tested here: this project's machines have no Docker engine. The GPU image that is built
# and checked here is `hack/build-image.sh --flavour gpu` (the same vLLM from PyPI, with the CUDA libraries
# its wheels bring, on Debian instead of this CUDA base); `hack/push-images.sh` pushes it (docs/image.md).
ARG CUDA_IMAGE=nvidia/cuda:13.0.0-base-ubuntu24.04
ARG VLLM_VERSION=0.32.0

FROM ${CUDA_IMAGE} AS build
RUN apt-get update && apt-get install -y --no-install-recommends \
        python3 python3-venv python3-dev gcc libc6-dev systemtap-sdt-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY zerolayer zerolayer
COPY operator operator
COPY runtime runtime
COPY client client
COPY bpf bpf
# systemtap-sdt-dev above: the wheel carries the runtime's USDT probe extension (bpf/zerolayer/bpf/_probes.c).
RUN python3 -m venv /opt/build && /opt/build/bin/pip wheel --no-cache-dir --no-deps -w /wheels .

FROM ${CUDA_IMAGE}
ARG VLLM_VERSION
# bcc for the auditor comes from the distribution (it is not on PyPI); the venv sees it through
# --system-site-packages. libnuma1: vLLM's CPU-side kernels link it.
RUN apt-get update && apt-get install -y --no-install-recommends \
        python3 python3-venv python3-bpfcc libnuma1 ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv --system-site-packages /opt/zerolayer \
    && groupadd --gid 65532 nonroot && useradd --uid 65532 --gid 65532 --create-home nonroot
COPY --from=build /wheels /wheels
RUN /opt/zerolayer/bin/pip install --no-cache-dir "vllm==${VLLM_VERSION}" "$(ls /wheels/zerolayer-*.whl)[bpf]" \
    && rm -rf /wheels
# The pods run with a read-only root filesystem and an emptyDir on /tmp: caches and configs go there.
ENV PATH=/opt/zerolayer/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    XDG_CACHE_HOME=/tmp/.cache \
    XDG_CONFIG_HOME=/tmp/.config \
    VLLM_NO_USAGE_STATS=1
# Non-root by default (the operator and the server run as 65532); the auditor container adds the
# capabilities it needs in the pod spec.
USER 65532:65532
ENTRYPOINT ["zerolayer"]
CMD ["--help"]
