"""DDTree's best-first pops (arXiv 2604.12989, Algorithm 1) for a whole batch at once, with no Python loop over
requests or nodes: a loop over the L draft depths of array operations over ``[bs, candidates]``.

Algorithm 1 pops the ``B`` most probable prefixes with a heap, one request at a time (``reference_pops``, kept
as the oracle of the tests). The same set, in the same order, follows level by level:

* every tree node is among the top ``B`` nodes of its own depth, and its parent is among the top ``B`` of the
  depth above (a parent ranks above its child: draft log-probs are <= 0 and ties go to the shallower node);
* the depth-d candidates are (parent i, rank r) pairs over depth d-1's kept nodes (sorted best first) and the
  depth-d top-K tokens (sorted best first); the pair (i, r) is dominated by the ``(i + 1)(r + 1) - 1`` pairs
  (i' <= i, r' <= r), so only pairs with ``(i + 1)(r + 1) <= B`` can be among the top ``B`` (~B ln B pairs,
  not B x K);
* a stable sort of each depth's candidates (laid out in (i, r) order) by log-weight keeps the heap's
  tie-breaking (equal weight: earlier parent, then lower rank), and a stable sort of all kept nodes (laid out
  depth by depth) gives the heap's pop order (equal weight: shallower first).

Log-weights are the same float64 sums the heap forms (``parent + lp[rank]``), so the output equals the heap's
bit for bit, ties included (tests/speculative/test_ddtree_pop.py). The first ``b`` pops are the optimal tree of
budget ``b``, so rows with different budgets share one pass at the widest budget and are cut after it.

It runs where the draft logits are: on an accelerator it is ~10 small kernels per depth, whatever the batch,
and the [bs, W] results copied back at the end in one read (no host sync before it); on a CPU the heap is measured faster (~3x at batch 128, budget 64:
benchmarks/bench_ddtree.py), so ``ddtree_serve.speculative.ddtree.pop_nodes`` runs the heap there.
"""

from __future__ import annotations

import heapq
from functools import lru_cache

import numpy as np
import torch

from ddtree_serve.model_executor.uploads import upload

_NEG_INF = float("-inf")


@lru_cache(maxsize=64)
def _pairs(width: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(parent index, rank) pairs with (i + 1)(r + 1) <= width, r < k, in (i, r) order: two [P] int64 arrays."""
    ii, rr = [], []
    for i in range(width):
        for r in range(min(k, width // (i + 1))):
            ii.append(i)
            rr.append(r)
    return np.asarray(ii, dtype=np.int64), np.asarray(rr, dtype=np.int64)


def _best_w(cand: torch.Tensor, width: int) -> torch.Tensor:
    """Column indices of each row's ``width`` largest entries in stable descending order (equal values by
    ascending column): [bs, width]. One stable sort: no host sync (a top-k would need a tie check read back)."""
    return torch.sort(cand, dim=1, descending=True, stable=True).indices[:, :width]


def batched_pops(
    top_lp: torch.Tensor, top_ids: torch.Tensor, budgets: np.ndarray, depth_limits: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Algorithm 1's pops for every request, on the device of its inputs. top_lp / top_ids [bs, L, K]: per-depth
    top-K draft log-probs (float64, sorted descending, ties by token id) and tokens; budgets [bs] >= 0;
    depth_limits [bs] in 0..L (int64 host arrays: the width is known without reading the device).

    Returns host arrays tokens, parents (slot: 0 = root, pop i is slot i + 1), depths, logws ([bs, W], W = max
    budget) and counts [bs]; entries past a row's count are token 0, parent -1, depth 0, log-weight -inf:
    ``device_pops`` and its one read back."""
    bs, _, k = top_lp.shape
    width = int(budgets.max()) if bs else 0
    dev = top_lp.device
    tokens, parents, depths, logws, counts = device_pops(  # (asynchronous copies up: model_executor/uploads.py)
        top_lp, top_ids, upload(torch.as_tensor(budgets), dev), upload(torch.as_tensor(depth_limits), dev), width,
        device_pairs(width, k, dev))
    bits = logws.view(torch.int64)  # [bs, W] the float64 weights' bits
    out = torch.cat([tokens, parents, depths, bits, counts[:, None]], dim=1).cpu().numpy()  # [bs, 4W + 1]: the read
    parts = (out[:, :width], out[:, width:2 * width], out[:, 2 * width:3 * width], out[:, 3 * width:4 * width],
             out[:, 4 * width])
    tok, par, dep, lw, cnt = (np.ascontiguousarray(a) for a in parts)
    return tok, par, dep, lw.view(np.float64), cnt


