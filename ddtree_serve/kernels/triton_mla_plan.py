"""Launch plan of the Triton MLA kernels (ddtree_serve/kernels/triton_mla.py, ddtree_serve/kernels/triton_mla_split.py): tile sizes
that fit the device's shared memory, and how many key splits (flash-decoding) a launch uses. Pure rules
over shapes and device facts, so they are tested on CPU (tests/kernels/test_triton_mla_plan.py).

Tiles. One program holds a ``[BLOCK_H, L + R]`` query tile and a ``[BLOCK_N, L + R]`` key tile in shared
memory (the latent serves as K and V), plus a small scratch tile. ``mla_smem_bytes`` estimates that from
the Triton 3.9 cubins (``metadata.shared`` of the kernel compiled for sm120, num_warps 4, num_stages 2,
L 512, R 64; sm90 and sm100 alike unless noted):

==========  =======  =======  ==========  ==========
dtype       BLOCK_H  BLOCK_N  cubin (B)   estimate
==========  =======  =======  ==========  ==========
bfloat16    16       32       59,392      59,392
bfloat16    64       32       114,688     119,040   (sm90: 110,592)
bfloat16    64       16       94,208      96,512
float32     16       32       112,704     112,704
float32     16       16       74,816      74,816
float32     32       16       112,768     112,768
float32     64       16       188,672     188,672
==========  =======  =======  ==========  ==========

Over an fp8 cache (``--kv-cache-dtype fp8_e4m3``) the bfloat16 kernel also holds the fp8 key tile as loaded
and float32 scratch of the dequantization: cubins add 904 B per key row at L 512 / R 64 to the bfloat16
query and key tiles (sm120: 16 x 16 51,328 B, 32 x 16 69,760, 64 x 16 106,624, 64 x 32 139,520; 16 x 32
84,224 on sm90 and sm120); the estimate adds ``BLOCK_N x ((L + R) + 4 R + 128)`` (960 B per row), so at 64
heads on sm120 an fp8 cache takes 32 x 16 tiles.

(sm100 adds a second key tile for 16-bit tiles of 64 heads: 143,384 B at 64 x 32; the estimate adds it
for arch 100/103 or unknown). So float32 at ``BLOCK_H 16 / BLOCK_N 32`` (Kimi K2.6 at TP 8: 8 local heads)
needs 112,704 B, more than sm120's 101,376 (RTX PRO 6000), and bfloat16 at 64 heads 114,688.
``benchmarks/triton_smem_check.py`` recompiles the chosen tiles per architecture and compares. ``choose_mla_tiles`` keeps
``BLOCK_H`` (all local heads in one program: the cache is read once) and shrinks ``BLOCK_N`` (32, then 16)
before it splits the heads (``BLOCK_H`` 64 -> 32 -> 16); None when even 16 x 16 does not fit (then the
backend resolution picks the torch reference, ddtree_serve/model_executor/kernel_backends.py). Without a limit (CPU,
Triton's interpreter) it keeps the preferred tiles.

Splits. A decode step at small batch launches few programs (batch 1 at TP 8: one program per layer) and
each walks the whole context. ``choose_kv_splits`` splits the keys of each program into chunks walked by
separate programs, merged by their log-sum-exp, when the context is long and the launch would not fill the
GPU on its own. It reads only host-known sizes (the key columns of ``kv_indices``, not the lengths on the
device), so a CUDA graph captured at a size keeps a valid split count.
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


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def mla_smem_bytes(
    block_h: int, block_n: int, block_l: int, block_r: int, dtype: torch.dtype, arch: int | None = None,
    cache_dtype: torch.dtype | None = None,
) -> int:
    """Estimated shared memory of one MLA program (module docstring): the query and key tiles in the cache
    dtype (``dtype``; with an fp8 ``cache_dtype`` the tiles are dequantized to ``dtype`` and the raw fp8 tile
    and its scratch are added), plus the scratch tile (float32 ``[BLOCK_H, BLOCK_N]`` and a row; at least 4 KiB for 16-bit). On
    datacenter Blackwell (``arch`` 100/103, or unknown) 16-bit tiles of 64 heads take a second key tile
    (sm100 cubin: 143,384 B at 64 x 32 where sm90 and sm120 take 110,592)."""
    elem = torch.empty((), dtype=dtype).element_size()
    scratch = block_h * block_n * 4 + block_h * 4
    if elem < 4:
        scratch = max(scratch, 4096)
    second_key = elem < 4 and block_h >= 64 and arch in (None, 100, 103)
    raw = 0  # an fp8 cache: its key tile as loaded, float32 rope scratch and the scales, per key row
    if cache_dtype is not None and cache_dtype != dtype:
        raw = block_n * ((block_l + block_r) * torch.empty((), dtype=cache_dtype).element_size() + 4 * block_r + 128)
    return (block_h + block_n + (block_n if second_key else 0)) * (block_l + block_r) * elem + raw + scratch


def preferred_block_h(heads: int) -> int:
    return max(16, min(64, _pow2(heads)))


def choose_mla_tiles(
    heads: int, lat: int, rope: int, dtype: torch.dtype, smem_limit: int | None, arch: int | None = None,
    cache_dtype: torch.dtype | None = None,
) -> MlaTiles | None:
    """Tiles for ``heads`` local heads, latent ``lat``, rope ``rope`` in ``dtype`` under ``smem_limit``
    bytes (None: no limit) on compute capability ``arch`` (major * 10 + minor; None: not known);
    ``cache_dtype``: an fp8 cache read into ``dtype`` tiles (None: the cache is ``dtype``). Order:
    preferred BLOCK_H with BLOCK_N 32 then 16, then half the heads per program; None when nothing fits."""
    block_l, block_r = max(16, _pow2(lat)), max(16, _pow2(rope))
    block_h = preferred_block_h(heads)
    while block_h >= 16:
        for block_n in (32, 16):
            smem = mla_smem_bytes(block_h, block_n, block_l, block_r, dtype, arch, cache_dtype)
            if smem_limit is None or smem <= smem_limit:
                return MlaTiles(block_h, block_n, block_l, block_r, smem)
        block_h //= 2
    return None


@functools.cache
def tiles_for(
    heads: int, lat: int, rope: int, dtype: torch.dtype, smem_limit: int | None, arch: int | None = None,
    cache_dtype: torch.dtype | None = None,
) -> MlaTiles:
    """``choose_mla_tiles``, memoised, logging once per shape when the preferred tiles do not fit;
    RuntimeError when nothing fits (the backend resolution keeps such models on the reference)."""
    tiles = choose_mla_tiles(heads, lat, rope, dtype, smem_limit, arch, cache_dtype)
    if tiles is None:
        raise RuntimeError(
            f"the Triton MLA kernel does not fit {smem_limit} B of shared memory at latent {lat} + rope {rope} "
            f"in {dtype}; use --attention-backend torch"
        )
    preferred = choose_mla_tiles(heads, lat, rope, dtype, None, arch, cache_dtype)
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
