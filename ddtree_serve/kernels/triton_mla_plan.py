"""Launch plan of the Triton MLA kernels (ddtree_serve/kernels/triton_mla.py, ddtree_serve/kernels/triton_mla_split.py): tile sizes
that fit the device's shared memory, and how many key splits (flash-decoding) a launch uses. Pure rules
over shapes and device facts, so they are tested on CPU (tests/kernels/test_triton_mla_plan.py).

Tiles. One program holds a ``[BLOCK_H, L + R]`` query tile and a ``[BLOCK_N, L + R]`` key tile in shared
memory (the latent serves as K and V), plus a small scratch tile, and a float32 ``[BLOCK_H, L]`` accumulator in
registers. Registers bound the rows: at L 512 a program of 64 rows spills 1.5-7 KB per thread at 4 warps and
0.2-0.8 KB at 8, one of 32 rows spills at 4 warps and not at 8, and over an fp8 cache (its raw tile and the
dequantization) 32 rows spill ~1 KB at 8 warps; so ``BLOCK_H`` is at most ``MAX_BLOCK_H`` 32
(``MAX_BLOCK_H_FP8`` 16) and every program runs ``MLA_NUM_WARPS`` 8 warps (benchmarks/triton_smem_check.py,
Triton 3.9, with the launch's alignment hints, sm90 / sm100 / sm103 / sm120: no spill).

Shared memory: for the presets' tiles (bfloat16 queries, L 512, R 64) the compiled figure, the largest cubin
over the kernels a preset launches (``COMPILED_SMEM``, which benchmarks/triton_smem_check.py fails on when it
is not the compiled one): bfloat16 cache 16 x 32 56,320 B, 32 x 32 76,032 B; fp8 cache 16 x 32 86,528 B, the
same on every arch. Elsewhere (float32, other latents) ``mla_smem_bytes`` estimates from the tiles, as read
from Triton 3.9 cubins without launch hints at 4 warps (sm120, num_stages 2, L 512, R 64):

==========  =======  =======  ==========  ==========
dtype       BLOCK_H  BLOCK_N  cubin (B)   estimate
==========  =======  =======  ==========  ==========
float32     16       32       112,704     112,704
float32     16       16       74,816      74,816
float32     32       16       112,768     112,768
float32     64       16       188,672     188,672
==========  =======  =======  ==========  ==========

Over an fp8 cache the estimate adds ``BLOCK_N x ((L + R) + 4 R + 128)`` (960 B per key row) for the fp8 tile as
loaded and the float32 scratch of the dequantization; on datacenter Blackwell (sm100 / sm103, or an unknown
arch) 16-bit tiles of 64 heads take a second key tile. So float32 at ``BLOCK_H 16 / BLOCK_N 32`` (Kimi K2.6 at
TP 8: 8 local heads) needs 112,704 B, more than sm120's 101,376 (RTX PRO 6000). ``choose_mla_tiles`` keeps
``BLOCK_H`` and shrinks ``BLOCK_N`` (32, then 16) before it splits the heads further (``BLOCK_H`` 32 -> 16);
None when even 16 x 16 does not fit (then the backend resolution picks the torch reference,
ddtree_serve/model_executor/kernel_backends.py). Without a limit (CPU, Triton's interpreter) it keeps the
preferred tiles.

Splits. A decode step at small batch launches few programs (batch 1 at TP 8: one program per layer) and
each walks the whole context. ``choose_kv_splits`` splits the keys of each program into chunks walked by
separate programs, merged by their log-sum-exp, when the context is long and the launch would not fill the
GPU on its own. It reads only host-known sizes (the key columns of ``kv_indices``, not the lengths on the
device), so a CUDA graph captured at a size keeps a valid split count.

Batch-invariant mode (ddtree_serve/kernels/triton_mla_invariant.py): splits of a fixed ``INVARIANT_SPLIT_KEYS``
positions, whatever the batch (``invariant_split_grid`` only chooses whether one program or one per split walks
them: same bits), and its own tiles (``choose_mla_tiles(.., invariant=True)``, ``COMPILED_SMEM_INVARIANT``).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

# opt-in shared memory per block (bytes) by compute capability, from the CUDA programming guide; used when
# torch does not report ``shared_memory_per_block_optin``
SMEM_OPTIN_BYTES = {
    (8, 0): 166_912,
    (8, 6): 101_376,
    (8, 7): 166_912,
    (8, 9): 101_376,
    (9, 0): 232_448,
    (10, 0): 232_448,
    (10, 3): 232_448,
    (12, 0): 101_376,
    (12, 1): 101_376,
}
MAX_BLOCK_H = 32  # rows per program: at 64 the float32 [64, L 512] accumulator spills at 4 and at 8 warps
MAX_BLOCK_H_FP8 = 16  # over an fp8 cache the raw tile and its dequantization add registers: 32 rows spill ~1 KB
MLA_NUM_WARPS = 8  # at 4 warps 32-row tiles spill (and 16-row extend tiles); at 8 none do (triton_smem_check.py)
# batch-invariant mode: rows per program. Its single program holds two float32 [BLOCK_H, L] accumulators (the
# split's and the running merge's): at 32 rows, L 512, 8 warps ptxas spills 120-152 B (sm90, 64 DCP heads); at 16
# none (benchmarks/triton_smem_check.py --invariant)
INVARIANT_MAX_BLOCK_H = 16
MIN_SPLIT_KEYS = 512  # a split walks at least this many keys (its merge costs one [BLOCK_H, L] row)
MAX_SPLITS = 64
SPLIT_MIN_CONTEXT = 2 * MIN_SPLIT_KEYS  # shorter contexts never split


@dataclass(frozen=True)
class MlaTiles:
    block_h: int
    block_n: int
    block_l: int
    block_r: int
    smem_bytes: int  # estimate (mla_smem_bytes)
    num_stages: int = 2
    num_warps: int = 4


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


# Shared memory of the compiled MLA kernels, bytes: the largest over the kernels a preset launches (decode, verify,
# split-K and merge, extend; TP 8 and DCP 8) at bfloat16 queries, latent 512 + rope 64, MLA_NUM_WARPS warps,
# with the launch's alignment hints, Triton 3.9 (``python benchmarks/triton_smem_check.py --table``, which fails
# when a figure here is not the compiled one). Key: (arch, cache "bf16" / "fp8", BLOCK_H, BLOCK_N).
COMPILED_SMEM = {
    (90, "bf16", 16, 32): 56320,
    (90, "bf16", 32, 32): 76032,
    (90, "fp8", 16, 32): 86528,
    (100, "bf16", 16, 32): 56320,
    (100, "bf16", 32, 32): 76032,
    (100, "fp8", 16, 32): 86528,
    (103, "bf16", 16, 32): 56320,
    (103, "bf16", 32, 32): 76032,
    (103, "fp8", 16, 32): 86528,
    (120, "bf16", 16, 32): 56320,
    (120, "bf16", 32, 32): 76032,
    (120, "fp8", 16, 32): 86528,
}
# The same for the batch-invariant kernels (ddtree_serve/kernels/triton_mla_invariant.py: decode, verify, extend,
# single program and split grid with its merge; ``triton_smem_check.py --invariant --table``), at their tiles
# (``choose_mla_tiles(.., invariant=True)``: at most 16 rows; over an fp8 cache 16-key tiles and one stage).
COMPILED_SMEM_INVARIANT = {
    (90, "bf16", 16, 32): 56576,
    (90, "fp8", 16, 16): 34816,
    (100, "bf16", 16, 32): 56576,
    (100, "fp8", 16, 16): 34816,
    (103, "bf16", 16, 32): 56576,
    (103, "fp8", 16, 16): 34816,
    (120, "bf16", 16, 32): 56576,
    (120, "fp8", 16, 16): 34816,
}


def compiled_smem_bytes(block_h: int, block_n: int, block_l: int, block_r: int, dtype: torch.dtype,
                        arch: int | None = None, cache_dtype: torch.dtype | None = None,
                        invariant: bool = False) -> int | None:
    """``COMPILED_SMEM``'s figure for these tiles (``COMPILED_SMEM_INVARIANT``'s for the batch-invariant
    kernels; None when it has none: another dtype, latent or tile); an unknown ``arch`` takes the largest over
    the archs compiled."""
    if dtype != torch.bfloat16 or (block_l, block_r) != (512, 64):
        return None
    cache = "fp8" if cache_dtype is not None and cache_dtype.itemsize == 1 else "bf16"
    table = COMPILED_SMEM_INVARIANT if invariant else COMPILED_SMEM
    found = [v for (a, c, bh, bn), v in table.items()
             if (c, bh, bn) == (cache, block_h, block_n) and (arch is None or a == arch)]
    return max(found) if found else None


def mla_smem_bytes(
    block_h: int, block_n: int, block_l: int, block_r: int, dtype: torch.dtype, arch: int | None = None,
    cache_dtype: torch.dtype | None = None, invariant: bool = False,
) -> int:
    """Estimated shared memory of one MLA program (module docstring): the query and key tiles in the cache
    dtype (``dtype``; with an fp8 ``cache_dtype`` the tiles are dequantized to ``dtype`` and the raw fp8 tile
    and its scratch are added), plus the scratch tile (float32 ``[BLOCK_H, BLOCK_N]`` and a row; at least 4 KiB for 16-bit). On
    datacenter Blackwell (``arch`` 100/103, or unknown) 16-bit tiles of 64 heads take a second key tile
    (sm100 cubin: 143,384 B at 64 x 32 where sm90 and sm120 take 110,592). The compiled figure
    (``compiled_smem_bytes``; ``invariant``: of the batch-invariant kernels) where the table has one: the
    presets' tiles."""
    compiled = compiled_smem_bytes(block_h, block_n, block_l, block_r, dtype, arch, cache_dtype, invariant)
    if compiled is not None:
        return compiled
    elem = torch.empty((), dtype=dtype).element_size()
    scratch = block_h * block_n * 4 + block_h * 4
    if elem < 4:
        scratch = max(scratch, 4096)
    second_key = elem < 4 and block_h >= 64 and arch in (None, 100, 103)
    raw = 0  # an fp8 cache: its key tile as loaded, float32 rope scratch and the scales, per key row
    if cache_dtype is not None and cache_dtype != dtype:
        raw = block_n * ((block_l + block_r) * torch.empty((), dtype=cache_dtype).element_size() + 4 * block_r + 128)
    return (block_h + block_n + (block_n if second_key else 0)) * (block_l + block_r) * elem + raw + scratch


