"""Offline check (no GPU needed; Triton's bundled ptxas): compile the Triton MLA kernels
(ddtree_serve/kernels/triton_mla.py, ddtree_serve/kernels/triton_mla_split.py, ddtree_serve/kernels/triton_mla_dcp.py at DCP 8) for each GPU
architecture at the tiles ``ddtree_serve/kernels/triton_mla_plan.choose_mla_tiles`` picks there, and compare the shared
memory of the cubin with the device's limit and with the plan's estimate; ptxas's registers per thread and
spilled bytes are printed beside it (a refactor of the kernels must leave all three unchanged;
benchmarks/triton_ir_dump.py compares their LLVM IR and PTX before and after one).

    python benchmarks/triton_smem_check.py [--archs 90,100,103,120] [--heads 8,64]

Kimi K2.6 latent (512 + rope 64), float32 / bfloat16, and bfloat16 over an fp8 KV cache. Exits 1 when a
chosen configuration does not fit or the estimate lies below the cubin. Run without ``TRITON_INTERPRET`` (the
interpreter compiles nothing).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import sys
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CubinStats:
    shared: int  # bytes of shared memory (static + dynamic) the launch needs
    registers: int  # per thread
    spill_bytes: int  # ptxas's spill stores + spill loads


def _signature(kernel, ptr: str, const: dict, cache_ptr: str | None = None) -> dict[str, str]:
    typed = {
        "cache_ptr": cache_ptr or ptr,
        "scale_ptr": "*fp32" if cache_ptr else cache_ptr or ptr,
        "kv_idx_ptr": "*i64",
        "mask_ptr": "*u8",
        "tok_req_ptr": "*i64",
        "tok_pos_ptr": "*i64",
        "kv_len_ptr": "*i32",
        "prefix_ptr": "*i64",
        "o_part_ptr": "*fp32",
        "lse_ptr": "*fp32",
    }
    sig = {}
    for name in kernel.arg_names:
        if name in const:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = typed.get(name, ptr)
        else:
            sig[name] = "fp32" if name == "sm_scale_log2" else "i32"
    return sig


DCP_SIZE = 8  # the DCP kernel's shard filter is compiled for Kimi K2.6's DCP 8


def compile_mla(
    kernel, dtype: torch.dtype, arch: int, tiles, lat: int, rope: int, fp8: bool = False, tree: bool = False
):  # noqa: ANN201 (triton's CompiledKernel)
    """``kernel`` (one of ``mla_kernels()``) compiled by Triton for ``sm<arch>`` at ``tiles`` (num_warps 4);
    ``fp8``: over an fp8 cache (float8e4nv rows and float32 scales) read into ``dtype`` tiles; ``tree``: the
    tree-verify mask. Its ``asm`` holds every stage (ttir, ttgir, llir, ptx, cubin)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    const = dict(
        L=lat,
        R=rope,
        TREE=tree,
        FP8=fp8,
        PRECISION="ieee" if dtype == torch.float32 else "tf32",
        UPCAST_DOT=False,
        BLOCK_H=tiles.block_h,
        BLOCK_N=tiles.block_n,
        BLOCK_L=tiles.block_l,
        BLOCK_R=tiles.block_r,
    )
    if "DCP_SIZE" in kernel.arg_names:
        const["DCP_SIZE"] = DCP_SIZE
    ptr = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16"}[dtype]
    src = ASTSource(kernel, _signature(kernel, ptr, const, "*fp8e4nv" if fp8 else None), constexprs=const)
    opts = dict(num_warps=4, num_stages=tiles.num_stages)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=opts)


def cubin_stats(
    kernel, dtype: torch.dtype, arch: int, tiles, lat: int, rope: int, fp8: bool = False
) -> CubinStats:
    """Compile ``kernel`` (``compile_mla``) and read its shared memory (``metadata.shared``) and ptxas's
    register and spill counts. Always compiles (Triton's cache would skip ptxas)."""
    import triton

    knobs = triton.knobs
    saved = (knobs.compilation.always_compile, knobs.nvidia.dump_ptxas_log)
    knobs.compilation.always_compile, knobs.nvidia.dump_ptxas_log = True, True
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log):  # ptxas -v's log, printed by Triton's CUDA backend
            shared = int(compile_mla(kernel, dtype, arch, tiles, lat, rope, fp8).metadata.shared)
    finally:
        knobs.compilation.always_compile, knobs.nvidia.dump_ptxas_log = saved
    text = log.getvalue()
    regs = re.search(r"Used (\d+) registers", text)
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", text)]
    if regs is None or not spills:
        raise RuntimeError(f"no register / spill counts in ptxas's log:\n{text}")
    return CubinStats(shared, int(regs.group(1)), sum(spills))


def mla_kernels() -> dict[str, object]:
    """The Triton MLA kernels that run the shared key loop (ddtree_serve/kernels/triton_mla_keys.py), by short name."""
    from ddtree_serve.kernels.triton_mla import _mla_kernel
    from ddtree_serve.kernels.triton_mla_dcp import _mla_dcp_kernel
    from ddtree_serve.kernels.triton_mla_split import _mla_split_kernel

    return {"single": _mla_kernel, "split": _mla_split_kernel, "dcp": _mla_dcp_kernel}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--archs", default="90,100,103,120")
    ap.add_argument("--heads", default="8,64")
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: the interpreter compiles nothing")
        return 2
    from ddtree_serve.kernels.triton_mla_plan import SMEM_OPTIN_BYTES, choose_mla_tiles

    ok = True
    for arch in (int(a) for a in args.archs.split(",")):
        limit = SMEM_OPTIN_BYTES[(arch // 10, arch % 10)]
        for dtype, fp8 in ((torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)):
            cache = torch.float8_e4m3fn if fp8 else None
            for heads in (int(h) for h in args.heads.split(",")):
                tiles = choose_mla_tiles(heads, 512, 64, dtype, limit, arch, cache)
                for kname, kernel in mla_kernels().items():
                    st = cubin_stats(kernel, dtype, arch, tiles, 512, 64, fp8)
                    shared = st.shared
                    # the DCP kernel's cubin may exceed the estimate by its shard filter's scratch (sm120,
                    # 64 heads: 128 B): only the device's limit is required of it
                    good = shared <= limit and (shared <= tiles.smem_bytes or kname == "dcp")
                    ok &= good
                    name = f"{dtype}{'/fp8 KV' if fp8 else ''}"
                    print(
                        f"sm{arch} {name:22} heads {heads:3} {kernel.__name__:18} tiles "
                        f"{tiles.block_h}x{tiles.block_n}: cubin {shared:7,} B, estimate "
                        f"{tiles.smem_bytes:7,} B, limit {limit:7,} B, {st.registers:3} registers, "
                        f"{st.spill_bytes:,} B spilled {'ok' if good else 'FAIL'}"
                    )
    print("ALL OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
