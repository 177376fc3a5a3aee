"""A recording stand-in for the parts of the flashinfer module that our glue calls (flashinfer cannot run
without CUDA). It records every call and computes what flashinfer documents, from the plan's arguments
alone (written independently of ddtree_serve/kernels/attention.py), so a test catches wrong index pointers, page
indices, masks or kernel choices:

- ``BatchPrefillWithPagedKVCacheWrapper.plan(qo_indptr, kv_indptr, kv_indices, last_page_len, Hq, Hkv, d,
  page_size, head_dim_vo=, custom_mask=, causal=, sm_scale=, ...)``; ``run(q, (k_pages, v_pages))``.
  Causal: query i of a request with qo_len queries and kv_len keys sees keys j <= kv_len - qo_len + i.
  custom_mask: flattened row-major ``[qo_len, kv_len]`` per request, request after request.
- ``BatchDecodeWithPagedKVCacheWrapper.plan(indptr, indices, last_page_len, Hq, Hkv, d, page_size, ...)``:
  one query per request, all its keys.
- The prefill wrapper's backend, as flashinfer 0.7.2 chooses it (read in flashinfer/prefill.py and
  flashinfer/utils.py of that wheel): built with ``backend="auto"`` (the default), the paged prefill
  wrapper resolves it at its FIRST ``plan`` and keeps it for every later plan (``determine_attention_backend``:
  FA3 on sm90 when there is no custom mask and the head dims are an FA3 pair, (64|128|256 both) or
  (192, 128); FA2 otherwise). FA3's paged prefill has no custom-mask kernel: ``run`` of an FA3 wrapper
  planned with ``custom_mask`` raises, as the library does (``cudaErrorNotSupported`` from
  ``BatchPrefillWithPagedKVCacheSM90Run``). An explicit ``backend="fa3"`` off sm90 cannot compile: raised
  at ``plan``. ``make_flashinfer_standin(sm=...)`` sets the architecture (default 90, Hopper, the strictest).
- ``sampling.top_k_renorm_probs(probs, top_k, is_deterministic=False)`` and ``top_p_renorm_probs``: the
  torch reference of ddtree_serve/kernels/sampling.py on the given arguments.
"""

from __future__ import annotations

import types

import torch

_FA3_HEAD_DIMS = ((64, 64), (128, 128), (256, 256), (192, 128))


def _auto_backend(sm: int, custom_mask: bool, head_dim_qk: int, head_dim_vo: int) -> str:
    """flashinfer's ``determine_attention_backend`` for our arguments (no RoPE fusion, no fp16 reduction)."""
    return "fa3" if sm == 90 and not custom_mask and (head_dim_qk, head_dim_vo) in _FA3_HEAD_DIMS else "fa2"


class _Wrapper:
    kind = ""
    sm = 90  # the device's compute capability (major * 10 + minor); set per stand-in module

    def __init__(self, workspace: torch.Tensor, kv_layout: str = "NHD", backend: str = "auto", **kw) -> None:
        assert kv_layout == "NHD" and workspace.dtype == torch.uint8
        assert backend in ("auto", "fa2", "fa3"), backend
        self.calls: list[tuple[str, tuple, dict]] = []
        self._plan: tuple[tuple, dict] | None = None
        self.backend = backend  # "auto" until the first plan resolves it (prefill)

    def plan(self, *args, **kwargs) -> None:
        self.calls.append(("plan", args, kwargs))
        self._plan = (args, kwargs)

    def _attend(self, q, pages, qo_indptr, kv_indptr, kv_indices, causal, custom_mask, scale):
        k_pages, v_pages = pages  # [num_pages, 1, Hkv, d]
        out = []
        mask_off = 0
        for b in range(len(kv_indptr) - 1):
            q0, q1 = int(qo_indptr[b]), int(qo_indptr[b + 1])
            idx = kv_indices[int(kv_indptr[b]) : int(kv_indptr[b + 1])].long()
            keys, vals = k_pages[idx, 0].float(), v_pages[idx, 0].float()  # [kv_len, Hkv, d]
            qs = q[q0:q1].float()  # [qo_len, Hq, d]
            qo_len, kv_len = q1 - q0, len(idx)
            group = qs.shape[1] // keys.shape[1]
            keys, vals = keys.repeat_interleave(group, 1), vals.repeat_interleave(group, 1)
            scores = torch.einsum("qhd,khd->hqk", qs, keys) * scale  # [Hq, qo_len, kv_len]
            if custom_mask is not None:
                m = custom_mask[mask_off : mask_off + qo_len * kv_len].view(qo_len, kv_len)
                mask_off += qo_len * kv_len
            elif causal:
                m = torch.arange(kv_len)[None, :] <= (kv_len - qo_len + torch.arange(qo_len))[:, None]
            else:
                m = torch.ones(qo_len, kv_len, dtype=torch.bool)
            scores = scores.masked_fill(~m.to(scores.device)[None], float("-inf"))
            out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vals))
        return torch.cat(out).to(q.dtype)


