"""Offline check (no GPU needed; Triton's bundled ptxas) of every Triton kernel the presets run, compiled as their
real launches specialise them (benchmarks/triton_launch_compile.py: the host launch code runs on CPU tensors at
Kimi K2.6's shapes, each launch is intercepted and compiled with its signature, alignment hints and options):

- MLA (ddtree_serve/kernels/triton_mla*.py): bfloat16 over a bfloat16 and over an fp8 cache (latent 512 + rope
  64), TP 8 (8 local heads: decode, tree verify, split-K and its merge, the query-tiled extend) and DCP 8 (64
  gathered heads: the same through the DCP kernels), at the tiles ``choose_mla_tiles`` picks for the arch; with
  ``--invariant`` the same groups in the batch-invariant mode instead (``--enable-deterministic-inference``:
  "tp8-inv", "dcp8-inv", ddtree_serve/kernels/triton_mla_invariant.py, their own tiles and table);
- the sampling kernel (ddtree_serve/kernels/triton_sampling.py) at V 163,840;
- the batch-invariant GEMM (ddtree_serve/kernels/triton_invariant_gemm.py) at Kimi's dense-MLP shapes in
  bfloat16 (K 7168 -> N 2048 and back), the default model's 576 -> 1536 in float32 and the attention's batched
  P.V item in float32 (``gemm_launches``).
- the batch-invariant RMSNorm (ddtree_serve/kernels/triton_rmsnorm.py) in bfloat16 at the default model's hidden
  size (576) and Kimi's (7168).

Per kernel: ptxas's registers and spilled bytes, the cubin's shared memory, the arch's limit and the plan's
estimate (``mla_smem_bytes``). Exits 1 when a kernel spills, needs more shared memory than the arch has, or more
than the plan's estimate, or when the plan's figure is not the compiled one (``COMPILED_SMEM``; ``--table``
prints the figures to paste there).

    python benchmarks/triton_smem_check.py [--archs 90,100,103,120] [--caches bf16,fp8] [--jobs 2] [--table]
        [--invariant]

Run without ``TRITON_INTERPRET`` (the interpreter compiles nothing). ``compile_mla`` (the kernels without launch
hints, for benchmarks/triton_ir_dump.py's comparisons of a refactor) stays here.
"""

from __future__ import annotations