def device_pairs(width: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``_pairs(width, min(k, width))`` on ``device``: the (parent index, rank) candidates ``device_pops`` reads."""
    return tuple(upload(torch.as_tensor(a), device) for a in _pairs(width, min(k, width)))  # [P], [P]


def device_pops(
    top_lp: torch.Tensor, top_ids: torch.Tensor, budgets: torch.Tensor, limits: torch.Tensor, width: int,
    pairs: tuple[torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``batched_pops``' arrays left on the device (nothing read back, nothing copied up: every input is a device
    tensor or a host int, so the op sequence can be captured in a CUDA graph): tokens, parents, depths [bs, W]
    int64, log-weights [bs, W] float64 and counts [bs] int64. budgets, limits [bs] int64 device tensors (budget
    and depth limit per request), ``width`` W >= every budget, ``pairs``: ``device_pairs(W, K)``."""
    bs, depth_limit, k = top_lp.shape
    dev = top_lp.device
    if width == 0 or depth_limit == 0:
        return (torch.zeros((bs, width), dtype=torch.int64, device=dev),
                torch.full((bs, width), -1, dtype=torch.int64, device=dev),
                torch.zeros((bs, width), dtype=torch.int64, device=dev),
                torch.full((bs, width), _NEG_INF, dtype=torch.float64, device=dev),
                torch.zeros(bs, dtype=torch.int64, device=dev))
    lp, ids = top_lp, top_ids  # [bs, L, K]
    kw = min(k, width)
    lvl_w = torch.full((bs, width), _NEG_INF, dtype=torch.float64, device=dev)  # [bs, W] a depth's kept weights
    lvl_w[:, :kw] = lp[:, 0, :kw]
    lvl_w.masked_fill_((limits < 1)[:, None], _NEG_INF)  # a row mask by masked_fill: no host sync
    lvl_rank = torch.zeros((bs, width), dtype=torch.int64, device=dev)  # [bs, W]
    lvl_rank[:, :kw] = torch.arange(kw, device=dev)
    kept_w, kept_par = [lvl_w], [torch.zeros((bs, width), dtype=torch.int64, device=dev)]
    kept_tok = [ids[:, 0].gather(1, lvl_rank)]
    pi, pr = pairs  # [P]
    for d in range(1, depth_limit):  # every depth (an early stop would read the device back)
        cand = lvl_w.index_select(1, pi) + lp[:, d].index_select(1, pr)  # [bs, P] the heap's float64 sums
        cand.masked_fill_((limits <= d)[:, None], _NEG_INF)
        order = _best_w(cand, width)  # [bs, W] best first, ties in (parent, rank) order
        lvl_w = cand.gather(1, order)  # [bs, W]
        lvl_rank = pr.take(order)  # [bs, W]
        kept_w.append(lvl_w)
        kept_par.append(pi.take(order))
        kept_tok.append(ids[:, d].gather(1, lvl_rank))
    all_w = torch.cat(kept_w, dim=1)  # [bs, levels * W], depth-major
    order = _best_w(all_w, width)  # [bs, W] pop order; ties: shallower first
    slot = torch.zeros_like(all_w, dtype=torch.int64)  # [bs, levels * W] pop slot of every kept node
    slot.scatter_(1, order, torch.arange(1, width + 1, device=dev).expand(bs, width))
    depth0 = order // width  # [bs, W] 0-based depth
    par = torch.cat(kept_par, dim=1).gather(1, order)  # [bs, W] parent's index in the depth above
    parent_slot = torch.where(depth0 == 0, 0, slot.gather(1, (depth0 - 1).clamp(min=0) * width + par))  # [bs, W]
    w = all_w.gather(1, order)  # [bs, W]
    counts = torch.minimum(torch.isfinite(w).sum(1), budgets)  # [bs]
    used = torch.arange(width, device=dev)[None, :] < counts[:, None]  # [bs, W]
    tokens = torch.where(used, torch.cat(kept_tok, dim=1).gather(1, order), 0)
    return (tokens, torch.where(used, parent_slot, -1), torch.where(used, depth0 + 1, 0),
            torch.where(used, w, _NEG_INF), counts)


def device_chain(top_lp: torch.Tensor, top_ids: torch.Tensor, lengths: torch.Tensor, width: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``batched_chain`` on the device (nothing read back or copied up): the same arrays as ``device_pops``.
    lengths [bs] int64 device tensor: min(budget, depth limit) per request; ``width`` >= every budget."""
    bs, depth_limit, _ = top_lp.shape
    n, dev = min(width, depth_limit), top_lp.device
    cum = torch.cumsum(top_lp[:, :n, 0], dim=1)  # [bs, n]
    counts = torch.minimum(lengths, torch.isfinite(cum).sum(1))  # [bs]
    used = torch.arange(n, device=dev)[None, :] < counts[:, None]  # [bs, n]
    tokens = torch.zeros((bs, width), dtype=torch.int64, device=dev)
    parents = torch.full((bs, width), -1, dtype=torch.int64, device=dev)
    depths = torch.zeros((bs, width), dtype=torch.int64, device=dev)
    logws = torch.full((bs, width), _NEG_INF, dtype=torch.float64, device=dev)
    tokens[:, :n] = torch.where(used, top_ids[:, :n, 0], 0)
    parents[:, :n] = torch.where(used, torch.arange(n, device=dev), -1)
    depths[:, :n] = torch.where(used, torch.arange(1, n + 1, device=dev), 0)
    logws[:, :n] = torch.where(used, cum, _NEG_INF)
    return tokens, parents, depths, logws, counts


def batched_chain(
    top_lp: np.ndarray, top_ids: np.ndarray, budgets: np.ndarray, depth_limits: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Chain mode (plain DFlash) for every request: the top-1 path of length min(depth limit, budget), cut at
    the first zero-probability token. Same arrays as ``batched_pops``."""
    bs, depth_limit, _ = top_lp.shape
    width = int(budgets.max()) if bs else 0
    n = min(width, depth_limit)
    cum = np.cumsum(top_lp[:, :n, 0], axis=1)  # [bs, n]
    counts = np.minimum(np.minimum(budgets, depth_limits), np.isfinite(cum).sum(1)).astype(np.int64)  # [bs]
    tokens = np.zeros((bs, width), dtype=np.int64)
    parents = np.full((bs, width), -1, dtype=np.int64)
    depths = np.zeros((bs, width), dtype=np.int64)
    logws = np.full((bs, width), _NEG_INF, dtype=np.float64)
    used = np.arange(n)[None, :] < counts[:, None]  # [bs, n]
    tokens[:, :n] = np.where(used, top_ids[:, :n, 0], 0)
    parents[:, :n] = np.where(used, np.arange(n), -1)
    depths[:, :n] = np.where(used, np.arange(1, n + 1), 0)
    logws[:, :n] = np.where(used, cum, _NEG_INF)
    return tokens, parents, depths, logws, counts


def reference_pops(lp: list[list[float]], tok: list[list[int]], budget: int, k: int
                   ) -> tuple[list[int], list[int], list[int], list[float]]:
    """Algorithm 1 for one request with a heap, as the paper states it: pop ``budget`` prefixes best first.
    Returns per-node token, parent slot, depth and cumulative log-weight in pop order (slot = position + 1).
    The oracle of ``batched_pops``; benchmarks/bench_ddtree.py times both."""
    depth_limit = len(lp)
    tokens: list[int] = []
    parents: list[int] = []
    depths: list[int] = []
    logws: list[float] = []
    if budget <= 0 or depth_limit == 0 or lp[0][0] == _NEG_INF:
        return tokens, parents, depths, logws
    # Entry: (-logw, depth, parent_slot, rank, parent_logw); ties -> shallower, earlier parent, lower rank.
    heap = [(-lp[0][0], 1, 0, 0, 0.0)]
    while heap and len(tokens) < budget:
        neg_logw, depth, parent, rank, parent_logw = heapq.heappop(heap)
        logw = -neg_logw
        tokens.append(tok[depth - 1][rank])
        parents.append(parent)
        depths.append(depth)
        logws.append(logw)
        slot = len(tokens)
        if rank + 1 < k:
            sib = parent_logw + lp[depth - 1][rank + 1]
            if sib != _NEG_INF:
                heapq.heappush(heap, (-sib, depth, parent, rank + 1, parent_logw))
        if depth < depth_limit:
            child = logw + lp[depth][0]
            if child != _NEG_INF:
                heapq.heappush(heap, (-child, depth + 1, slot, 0, logw))
    return tokens, parents, depths, logws