def preferred_block_h(heads: int, cache_dtype: torch.dtype | None = None) -> int:
    """Rows per program for ``heads`` local heads: all of them up to ``MAX_BLOCK_H`` (``MAX_BLOCK_H_FP8`` over an
    fp8 cache), at least 16 (the smallest tensor-core tile)."""
    cap = MAX_BLOCK_H_FP8 if cache_dtype is not None and cache_dtype.itemsize == 1 else MAX_BLOCK_H
    return max(16, min(cap, _pow2(heads)))


def choose_mla_tiles(
    heads: int, lat: int, rope: int, dtype: torch.dtype, smem_limit: int | None, arch: int | None = None,
    cache_dtype: torch.dtype | None = None, invariant: bool = False,
) -> MlaTiles | None:
    """Tiles for ``heads`` local heads, latent ``lat``, rope ``rope`` in ``dtype`` under ``smem_limit``
    bytes (None: no limit) on compute capability ``arch`` (major * 10 + minor; None: not known);
    ``cache_dtype``: an fp8 cache read into ``dtype`` tiles (None: the cache is ``dtype``). Order:
    preferred BLOCK_H with BLOCK_N 32 then 16, then half the heads per program; None when nothing fits.
    ``invariant``: the batch-invariant kernels' tiles (``INVARIANT_MAX_BLOCK_H`` rows at most; over an fp8
    cache BLOCK_N 16 and one stage: at 32 keys, or at 2 stages on sm120 with DCP, ptxas spills)."""
    block_l, block_r = max(16, _pow2(lat)), max(16, _pow2(rope))
    block_h = preferred_block_h(heads, cache_dtype)
    fp8 = cache_dtype is not None and cache_dtype.itemsize == 1
    block_ns, stages = ((16,), 1) if invariant and fp8 else ((32, 16), 2)
    if invariant:
        block_h = min(block_h, INVARIANT_MAX_BLOCK_H)
    while block_h >= 16:
        for block_n in block_ns:
            smem = mla_smem_bytes(block_h, block_n, block_l, block_r, dtype, arch, cache_dtype, invariant)
            if smem_limit is None or smem <= smem_limit:
                return MlaTiles(block_h, block_n, block_l, block_r, smem, stages, MLA_NUM_WARPS)
        block_h //= 2
    return None


