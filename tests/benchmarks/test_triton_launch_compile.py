"""benchmarks/triton_launch_compile.py without compiling: the launches it intercepts from the host launch code and
the signature, alignment hints, constexprs and options it gives them (the compiled kernels themselves:
benchmarks/triton_smem_check.py, the slow test in tests/kernels/test_triton_mla_plan.py). Runs in a child
without ``TRITON_INTERPRET`` (the interpreter's kernels are not ``JITFunction``s)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_CHILD = r"""
import json, torch
from benchmarks.triton_launch_compile import capture_launches, launch_source
from ddtree_serve.kernels import triton_sampling
from benchmarks.triton_smem_check import mla_preset_launches, rmsnorm_launches

out = {}
for vocab in (163840, 163841):
    n = 4
    with capture_launches({triton_sampling: ("_sample_rows",)}) as sink:
        got = triton_sampling.triton_draw_sampled(torch.zeros(n, vocab), torch.ones(n), torch.full((n,), 40),
                                                  torch.full((n,), 0.9), torch.zeros(n), torch.rand(n))
    src, opts = launch_source(sink[0])
    names = sink[0].kernel.arg_names
    out[vocab] = dict(n=len(sink), sig=src.signature, hinted=sorted(names[k[0]] for k in src.attrs),
                      const={names[k[0]]: v for k, v in src.constants.items()}, opts=opts)
from ddtree_serve.kernels import triton_invariant_gemm
with capture_launches({triton_invariant_gemm: ("_invariant_gemm_kernel",)}) as sink:
    triton_invariant_gemm.invariant_gemm(torch.zeros(16, 7168, dtype=torch.bfloat16), torch.zeros(2048, 7168, dtype=torch.bfloat16))
src, opts = launch_source(sink[0])
names = sink[0].kernel.arg_names
out["gemm"] = dict(hinted=sorted(names[k[0]] for k in src.attrs), opts=opts,
                   const={names[k[0]]: v for k, v in src.constants.items()})
launches = mla_preset_launches(90, False)
out["mla"] = sorted({(l.name, str(t.block_h), str(l.kwargs.get("num_warps"))) for _, t, l in launches})
inv = mla_preset_launches(90, True, invariant=True)
out["inv"] = sorted({(l.name, t.block_h, t.block_n, l.kwargs.get("num_warps"), l.kwargs.get("num_stages"),
                      l.kwargs.get("enable_fp_fusion"), bool(l.kwargs.get("PARTIAL")), bool(l.kwargs.get("TREE")))
                     for _, t, l in inv})
out["inv_opts"] = sorted({json.dumps(launch_source(l)[1], sort_keys=True) for _, _, l in inv})
rms = []
for group, _, l in rmsnorm_launches():
    src, opts = launch_source(l)
    rms.append(dict(group=group, grid=list(l.grid), x=src.signature["x_ptr"], opts=opts,
                    const={l.kernel.arg_names[k[0]]: v for k, v in src.constants.items()}))
out["rms"] = rms
print(json.dumps(out))
"""


def test_launches_are_specialised_as_the_launcher_would() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    p = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    even, odd = out["163840"], out["163841"]
    assert even["n"] == 1 and even["sig"]["logits_ptr"] == "*fp32" and even["sig"]["V"] == "i32"
    assert even["sig"]["BLOCK"] == "constexpr" and even["const"] == {"BLOCK": 1024, "HBLOCK": 64, "NB": 256, "CAP": 4096}
    assert even["opts"] == {"num_warps": 8}
    # 16-byte aligned tensors and integers divisible by 16 carry tt.divisibility, others do not
    assert {"logits_ptr", "stride", "V", "out_ptr"} <= set(even["hinted"])
    assert "V" not in odd["hinted"] and "stride" not in odd["hinted"]
    # the invariant GEMM: M (16 here) is never specialised, so every M runs one compiled kernel; fp fusion fixed off
    gemm = out["gemm"]
    assert "M" not in gemm["hinted"] and {"x_ptr", "w_ptr", "K", "N", "stride_xm"} <= set(gemm["hinted"])
    assert gemm["opts"] == {"num_warps": 4, "num_stages": 3, "enable_fp_fusion": False}
    assert {k: gemm["const"][k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K")} == {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64}
    # the MLA launches of the presets on sm90 (bfloat16 cache): TP 8 and DCP 8, every kernel, 8 warps
    names = {name for name, _, _ in out["mla"]}
    assert names == {"_mla_kernel", "_mla_split_kernel", "_mla_merge_kernel", "_mla_extend_kernel", "_mla_dcp_kernel",
                     "_mla_dcp_split_kernel"}
    for name, block_h, warps in out["mla"]:
        assert int(block_h) <= 32 and warps == ("4" if name == "_mla_merge_kernel" else "8"), (name, block_h, warps)
    # the batch-invariant mode over an fp8 cache: one kernel (single program and split grid, causal and tree) and
    # its merge, 16 x 16 tiles at one stage, no FP fusion, and that option reaches the compile
    inv = {tuple(r) for r in out["inv"]}
    attend = {r for r in inv if r[0] == "_mla_inv_kernel"}
    assert {(r[6], r[7]) for r in attend} == {(False, False), (False, True), (True, False), (True, True)}
    assert {r[1:6] for r in attend} == {(16, 16, 8, 1, False)}
    assert {r[0] for r in inv} == {"_mla_inv_kernel", "_mla_inv_merge_kernel"}
    assert all(json.loads(o)["enable_fp_fusion"] is False for o in out["inv_opts"])
    # the RMSNorm (bfloat16, 64 rows) at the default model's and Kimi's hidden sizes: one program per row, chunks of
    # 1024, a fixed warp count and no FP fusion
    assert [r["group"] for r in out["rms"]] == ["h576", "h7168"]
    for r in out["rms"]:
        assert r["grid"] == [64] and r["x"] == "*bf16" and r["const"] == {"BLOCK": 1024}, r
        assert r["opts"] == {"num_warps": 4, "enable_fp_fusion": False}, r