import argparse
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's packages, run from anywhere


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
    """``kernel`` (one of ``mla_kernels()``) compiled by Triton for ``sm<arch>`` at ``tiles`` (its num_warps);
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
    opts = dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=opts)


def mla_kernels() -> dict[str, object]:
    """The Triton MLA kernels that run the shared key loop (ddtree_serve/kernels/triton_mla_keys.py), by short name."""
    from ddtree_serve.kernels.triton_mla import _mla_kernel
    from ddtree_serve.kernels.triton_mla_dcp import _mla_dcp_kernel
    from ddtree_serve.kernels.triton_mla_split import _mla_split_kernel

    return {"single": _mla_kernel, "split": _mla_split_kernel, "dcp": _mla_dcp_kernel}


def _batch(mode, q_len: int, bs: int = 2, prefix: int = 100):  # noqa: ANN001, ANN202 - a ForwardBatch
    """A CPU ForwardBatch of ``bs`` requests with ``q_len`` new tokens after ~``prefix`` cached ones."""
    from ddtree_serve.model_executor.forward_batch import ForwardMode, build_forward_batch

    prefix_lens = torch.tensor([prefix + 7 * b for b in range(bs)])
    total = prefix_lens + q_len
    width = int(total.max())
    table = torch.arange(1, bs * width + 1).view(bs, width)  # [bs, K] slots
    new = torch.cat([table[b, int(prefix_lens[b]): int(total[b])] for b in range(bs)])
    tree = None
    if mode == ForwardMode.TARGET_VERIFY:
        tree = torch.tril(torch.ones(q_len, q_len, dtype=torch.bool)).expand(bs, q_len, q_len)
    z = torch.zeros(bs * q_len, dtype=torch.long)
    return build_forward_batch(mode, z, z, new, table, torch.arange(bs), prefix_lens, torch.full((bs,), q_len),
                               tree_mask=tree)


def mla_preset_launches(arch: int, fp8: bool, invariant: bool = False) -> list[tuple[str, object, object]]:
    """``(group, tiles, Launch)`` of every MLA launch the Kimi presets make on ``sm<arch>``: TP 8 (8 heads) and DCP
    8 (64 heads), decode / verify single-pass and split-K (with the merge), extend; bfloat16 queries over a
    bfloat16 (``fp8`` False) or fp8 cache, at the tiles the plan picks there. Duplicates are dropped.
    ``invariant``: the batch-invariant mode's launches instead (``--enable-deterministic-inference``;
    ddtree_serve/kernels/triton_mla_invariant.py: every mode at the decode tiles, one program per token or a
    split grid and its merge)."""
    from benchmarks.triton_launch_compile import capture_launches, launch_source
    from ddtree_serve.kernels import (
        triton_mla,
        triton_mla_dcp,
        triton_mla_extend,
        triton_mla_invariant,
        triton_mla_split,
    )
    from ddtree_serve.kernels.triton_mla_extend import EXTEND_ROWS
    from ddtree_serve.kernels.triton_mla_plan import SMEM_OPTIN_BYTES, choose_mla_tiles
    from ddtree_serve.model_executor.forward_batch import ForwardMode

    targets = {triton_mla: ("_mla_kernel",), triton_mla_dcp: ("_mla_dcp_kernel",),
               triton_mla_extend: ("_mla_extend_kernel",),
               triton_mla_split: ("_mla_split_kernel", "_mla_dcp_split_kernel", "_mla_merge_kernel")}
    if invariant:
        targets = {triton_mla_invariant: ("_mla_inv_kernel", "_mla_inv_merge_kernel")}
    lat, rope, slots = 512, 64, 4096
    limit = SMEM_OPTIN_BYTES[(arch // 10, arch % 10)]
    cache_dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    cache = torch.zeros(slots, 1, lat + rope, dtype=cache_dtype)  # [slots, 1, L + R]
    k_scale = torch.ones(slots, 2) if fp8 else None
    out, seen = [], set()
    for group, heads, dcp in (("tp8", 8, 1), ("dcp8", 64, 8)):
        group = group + "-inv" if invariant else group
        tiles = choose_mla_tiles(heads, lat, rope, torch.bfloat16, limit, arch, cache_dtype if fp8 else None,
                                 invariant)
        ext = choose_mla_tiles(max(heads, EXTEND_ROWS), lat, rope, torch.bfloat16, limit, arch,
                               cache_dtype if fp8 else None)
        for mode, q_len in ((ForwardMode.DECODE, 1), (ForwardMode.TARGET_VERIFY, 5), (ForwardMode.EXTEND, 16)):
            fb = _batch(mode, q_len)
            q = torch.zeros(fb.q_index.numel(), heads, lat + rope, dtype=torch.bfloat16)  # [T, H, L + R]
            args = (q, cache, fb.kv_indices, fb.attn_mask, fb.q_index, fb.prefix_lens, fb.extend_lens, lat, 0.1)
            t = ext if mode == ForwardMode.EXTEND and not invariant else tiles
            inv = dict(invariant=True, split_keys=64) if invariant else {}  # 64: several splits at these lengths
            for splits in ((1,) if mode == ForwardMode.EXTEND and not invariant else (1, 4)):
                with capture_launches(targets) as sink:
                    if dcp > 1:
                        triton_mla_dcp.MLA_DCP_KERNELS[mode.value](*args, dcp_size=dcp, dcp_rank=0, k_scale=k_scale,
                                                                   tiles=t, num_splits=splits, **inv)
                    else:
                        triton_mla.MLA_KERNELS[mode.value](*args, tiles=t, num_splits=splits, k_scale=k_scale, **inv)
                for launch in sink:
                    src, opts = launch_source(launch)
                    key = (launch.name, repr(sorted(src.constants.items())), repr(src.attrs), repr(opts))
                    if key not in seen:
                        seen.add(key)
                        out.append((group, t, launch))
    return out


def sampler_launch() -> object:
    """The sampling kernel's launch at V 163,840 (64 rows, float32 logits)."""
    from benchmarks.triton_launch_compile import capture_launches
    from ddtree_serve.kernels import triton_sampling

    n, vocab = 64, 163_840
    with capture_launches({triton_sampling: ("_sample_rows",)}) as sink:
        triton_sampling.triton_draw_sampled(torch.zeros(n, vocab), torch.ones(n), torch.full((n,), 40),
                                            torch.full((n,), 0.9), torch.zeros(n), torch.rand(n))
    return sink[0]


