"""flashinfer backend for ``ddtree_serve.kernels.attention``'s interface (CUDA only; its glue is tested on CPU against a
recording stand-in for the flashinfer module, tests/kernels/test_attention_flashinfer_glue.py).

Same ``forward`` contract as ``TorchAttentionBackend``: write the new tokens' k/v into the token-granular
cache at ``out_cache_loc``, then attend every new token to the keys of its request. flashinfer sees the
cache as pages of one token (``page_size=1``, NHD layout) and request b's keys as the first
``prefix_lens[b] + extend_lens[b]`` entries of ``kv_indices[b]``. Kernel per forward kind:

- decode (one new token per request): ``BatchDecodeWithPagedKVCacheWrapper``, no mask;
- extend (prefill, chunked prefill): ``BatchPrefillWithPagedKVCacheWrapper`` with ``causal=True``
  (flashinfer aligns the queries to the end of the keys: query i sees the prefix and new tokens <= i),
  no mask, ``backend="auto"``: FA3 on Hopper (sm90) for the head dims it instantiates, FA2 elsewhere;
- tree verification and drafter blocks (``meta.causal`` False): a second prefill wrapper, built with
  ``backend="fa2"``, with a flattened per-request ``custom_mask`` (the only place an O(Q x K) mask is
  built and packed).

Why two prefill wrappers: flashinfer's paged prefill wrapper resolves ``backend="auto"`` once, at its
first ``plan``, and keeps that backend for every later plan. A causal first plan on sm90 fixes FA3, whose
paged prefill has no custom-mask kernel (it returns ``cudaErrorNotSupported``, raised by ``run``); one
shared wrapper therefore crashed the start-up warm-up (decode -> extend -> tree) on H100/H200. Masked work
never touches the causal wrapper, and its own wrapper is pinned to FA2, the backend flashinfer's auto rule
picks for a custom mask on every architecture.

Plans are per forward: the model calls ``begin_forward(meta)`` once before its first layer, which drops
the previous plan; the first layer plans (one host sync, flashinfer's plan copies its index pointers to
the host) and the other layers reuse it. No tensor version counters are read (inference tensors have
none), and ``forward`` refuses metadata that is not the begun forward's.
"""

from __future__ import annotations

from types import ModuleType

import torch

from ddtree_serve.kernels.attention import AttentionMeta
from ddtree_serve.kernels.dispatch import FLASHINFER, require_cuda_library

_WORKSPACE_BYTES = 128 * 1024 * 1024


def plan_arguments(
    meta: AttentionMeta, hq: int, hkv: int, d: int, dv: int, dtype: torch.dtype, scale: float
) -> tuple[str, tuple, dict]:
    """(kernel, positional args, keyword args) of the flashinfer ``plan`` call for one forward.

    kernel: ``"decode"`` (BatchDecodeWithPagedKVCacheWrapper), ``"prefill"`` (the causal
    BatchPrefillWithPagedKVCacheWrapper) or ``"masked_prefill"`` (the FA2 one, with ``custom_mask``)."""
    bs, q_max, k_max = meta.attn_mask.shape
    dev = meta.kv_indices.device
    qo_len = meta.extend_lens.to(device=dev, dtype=torch.int64)  # [bs]
    kv_len = meta.prefix_lens.to(device=dev, dtype=torch.int64) + qo_len  # [bs]
    cols = torch.arange(k_max, device=dev)  # [K]
    key_used = cols[None, :] < kv_len[:, None]  # [bs, K]
    page_indices = meta.kv_indices[key_used].to(torch.int32)  # [sum kv_len]
    kv_indptr = torch.cat([kv_len.new_zeros(1), kv_len.cumsum(0)]).to(torch.int32)  # [bs+1]
    last_page_len = torch.ones(bs, dtype=torch.int32, device=dev)  # [bs] pages of one token
    common = dict(sm_scale=float(scale), q_data_type=dtype, kv_data_type=dtype)
    if meta.decode and dv == d:
        return "decode", (kv_indptr, page_indices, last_page_len, hq, hkv, d, 1), common
    qo_indptr = torch.cat([qo_len.new_zeros(1), qo_len.cumsum(0)]).to(torch.int32)  # [bs+1]
    extra = {} if dv == d else {"head_dim_vo": dv}
    args = (qo_indptr, kv_indptr, page_indices, last_page_len, hq, hkv, d, 1)
    if meta.causal:
        return "prefill", args, {**extra, "causal": True, **common}
    real_q = torch.arange(q_max, device=dev)[None, :] < qo_len[:, None]  # [bs, Q]
    used = real_q[:, :, None] & key_used[:, None, :]  # [bs, Q, K]
    extra["custom_mask"] = meta.attn_mask[used]  # row-major [qo_len[b], kv_len[b]] per request
    return "masked_prefill", args, {**extra, **common}


