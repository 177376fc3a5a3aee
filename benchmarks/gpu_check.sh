#!/usr/bin/env bash
# One-shot check for a single-GPU machine without network (< 5 minutes): the CUDA kernel paths against
# the PyTorch reference, then a quick kernel benchmark on the device. Fetches nothing: the forward
# baseline column is skipped unless the default model is already in the cache.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PIP_NO_INDEX=1
mkdir -p bench_out
status=0
timeout 180 python -m pytest -m gpu tests/gpu -q -p no:cacheprovider || status=$?
timeout 100 python benchmarks/bench_kernels.py --quick --device cuda --no-model-fetch \
  --out bench_out/kernels_cuda.json || status=$?
exit $status
