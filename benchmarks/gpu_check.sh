#!/usr/bin/env bash
# The GPU check for a lent machine: one GPU, offline, its own torch and Triton, nothing installed (the
# repository is importable from its root). Runs benchmarks/gpu_check.py: every part of
# benchmarks/gpu/registry.py in its own process, by value (comparisons against a reference first, compiles and
# speed last), under a deadline (default 525 s, DDTREE_GPU_CHECK_DEADLINE_S) so the whole check ends before 9
# minutes; the Kimi K2.6-shaped random checkpoint it checks is written on the
# device (benchmarks/gpu/kimi_checkpoint.py), nothing is downloaded. Results: $OUT/gpu_check.json if OUT is
# set, else bench_out/gpu_check.json, rewritten as each part finishes (PASS / FAIL / NOT AVAILABLE with the
# reason / NOT RUN (time), wall time, numbers, backends), the parts' logs in part_logs.txt, the whole output in
# gpu_check.log: three files. Options are passed on: --parts a,b --deadline-s S --work DIR (see docs/BENCHMARKS.md "GPU").
# Exit status: 1 when a part failed, else 2 when CUDA is not available (on a CPU machine every part is
# NOT AVAILABLE), else 0.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PIP_NO_INDEX=1
unset DDTREE_REQUIRE_CUDA_KERNELS  # fallbacks are allowed: each part reports the backend that ran
export DDTREE_ALLOW_TORCH_TREE_WALK=1  # sgl-kernel may not load there: the reference walk, reported as such
OUT_DIR=${OUT:-bench_out}
mkdir -p "$OUT_DIR"
PY=${PYTHON:-python3}
# the outer timeout is a last resort (the driver's own deadline ends it first); the JSON is already written
timeout -k 5 535 "$PY" benchmarks/gpu_check.py --out "$OUT_DIR" "$@" 2>&1 | tee "$OUT_DIR/gpu_check.log"
exit "${PIPESTATUS[0]}"