class BatchPrefillWithPagedKVCacheWrapper(_Wrapper):
    kind = "prefill"

    def plan(self, *args, **kwargs) -> None:
        super().plan(*args, **kwargs)
        mask = kwargs.get("custom_mask") is not None
        d = args[6]
        if self.backend == "auto":  # resolved once, at the first plan, and kept (as flashinfer does)
            self.backend = _auto_backend(self.sm, mask, d, kwargs.get("head_dim_vo", d))
        if self.backend == "fa3" and self.sm != 90:
            raise RuntimeError(f"FA3 needs sm90, this device is sm{self.sm}")

    def run(self, q: torch.Tensor, pages) -> torch.Tensor:
        self.calls.append(("run", (q.shape,), {}))
        args, kw = self._plan
        if self.backend == "fa3" and kw.get("custom_mask") is not None:
            raise RuntimeError("BatchPrefillWithPagedKVCacheSM90Run failed with error: operation not supported")
        qo_indptr, kv_indptr, kv_indices, last_page_len, hq, hkv, d, page_size = args
        assert page_size == 1 and bool((last_page_len == 1).all()) and q.shape[1:] == (hq, d)
        assert qo_indptr.dtype == kv_indptr.dtype == kv_indices.dtype == torch.int32
        assert not (kw.get("causal") and kw.get("custom_mask") is not None), "causal is ignored with a mask"
        assert q.dtype == kw["q_data_type"] and pages[0].dtype == kw["kv_data_type"]
        return self._attend(
            q,
            pages,
            qo_indptr,
            kv_indptr,
            kv_indices,
            kw.get("causal", False),
            kw.get("custom_mask"),
            kw["sm_scale"],
        )


class BatchDecodeWithPagedKVCacheWrapper(_Wrapper):
    kind = "decode"

    def run(self, q: torch.Tensor, pages) -> torch.Tensor:
        self.calls.append(("run", (q.shape,), {}))
        args, kw = self._plan
        kv_indptr, kv_indices, last_page_len, hq, hkv, d, page_size = args
        assert page_size == 1 and q.shape[0] == len(kv_indptr) - 1
        qo_indptr = torch.arange(len(kv_indptr), dtype=torch.int32)
        return self._attend(q, pages, qo_indptr, kv_indptr, kv_indices, False, None, kw["sm_scale"])


def make_flashinfer_standin(sm: int = 90) -> types.SimpleNamespace:
    """A fresh stand-in module for a device of compute capability ``sm`` (its wrappers record into their
    own ``calls``)."""
    return types.SimpleNamespace(
        BatchPrefillWithPagedKVCacheWrapper=type(
            "BatchPrefillWithPagedKVCacheWrapper", (BatchPrefillWithPagedKVCacheWrapper,), {"sm": sm}
        ),
        BatchDecodeWithPagedKVCacheWrapper=type(
            "BatchDecodeWithPagedKVCacheWrapper", (BatchDecodeWithPagedKVCacheWrapper,), {"sm": sm}
        ),
    )


class SamplingStandin:
    """``flashinfer.sampling``'s renorm filters, recording each call's keyword arguments. ``with_flag``
    False models an older flashinfer whose filters take no ``is_deterministic``."""

    def __init__(self, with_flag: bool = True) -> None:
        self.calls: list[tuple[str, dict]] = []
        if with_flag:
            self.top_k_renorm_probs = self._top_k
            self.top_p_renorm_probs = self._top_p
        else:
            self.top_k_renorm_probs = lambda probs, top_k: self._top_k(probs, top_k, None)
            self.top_p_renorm_probs = lambda probs, top_p: self._top_p(probs, top_p, None)

    def _top_k(self, probs: torch.Tensor, top_k: torch.Tensor, is_deterministic: bool | None = False):
        self.calls.append(("top_k_renorm_probs", {"is_deterministic": is_deterministic}))
        kth = probs.sort(-1, descending=True).values.gather(1, (top_k.long() - 1)[:, None])  # [n, 1]
        kept = torch.where(probs >= kth, probs, 0)
        return kept / kept.sum(-1, keepdim=True)

    def _top_p(self, probs: torch.Tensor, top_p: torch.Tensor, is_deterministic: bool | None = False):
        self.calls.append(("top_p_renorm_probs", {"is_deterministic": is_deterministic}))
        vals = probs.sort(-1, descending=True).values  # [n, V]
        before = vals.cumsum(-1) - vals  # mass strictly before each sorted entry
        n_keep = (before < top_p[:, None]).sum(-1).clamp(min=1)  # [n]
        thr = vals.gather(1, (n_keep - 1)[:, None])  # [n, 1]
        kept = torch.where(probs >= thr, probs, 0)
        return kept / kept.sum(-1, keepdim=True)