class FlashInferAttentionBackend:
    """Paged attention through flashinfer's decode and prefill wrappers (module docstring)."""

    def __init__(self, device: torch.device | str = "cuda", flashinfer: ModuleType | None = None) -> None:
        """``flashinfer``: the module to use (tests pass a recording stand-in); default: import it, which
        needs CUDA and the package."""
        if flashinfer is None:
            if not torch.cuda.is_available():
                raise RuntimeError("FlashInferAttentionBackend needs CUDA")
            flashinfer = require_cuda_library(FLASHINFER, "FlashInferAttentionBackend")
        self._workspace = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper
        # one forward runs at a time on one stream, so the wrappers share the float workspace
        self._prefill = prefill(self._workspace, kv_layout="NHD")  # causal only: backend "auto" (FA3 on sm90)
        self._masked_prefill = prefill(self._workspace, kv_layout="NHD", backend="fa2")  # custom masks only
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self._workspace, kv_layout="NHD")
        self._meta: AttentionMeta | None = None
        self._planned: tuple | None = None  # (head counts, dims, dtype, scale) of the current plan
        self._kernel = ""  # "prefill" | "masked_prefill" | "decode": the wrapper planned for this forward

    def _wrapper(self, kernel: str):
        """The wrapper that serves ``kernel`` (a ``plan_arguments`` kernel name)."""
        return {"decode": self._decode, "prefill": self._prefill, "masked_prefill": self._masked_prefill}[kernel]

    def begin_forward(self, meta: AttentionMeta) -> None:
        self._meta = meta
        self._planned = None

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, d]
        k: torch.Tensor,  # [T, Hkv, d]
        v: torch.Tensor,  # [T, Hkv, dv]
        k_cache: torch.Tensor,  # [num_slots, Hkv, d]
        v_cache: torch.Tensor,  # [num_slots, Hkv, dv]
        out_cache_loc: torch.Tensor,  # [T]
        kv_indices: torch.Tensor,  # [bs, K]
        attn_mask: torch.Tensor,  # [bs, Q, K] bool
        q_index: torch.Tensor,  # [T] rows into [bs * Q], request after request
        scale: float,
    ) -> torch.Tensor:  # [T, Hq, dv]
        meta = self._meta
        if meta is None or not meta.describes(kv_indices, attn_mask, q_index):
            raise RuntimeError(
                "FlashInferAttentionBackend.forward: begin_forward(meta) was not called with "
                "this forward's metadata (kv_indices, attn_mask, q_index)"
            )
        if meta.decode and q.shape[0] != kv_indices.shape[0]:
            raise ValueError(f"decode forward with {q.shape[0]} tokens for {kv_indices.shape[0]} requests")
        k_cache[out_cache_loc] = k.to(k_cache.dtype)
        v_cache[out_cache_loc] = v.to(v_cache.dtype)
        shape = (q.shape[1], k_cache.shape[1], q.shape[2], v_cache.shape[2], k_cache.dtype, float(scale))
        if self._planned != shape:
            kernel, args, kwargs = plan_arguments(meta, *shape)
            self._wrapper(kernel).plan(*args, **kwargs)
            self._planned, self._kernel = shape, kernel
        wrapper = self._wrapper(self._kernel)
        paged = (k_cache.unsqueeze(1), v_cache.unsqueeze(1))  # [num_slots, page=1, Hkv, d]
        return wrapper.run(q.to(k_cache.dtype), paged)

    def warmup(
        self,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        head_dim_vo: int,
        dtype: torch.dtype,
        device: torch.device | str,
        kinds: tuple[str, ...] = ("decode", "extend", "tree"),
    ) -> list[str]:
        """Compile (JIT) and run every kernel this backend uses once, on two tiny requests: decode,
        causal extend and custom-mask prefill, in that order (the order that crashed Hopper when one
        wrapper served causal and masked plans); ``kinds``: those the model runs (a DFlash drafter only runs
        "tree", so its group size never reaches the decode kernel). Call at start-up, before the server
        reports healthy. Returns the kernels run."""
        dev = torch.device(device)
        k_cache = torch.zeros(8, num_kv_heads, head_dim, dtype=dtype, device=dev)  # [slots, Hkv, d]
        v_cache = torch.zeros(8, num_kv_heads, head_dim_vo, dtype=dtype, device=dev)
        kv_indices = torch.tensor([[1, 2, 3], [4, 5, 6]], device=dev)  # [2, 3]
        done = []
        for kind, ext in (("decode", 1), ("extend", 2), ("tree", 2)):
            if kind not in kinds:
                continue
            bs, k_max = 2, 3
            prefix = torch.full((bs,), k_max - ext, dtype=torch.int64, device=dev)
            extend = torch.full((bs,), ext, dtype=torch.int64, device=dev)
            mask = torch.ones(bs, ext, k_max, dtype=torch.bool, device=dev)  # [bs, Q, K]
            if kind != "tree":
                mask = torch.tril(mask, diagonal=k_max - ext)
            q_index = torch.arange(bs * ext, device=dev)  # [T]
            meta = AttentionMeta(kind != "tree", kind == "decode", kv_indices, mask, q_index, prefix, extend)
            t = bs * ext
            self.begin_forward(meta)
            self.forward(
                torch.zeros(t, num_qo_heads, head_dim, dtype=dtype, device=dev),
                torch.zeros(t, num_kv_heads, head_dim, dtype=dtype, device=dev),
                torch.zeros(t, num_kv_heads, head_dim_vo, dtype=dtype, device=dev),
                k_cache,
                v_cache,
                kv_indices[:, k_max - ext :].reshape(-1),
                kv_indices,
                mask,
                q_index,
                head_dim**-0.5,
            )
            done.append(f"{kind}:{self._kernel}")
        self._meta, self._planned = None, None
        return done