GEMM_SHAPES = ((torch.bfloat16, 7168, 2048), (torch.bfloat16, 2048, 7168), (torch.float32, 576, 1536))


def gemm_launches() -> list[object]:
    """The batch-invariant GEMM's launches (dtype, K, N of ``GEMM_SHAPES``, 5 rows: the tiles do not depend on M),
    and the batched form at the attention's P.V item shape (float32, [64 heads, 4 splits] x [16, 64] @ [64, 129])."""
    from benchmarks.triton_launch_compile import capture_launches
    from ddtree_serve.kernels import triton_invariant_gemm

    with capture_launches({triton_invariant_gemm: ("_invariant_gemm_kernel",)}) as sink:
        for dtype, k, n in GEMM_SHAPES:
            triton_invariant_gemm.invariant_gemm(torch.zeros(5, k, dtype=dtype), torch.zeros(n, k, dtype=dtype))
        triton_invariant_gemm.invariant_matmul(torch.zeros(1, 64, 4, 16, 64), torch.zeros(1, 64, 4, 64, 129))
    return sink


RMSNORM_HIDDEN = (576, 7168)  # the default model's hidden size, Kimi K2.6's


def rmsnorm_launches() -> list[tuple[str, None, object]]:
    """The batch-invariant RMSNorm's launches in bfloat16 at ``RMSNORM_HIDDEN`` (64 rows), one group each."""
    from benchmarks.triton_launch_compile import capture_launches
    from ddtree_serve.kernels import triton_rmsnorm

    todo = []
    for hidden in RMSNORM_HIDDEN:
        with capture_launches({triton_rmsnorm: ("_rmsnorm_kernel",)}) as sink:
            triton_rmsnorm.triton_rmsnorm(torch.zeros(64, hidden, dtype=torch.bfloat16),
                                          torch.ones(hidden, dtype=torch.bfloat16), 1e-6)
        todo.append((f"h{hidden}", None, sink[0]))
    return todo


