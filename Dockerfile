# syntax=docker/dockerfile:1
# ddtree-serve on CUDA 13 (B300 sm103, RTX PRO 6000 sm120, H100/H200 sm90, B200 sm100).
#   docker build -t ddtree-serve .
#   docker run --gpus all --ipc=host -p 30000:30000 -v <models>:/models \
#       -v ddtree-flashinfer:/root/.cache/flashinfer ddtree-serve \
#       serve --config configs/kimi-k2.6-8x-b300.yaml
# The devel image is deliberate: flashinfer JIT-compiles its kernels (at server start-up, before /health
# turns 200, for the GPU in use only: the server sets FLASHINFER_CUDA_ARCH_LIST from the detected device
# when it is unset), so nvcc and ninja must stay in the runtime image. Keep the compiled kernels across
# containers with a volume: -v ddtree-flashinfer:/root/.cache/flashinfer (docs/DEPLOY.md). Versions below
# must agree with pyproject.toml's `cuda` extra and torch range (tests/parallel/test_deploy_files.py).
FROM nvidia/cuda:13.0.2-devel-ubuntu24.04

ARG PYTHON_VERSION=3.12
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130
ARG SGLANG_KERNEL_VERSION=0.4.6.post1
ARG FLASHINFER_VERSION=0.7.2.post1

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    FLASHINFER_WORKSPACE_BASE=/root \
    HF_HOME=/root/.cache/huggingface

# Python 3.12 (Ubuntu 24.04's), ninja for the flashinfer JIT, git for pip VCS fallbacks. Ubuntu point
# releases replace these package versions, so they follow the base image's tag instead of exact pins.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        python${PYTHON_VERSION} python${PYTHON_VERSION}-venv python${PYTHON_VERSION}-dev \
        ninja-build git ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python${PYTHON_VERSION} -m venv ${VIRTUAL_ENV}

# torch's CUDA 13.0 build first (PyPI's default torch wheel would be another CUDA line), then the
# kernels built against that torch: sglang-kernel (import name sgl_kernel) is a libtorch extension and
# only loads with the torch it was built for; flashinfer JIT-compiles against whatever torch is installed.
RUN pip install --upgrade pip==25.3 setuptools==80.9.0 wheel==0.45.1 \
    && pip install torch==${TORCH_VERSION} --index-url ${TORCH_INDEX_URL} \
    && pip install sglang-kernel==${SGLANG_KERNEL_VERSION} flashinfer-python==${FLASHINFER_VERSION} ninja==1.13.0

WORKDIR /app
COPY pyproject.toml README.md ./
COPY ddtree_serve ./ddtree_serve
COPY benchmarks ./benchmarks
COPY configs ./configs
COPY docs ./docs
# This project; torch is installed above (pyproject bounds it: >=2.11), the cuda extra is pinned.
# hadolint ignore=DL3013
RUN pip install ".[cuda]"

EXPOSE 30000
HEALTHCHECK --interval=30s --timeout=10s --start-period=1800s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:30000/health', timeout=8).status == 200 else 1)"]
ENTRYPOINT ["ddtree-serve"]
CMD ["--help"]
