"""Batch-invariant attention backend (``--enable-deterministic-inference``, MHA models).

Same contract as ``TorchAttentionBackend`` (ddtree_serve/kernels/attention.py), but a query's output is a
function of its own q and the keys at its context *positions* only: the reduction runs over fixed splits of
``KV_SPLIT`` key positions in position order (ddtree_serve/kernels/batch_invariant.py), so the same token at
the same position gets bit-identical attention as a decode row, a prefill-chunk row, a tree node (its
ancestors sit at scattered cache columns behind masked siblings: they are gathered back to their positions)
or after a prefix-cache hit. Sources: Thinking Machines, "Defeating Nondeterminism in LLM Inference" (fixed
split size for attention); SGLang ``--enable-deterministic-inference``.

Per request: the key splits wholly below the request's first new position (``prefix // KV_SPLIT`` of them
in a tree, all of them when causal) read the cache columns directly (column = position) and are shared by
every query of the request; a tree's remaining splits are gathered per node from its mask row (the
position of new key ``k`` is ``prefix + depth(k)``, ``depth(k)`` = the number of new keys node ``k`` sees,
minus one). Scores and softmax in float32.
"""

from __future__ import annotations

import torch

from ddtree_serve.kernels.attention import AttentionMeta
from ddtree_serve.kernels.batch_invariant import (
    KV_SPLIT,
    normalize_totals,
    split_numerators,
    split_partials,
    sum_splits,
)


def _gather_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, have: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """slots/have [..., N] -> k [..., N, Hkv, d], v [..., N, Hkv, dv] float32, zero where ``have`` is False."""
    keep = have[..., None, None]
    k = torch.where(keep, k_cache[slots].float(), 0.0)
    v = torch.where(keep, v_cache[slots].float(), 0.0)
    return k, v