def check_group(arch: int, cache: str, invariant: bool = False) -> list[dict]:
    """Compile one arch's launches for one cache kind (``cache`` "bf16" / "fp8"; "sampler": the sampling kernel;
    "gemm": the batch-invariant GEMM; "rmsnorm": the RMSNorm kernel): one row per kernel with its figures and
    verdict. ``invariant``: the MLA launches of the batch-invariant mode instead (``mla_preset_launches``; their
    rows' group ends in "-inv")."""
    from benchmarks.triton_launch_compile import compile_launch, launch_source
    from ddtree_serve.kernels.triton_mla_plan import SMEM_OPTIN_BYTES

    limit = SMEM_OPTIN_BYTES[(arch // 10, arch % 10)]
    if cache == "sampler":
        todo = [("sampler", None, sampler_launch())]
    elif cache == "gemm":
        todo = [(f"K{la.args[6]}N{la.args[5]}", None, la) for la in gemm_launches()]
    elif cache == "rmsnorm":
        todo = rmsnorm_launches()
    else:
        todo = mla_preset_launches(arch, cache == "fp8", invariant)
    rows = []
    for group, tiles, launch in todo:
        st = compile_launch(launch, arch)
        src, _ = launch_source(launch)
        names = launch.kernel.arg_names
        tree = src.constants.get((names.index("TREE"),)) if "TREE" in names else None
        partial = "PARTIAL" in names and src.constants.get((names.index("PARTIAL"),))
        rows.append(dict(arch=arch, cache=cache, group=group, kernel=launch.name + ("/split" if partial else ""),
                         tree=tree,
                         tiles=f"{tiles.block_h}x{tiles.block_n}" if tiles else "-", warps=st.num_warps,
                         shared=st.shared, registers=st.registers, spills=st.spill_bytes, limit=limit,
                         estimate=tiles.smem_bytes if tiles else None))
    return rows


def verdict(rows: list[dict]) -> list[str]:
    """The failures among ``rows``: spills, shared memory over the arch's limit or over the plan's estimate, and a
    plan figure that is not the largest compiled one of its tiles (the plan's ``COMPILED_SMEM``)."""
    bad = []
    for r in rows:
        name = f"sm{r['arch']} {r['cache']} {r['group']} {r['kernel']} {r['tiles']}"
        if r["spills"]:
            bad.append(f"{name}: {r['spills']} B spilled")
        if r["shared"] > r["limit"]:
            bad.append(f"{name}: {r['shared']:,} B of shared memory > the limit {r['limit']:,}")
        if r["estimate"] is not None and r["shared"] > r["estimate"]:
            bad.append(f"{name}: {r['shared']:,} B of shared memory > the plan's {r['estimate']:,}")
    for key, top in compiled_table(rows).items():
        est = {r["estimate"] for r in rows if (r["arch"], r["cache"], r["tiles"]) == key}
        if est != {top}:
            bad.append(f"sm{key[0]} {key[1]} {key[2]}: the plan says {sorted(est)}, the largest cubin {top:,} B")
    return bad


def compiled_table(rows: list[dict]) -> dict[tuple[int, str, str], int]:
    """The largest cubin shared memory per (arch, cache, tiles) over the MLA kernels compiled."""
    top: dict[tuple[int, str, str], int] = {}
    for r in rows:
        if r["cache"] in ("bf16", "fp8"):
            key = (r["arch"], r["cache"], r["tiles"])
            top[key] = max(top.get(key, 0), r["shared"])
    return top


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--archs", default="90,100,103,120")
    ap.add_argument("--caches", default="bf16,fp8,sampler,gemm,rmsnorm",
                    help="bf16, fp8 (MLA over that cache), sampler, gemm (the batch-invariant GEMM), rmsnorm")
    ap.add_argument("--jobs", type=int, default=2, help="processes compiling in parallel")
    ap.add_argument("--table", action="store_true", help="print the compiled figures as COMPILED_SMEM entries")
    ap.add_argument("--invariant", action="store_true",
                    help="the batch-invariant mode's MLA kernels (--enable-deterministic-inference) instead; --table "
                         "then prints COMPILED_SMEM_INVARIANT's entries")
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: the interpreter compiles nothing")
        return 2
    import triton

    groups = [(int(a), c) for a in args.archs.split(",") for c in args.caches.split(",")]
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = list(pool.map(check_group, *zip(*groups, strict=True), [args.invariant] * len(groups)))
    rows = [r for group in results for r in group]
    print(f"Triton {triton.__version__}")
    for r in rows:
        print(f"sm{r['arch']} {r['cache']:7} {r['group']:8} {r['kernel']:22} tree={r['tree']!s:5} tiles {r['tiles']:5} "
              f"w{r['warps']}: cubin {r['shared']:7,} B, estimate {r['estimate'] or 0:7,} B, limit {r['limit']:7,} B, "
              f"{r['registers']:3} registers, {r['spills']:,} B spilled")
    if args.table:
        for (arch, cache, tiles), shared in sorted(compiled_table(rows).items()):
            bh, bn = tiles.split("x")
            print(f"    ({arch}, {cache!r}, {bh}, {bn}): {shared},")
    bad = verdict(rows)
    for line in bad:
        print("FAIL", line)
    print("ALL OK" if not bad else "FAILED")
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
