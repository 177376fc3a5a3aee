"""flashinfer backend for ``kernels.attention``'s interface (CUDA only; not exercised on CPU CI).

Same ``forward`` contract as ``TorchAttentionBackend``: write the new tokens' k/v into the token-granular
cache at ``out_cache_loc``, then attend every new token to the keys of its request selected by
``attn_mask``. flashinfer sees the cache as pages of one token (``page_size=1``, NHD layout), each
request's keys as the first ``kv_len[b]`` entries of ``kv_indices[b]``, and the mask (ancestor-only for
tree verify, causal for extend/decode) as a flattened per-request ``custom_mask`` that flashinfer packs
into bits. One ``plan`` serves every layer of a forward: it is redone only when the metadata tensors
passed in change (identity and in-place version check), so pass the same tensors to all layers.
Assumes ``q_index`` puts request b's tokens in its first ``extend_len[b]`` padded rows (ForwardBatch).
"""

from __future__ import annotations

import torch

from kernels.dispatch import FLASHINFER, import_cuda_library

_WORKSPACE_BYTES = 128 * 1024 * 1024


class FlashInferAttentionBackend:
    """Paged prefill attention with a custom mask via flashinfer's BatchPrefillWithPagedKVCacheWrapper."""

    def __init__(self, device: torch.device | str = "cuda") -> None:
        fi = import_cuda_library(FLASHINFER)
        if fi is None or not torch.cuda.is_available():
            raise RuntimeError("FlashInferAttentionBackend needs CUDA and the flashinfer package")
        self._workspace = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(self._workspace, kv_layout="NHD")
        self._planned_for: tuple | None = None  # (kv_indices, attn_mask, q_index, shapes) last planned

    def _plan(self, q, k_cache, v_cache, kv_indices, attn_mask, q_index, scale) -> None:
        # Same tensor objects, not modified in place since (version counters), same shapes: reuse the plan.
        meta = (kv_indices, attn_mask, q_index)
        key = (*meta, *(t._version for t in meta), q.shape, k_cache.shape, v_cache.shape, float(scale))
        if self._planned_for is not None and all(
            a is b if isinstance(a, torch.Tensor) else a == b
            for a, b in zip(self._planned_for, key, strict=True)
        ):
            return
        bs, q_max, _ = attn_mask.shape
        dev = q.device
        req_of_row = torch.div(q_index, q_max, rounding_mode="floor")  # [T]
        qo_len = torch.bincount(req_of_row, minlength=bs)  # [bs]
        # Real query rows of request b are the first qo_len[b] rows; keys used = last visible column + 1.
        real_q = torch.arange(q_max, device=dev)[None, :] < qo_len[:, None]  # [bs, Q]
        visible = (attn_mask & real_q[:, :, None]).any(dim=1)  # [bs, K]
        cols = torch.arange(attn_mask.shape[2], device=dev)  # [K]
        kv_len = torch.where(visible, cols + 1, 0).amax(dim=1)  # [bs]
        qo_indptr = torch.cat([qo_len.new_zeros(1), qo_len.cumsum(0)]).to(torch.int32)  # [bs+1]
        kv_indptr = torch.cat([kv_len.new_zeros(1), kv_len.cumsum(0)]).to(torch.int32)  # [bs+1]
        key_used = cols[None, :] < kv_len[:, None]  # [bs, K]
        page_indices = kv_indices[key_used].to(torch.int32)  # [sum kv_len]
        mask_used = real_q[:, :, None] & key_used[:, None, :]  # [bs, Q, K]
        custom_mask = attn_mask[mask_used]  # flattened per request, row-major [qo_len[b], kv_len[b]]
        hq, d = q.shape[1], q.shape[2]
        hkv, dv = k_cache.shape[1], v_cache.shape[2]
        extra = {} if dv == d else {"head_dim_vo": dv}
        self._wrapper.plan(
            qo_indptr,
            kv_indptr,
            page_indices,
            torch.ones(bs, dtype=torch.int32, device=dev),
            hq,
            hkv,
            d,
            1,
            custom_mask=custom_mask,
            sm_scale=float(scale),
            q_data_type=q.dtype,
            kv_data_type=k_cache.dtype,
            **extra,
        )
        self._planned_for = key

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
        k_cache[out_cache_loc] = k.to(k_cache.dtype)
        v_cache[out_cache_loc] = v.to(v_cache.dtype)
        self._plan(q, k_cache, v_cache, kv_indices, attn_mask, q_index, scale)
        paged = (k_cache.unsqueeze(1), v_cache.unsqueeze(1))  # [num_slots, page=1, Hkv, d]
        return self._wrapper.run(q.to(k_cache.dtype), paged)
