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
# default model with CUDA kernels, ddtree on: greedy lossless vs none, tokens/s and tau (skips, exit 2,
# when the default model is not cached: nothing is fetched)
rc=0; timeout 240 python benchmarks/gpu_ddtree_check.py --out bench_out/gpu_ddtree.json || rc=$?
if [ "$rc" -ne 0 ] && [ "$rc" -ne 2 ]; then status=$rc; fi
exit $status