@functools.cache
def tiles_for(
    heads: int, lat: int, rope: int, dtype: torch.dtype, smem_limit: int | None, arch: int | None = None,
    cache_dtype: torch.dtype | None = None, invariant: bool = False,
) -> MlaTiles:
    """``choose_mla_tiles``, memoised, logging once per shape when the preferred tiles do not fit;
    RuntimeError when nothing fits (the backend resolution keeps such models on the reference)."""
    tiles = choose_mla_tiles(heads, lat, rope, dtype, smem_limit, arch, cache_dtype, invariant)
    if tiles is None:
        raise RuntimeError(
            f"the Triton MLA kernel does not fit {smem_limit} B of shared memory at latent {lat} + rope {rope} "
            f"in {dtype}; use --attention-backend torch"
        )
    preferred = choose_mla_tiles(heads, lat, rope, dtype, None, arch, cache_dtype, invariant)
    if tiles != preferred:
        logger.info(
            "triton MLA: %d heads, %s: tiles BLOCK_H %d x BLOCK_N %d (~%d B of shared memory); the "
            "preferred %d x %d need ~%d B, more than this GPU's %d B",
            heads, dtype, tiles.block_h, tiles.block_n, tiles.smem_bytes,
            preferred.block_h, preferred.block_n, preferred.smem_bytes, smem_limit,
        )  # fmt: skip
    return tiles