def request_totals(
    q: torch.Tensor,  # [n, Hq, d] float32, already scaled
    slots: torch.Tensor,  # [L] int64, KV slot of each key column (prefix then new tokens), L = prefix + n
    mask: torch.Tensor,  # [n, L] bool, query i sees column j
    k_cache: torch.Tensor,  # [num_slots, Hkv, d]
    v_cache: torch.Tensor,  # [num_slots, Hkv, dv]
    prefix: int,
    causal: bool,
    key_ok: torch.Tensor | None = None,  # [L] bool: the column's key is held here (DCP); None: every key
) -> tuple[torch.Tensor, torch.Tensor]:  # total [n, Hq, dv + 1], max [n, Hq] float32
    """Attention of one request's ``n`` new tokens, invariant to everything but each query's own context, before
    the normalisation: (sum_j exp(s_j - m) [v_j, 1] over the visible keys, m = their max score).
    ``causal``: column = position for every key (EXTEND/DECODE); else the new keys form a tree (each node sees
    its ancestors and itself), ValueError if the mask is not one. ``key_ok``: keys outside it are invisible
    (the tree's layout is still read from ``mask``)."""
    n, hq, d = q.shape
    hkv, c, big_l = k_cache.shape[1], KV_SPLIT, slots.shape[0]
    g = hq // hkv
    dev = q.device
    shared = -(-big_l // c) if causal else prefix // c  # splits read straight from the columns
    rows = q.view(n, hkv, g, d).permute(1, 2, 0, 3).reshape(1, hkv, g * n, d)  # [1, Hkv, g*n, d] rows (head, query)
    parts, maxes = [], []
    if shared:
        pos = torch.arange(shared * c, device=dev)  # [S*C]
        have = pos < big_l
        if key_ok is not None:
            have = have & key_ok[pos.clamp(max=big_l - 1)]
        k, v = _gather_kv(k_cache, v_cache, slots[pos.clamp(max=big_l - 1)], have)  # [S*C, Hkv, d]
        k = k.view(shared, c, hkv, d).permute(2, 0, 1, 3)[None]  # [1, Hkv, S, C, d]
        v = v.view(shared, c, hkv, -1).permute(2, 0, 1, 3)[None]  # [1, Hkv, S, C, dv]
        vis = torch.nn.functional.pad(mask, (0, max(0, shared * c - big_l)))[:, : shared * c] & have  # [n, S*C]
        vis = vis.view(n, shared, c).permute(1, 0, 2)[:, None].expand(shared, g, n, c).reshape(shared, g * n, c)
        s, m = split_partials(rows, k, v, vis[None, None])  # s [1, Hkv, S, g*n, C], m [1, Hkv, g*n]
        parts.append((s, v, "shared"))
        maxes.append(m.view(hkv, g, n).permute(2, 0, 1))  # [n, Hkv, g]
    if not causal:
        first = shared * c  # first tail position
        new = mask[:, prefix:]  # [n, n] node i sees node k
        depth = new.sum(1) - 1  # [n]
        tail = -(-(prefix + int(depth.max()) + 1 - first) // c)
        pos = first + torch.arange(tail * c, device=dev)  # [Nt*C]
        tmap = pos.clamp(max=max(prefix - 1, 0)).expand(n, -1).clone()  # [n, Nt*C] column of each position
        tvis = (pos < prefix).expand(n, -1).clone()  # prefix keys: visible to every node
        ii, kk = new.nonzero(as_tuple=True)
        tmap[ii, prefix - first + depth[kk]] = prefix + kk
        tvis[ii, prefix - first + depth[kk]] = True
        if not torch.equal(tvis[:, prefix - first :].sum(1), depth + 1):
            raise ValueError("invariant attention: the non-causal mask is not a tree (two visible new keys share a depth)")
        if key_ok is not None:
            tvis = tvis & key_ok[tmap]
        k, v = _gather_kv(k_cache, v_cache, slots[tmap], tvis)  # [n, Nt*C, Hkv, d]
        k = k.view(n, tail, c, hkv, d).permute(0, 3, 1, 2, 4)  # [n, Hkv, Nt, C, d]
        v = v.view(n, tail, c, hkv, -1).permute(0, 3, 1, 2, 4)  # [n, Hkv, Nt, C, dv]
        vis = tvis.view(n, 1, tail, 1, c).expand(n, 1, tail, g, c)  # [n, 1, Nt, g, C]
        s, m = split_partials(q.view(n, hkv, g, d), k, v, vis)  # s [n, Hkv, Nt, g, C], m [n, Hkv, g]
        parts.append((s, v, "tail"))
        maxes.append(m)
    m = maxes[0] if len(maxes) == 1 else torch.maximum(maxes[0], maxes[1])  # [n, Hkv, g]
    nums = []
    for s, v, kind in parts:
        if kind == "shared":
            m_rows = m.permute(1, 2, 0).reshape(1, hkv, g * n)  # [1, Hkv, g*n]
            p = split_numerators(s, m_rows, v)  # [1, Hkv, S, g*n, dv+1]
            nums.append(p[0].view(hkv, shared, g, n, -1).permute(3, 0, 1, 2, 4))  # [n, Hkv, S, g, dv+1]
        else:
            nums.append(split_numerators(s, m, v))  # [n, Hkv, Nt, g, dv+1]
    total = sum_splits(torch.cat(nums, dim=2) if len(nums) > 1 else nums[0])  # [n, Hkv, g, dv + 1]
    return total.reshape(n, hq, -1), m.reshape(n, hq)


def causal_totals(
    q: torch.Tensor,  # [bs, Q, Hq, d] float32, scaled, padded rows
    kv_indices: torch.Tensor,  # [bs, K]
    mask: torch.Tensor,  # [bs, Q, K] bool
    totals: torch.Tensor,  # [bs] prefix + extend
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:  # total [bs, Q, Hq, dv + 1], max [bs, Q, Hq] float32
    """``request_totals`` for causal forwards (column = position for every key), all requests at once: the
    same splits and GEMM item shapes per request, the batch only adding zero splits and padded rows. A key
    ``mask`` hides from every query is read as absent (zeroed: DCP's keys of other ranks)."""
    bs, qm, hq, d = q.shape
    hkv, c, big_k = k_cache.shape[1], KV_SPLIT, kv_indices.shape[1]
    g, splits = hq // hkv, -(-big_k // c)
    pad = splits * c - big_k
    cols = torch.nn.functional.pad(kv_indices, (0, pad))  # [bs, S*C]
    have = torch.arange(splits * c, device=q.device)[None] < totals[:, None]  # [bs, S*C]
    have = have & torch.nn.functional.pad(mask.any(1), (0, pad))  # [bs, S*C]
    k, v = _gather_kv(k_cache, v_cache, cols, have)  # [bs, S*C, Hkv, d]
    k = k.view(bs, splits, c, hkv, d).permute(0, 3, 1, 2, 4)  # [bs, Hkv, S, C, d]
    v = v.view(bs, splits, c, hkv, -1).permute(0, 3, 1, 2, 4)  # [bs, Hkv, S, C, dv]
    rows = q.view(bs, qm, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(bs, hkv, g * qm, d)  # [bs, Hkv, g*Q, d]
    vis = torch.nn.functional.pad(mask, (0, pad)).view(bs, qm, splits, c).permute(0, 2, 1, 3)  # [bs, S, Q, C]
    vis = vis[:, None, :, None].expand(bs, 1, splits, g, qm, c).reshape(bs, 1, splits, g * qm, c)
    s, m = split_partials(rows, k, v, vis)  # [bs, Hkv, S, g*Q, C], [bs, Hkv, g*Q]
    total = sum_splits(split_numerators(s, m, v))  # [bs, Hkv, g*Q, dv + 1]
    total = total.view(bs, hkv, g, qm, -1).permute(0, 3, 1, 2, 4).reshape(bs, qm, hq, -1)
    return total, m.view(bs, hkv, g, qm).permute(0, 3, 1, 2).reshape(bs, qm, hq)


def invariant_paged_totals(
    q: torch.Tensor,  # [T, Hq, d]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_indices: torch.Tensor,  # [bs, K]
    attn_mask: torch.Tensor,  # [bs, Q, K] bool
    q_index: torch.Tensor,  # [T] row of each flat token in [bs * Q]
    scale: float,
    prefix_lens: list[int],
    extend_lens: list[int],
    causal: bool,
    key_ok: torch.Tensor | None = None,  # [bs, K] bool: keys held here (DCP: this rank's); None: all
) -> tuple[torch.Tensor, torch.Tensor]:  # total [T, Hq, dv + 1], max [T, Hq] float32
    """``invariant_paged_attention`` before its normalisation: per query the unnormalised numerator and
    denominator over its visible keys (those in ``key_ok``) and their max score (-inf, total 0: none). A DCP
    rank merges these with the other ranks' in a fixed rank order (layers/dcp_attention.py)."""
    if attn_mask.shape[2] != kv_indices.shape[1]:
        raise ValueError("invariant attention needs the dense [bs, Q, K] mask")
    qs = q.float() * scale  # [T, Hq, d]
    if causal:
        bs, qm = attn_mask.shape[:2]
        qp = qs.new_zeros(bs * qm, *qs.shape[1:])  # [bs*Q, Hq, d]
        qp[q_index] = qs
        totals = torch.tensor(prefix_lens, device=q.device) + torch.tensor(extend_lens, device=q.device)
        mask = attn_mask if key_ok is None else attn_mask & key_ok[:, None, :]  # [bs, Q, K]
        tot, m = causal_totals(qp.view(bs, qm, *qs.shape[1:]), kv_indices, mask, totals, k_cache, v_cache)
        return tot.reshape(bs * qm, *tot.shape[2:])[q_index], m.reshape(bs * qm, -1)[q_index]
    tots, maxes, t0 = [], [], 0
    for b, (pre, n) in enumerate(zip(prefix_lens, extend_lens, strict=True)):
        if n == 0:
            continue
        total = pre + n
        tot, m = request_totals(qs[t0 : t0 + n], kv_indices[b, :total], attn_mask[b, :n, :total], k_cache,
                                v_cache, pre, causal, None if key_ok is None else key_ok[b, :total])
        tots.append(tot)
        maxes.append(m)
        t0 += n
    if not tots:
        return qs.new_zeros(0, q.shape[1], v_cache.shape[-1] + 1), qs.new_zeros(0, q.shape[1])
    return torch.cat(tots), torch.cat(maxes)


def invariant_paged_attention(
    q: torch.Tensor,  # [T, Hq, d]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_indices: torch.Tensor,  # [bs, K]
    attn_mask: torch.Tensor,  # [bs, Q, K] bool
    q_index: torch.Tensor,  # [T] row of each flat token in [bs * Q]
    scale: float,
    prefix_lens: list[int],
    extend_lens: list[int],
    causal: bool,
) -> torch.Tensor:  # [T, Hq, dv] in q's dtype
    """Batch-invariant attention for already-written caches; flat tokens are request after request. Causal
    forwards run all requests at once (``causal_totals``), trees request by request (``request_totals``)."""
    total, _ = invariant_paged_totals(q, k_cache, v_cache, kv_indices, attn_mask, q_index, scale, prefix_lens,
                                      extend_lens, causal)
    return normalize_totals(total).to(q.dtype)


class InvariantAttentionBackend:
    """``AttentionBackend`` whose outputs are row-invariant (module docstring); plans the host lengths once per
    forward (one read of ``prefix_lens``/``extend_lens``)."""

    def __init__(self) -> None:
        self._plan: tuple[list[int], list[int], bool] | None = None

    def begin_forward(self, meta: AttentionMeta) -> None:
        self._plan = (meta.prefix_lens.tolist(), meta.extend_lens.tolist(), meta.causal)

    def forward(self, q, k, v, k_cache, v_cache, out_cache_loc, kv_indices, attn_mask, q_index, scale):
        k_cache[out_cache_loc] = k.to(k_cache.dtype)
        v_cache[out_cache_loc] = v.to(v_cache.dtype)
        if self._plan is None:
            raise RuntimeError("InvariantAttentionBackend.forward before begin_forward")
        prefix, extend, causal = self._plan
        return invariant_paged_attention(q, k_cache, v_cache, kv_indices, attn_mask, q_index, scale, prefix, extend,
                                         causal)