def smallest_tiles_fit(lat: int, rope: int, dtype: torch.dtype, smem_limit: int | None,
                       kv_dtype: torch.dtype | None = None) -> bool:
    """Whether the Triton MLA kernel fits at all (one head block of 16, 16 keys per tile) for a model of
    ``dtype`` over a cache of ``kv_dtype`` (default ``dtype``; a 16/32-bit cache sets the tiles' dtype, an
    fp8 cache is dequantized into ``dtype`` tiles)."""
    if kv_dtype is None or kv_dtype == dtype:
        return choose_mla_tiles(1, lat, rope, dtype, smem_limit) is not None
    if kv_dtype.itemsize == 1:
        return choose_mla_tiles(1, lat, rope, dtype, smem_limit, cache_dtype=kv_dtype) is not None
    return choose_mla_tiles(1, lat, rope, kv_dtype, smem_limit) is not None


@functools.cache
def device_smem_limit(device_type: str, index: int | None) -> int | None:
    """Opt-in shared memory per block of a CUDA device (None for other devices)."""
    if device_type != "cuda":
        return None
    props = torch.cuda.get_device_properties(index if index is not None else torch.cuda.current_device())
    optin = getattr(props, "shared_memory_per_block_optin", 0)
    return int(optin) if optin else SMEM_OPTIN_BYTES.get((props.major, props.minor), 101_376)


@functools.cache
def device_arch(device_type: str, index: int | None) -> int | None:
    """Compute capability ``major * 10 + minor`` of a CUDA device (None for other devices)."""
    if device_type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(index if index is not None else torch.cuda.current_device())
    return major * 10 + minor


@functools.cache
def device_sm_count(device_type: str, index: int | None) -> int | None:
    """Streaming multiprocessors of a CUDA device (None for other devices)."""
    if device_type != "cuda":
        return None
    idx = index if index is not None else torch.cuda.current_device()
    return int(torch.cuda.get_device_properties(idx).multi_processor_count)


def choose_kv_splits(programs: int, max_keys: int, num_sms: int | None) -> int:
    """Key splits for a launch of ``programs`` (tokens x head blocks) over at most ``max_keys`` keys per
    token on ``num_sms`` SMs: 1 (no split) for short contexts (< SPLIT_MIN_CONTEXT), without a known SM
    count, or when the launch already has two programs per SM; else enough splits for two programs per
    SM, each split at least MIN_SPLIT_KEYS keys, at most MAX_SPLITS."""
    if num_sms is None or max_keys < SPLIT_MIN_CONTEXT or programs <= 0:
        return 1
    want = -(-2 * num_sms // programs)
    return max(1, min(want, max_keys // MIN_SPLIT_KEYS, MAX_SPLITS))


def choose_dcp_kv_splits(programs: int, max_keys: int, num_sms: int | None, dcp_size: int) -> int:
    """Key splits of the DCP kernel (ddtree_serve/kernels/triton_mla_dcp.py): ``choose_kv_splits``'s rule over the
    ``max_keys // dcp_size`` keys of one rank's shard (a rank reads about 1/N of each token's keys, and each
    split's merge costs one ``[BLOCK_H, L]`` float32 row of the N x heads, so a split should hold at least
    MIN_SPLIT_KEYS of its own keys). Batch 1 at 128k context and DCP 8 on 132 SMs: 32 splits."""
    return choose_kv_splits(programs, max_keys // max(1, dcp_size), num_sms)


INVARIANT_SPLIT_KEYS = MIN_SPLIT_KEYS  # batch-invariant mode: key positions per split (a multiple of every BLOCK_N)


def invariant_split_grid(programs: int, max_keys: int, num_sms: int | None, split_keys: int) -> int:
    """Batch-invariant mode (ddtree_serve/kernels/triton_mla_invariant.py): split programs per (token, head
    block). The splits are fixed by position (split ``c`` holds key positions ``[c * split_keys, (c + 1) *
    split_keys)``) whatever the batch, and one program walking them all merges them in the same order as the
    merge kernel, so this choice moves work between programs but never the result: ``ceil(max_keys /
    split_keys)`` programs (one per split, merged by ``_mla_inv_merge_kernel``) where ``choose_kv_splits``
    would split, else 1."""
    if choose_kv_splits(programs, max_keys, num_sms) <= 1:
        return 1
    return -(-max_keys // split_keys)
