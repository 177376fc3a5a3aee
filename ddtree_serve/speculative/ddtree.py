"""DDTree builder: the draft tree of a speculative step (DDTree, arXiv 2604.12989, Algorithm 1).

The drafter (DFlash) gives one distribution per depth, ``q_d = softmax(logits_d)`` for d = 1..L, so the
draft distribution over continuations factorises, ``Q(x_1..x_d) = prod_j q_j(x_j)``. The paper shows the
expected acceptance length of a tree equals the sum of ``Q(prefix)`` over its nodes, so the optimal tree
of B nodes is the set of the B most probable prefixes. That set is closed under taking prefixes and only
the top-K tokens of each depth can appear in it (K = min(B, V)); a best-first search over rank vectors
finds it in B pops: pop the best frontier node, push its next sibling (same parent, next rank) and its
first child (next depth, rank 0).

Output encoding is the retrieve-buffer layout of docs/DESIGN.md 4.1 (SGLang / sgl-kernel): local slot 0 is the
root (the last emitted token), slots 1..num_nodes hold the nodes in pop order (so parent < child and the
children of a node appear in descending cumulative log-probability), slots past num_nodes are padding
that no link reaches.

Deterministic tie-breaking (documented contract):
  * per depth, the K candidate tokens are ranked by draft log-probability, descending; equal values are
    ordered by ascending token id among the tokens ``torch.topk`` returns;
  * among frontier entries with equal cumulative log-probability the heap pops the shallower one first,
    then the one whose parent was popped earlier, then the lower rank. Sibling links follow pop order.
Nodes of zero draft probability (``-inf`` log-weight) are never added, so ``num_nodes`` can fall below the
budget (also when the budget exceeds the number of distinct prefixes, sum_d K^d).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ddtree_serve.model_executor.uploads import upload
from ddtree_serve.model_executor.vocab_shard import VocabShard
from ddtree_serve.speculative.ddtree_pop import (
    batched_chain,
    batched_pops,
    device_chain,
    device_pops,
    reference_pops,
)

_NEG_INF = float("-inf")
DFLASH, SUFFIX = 0, 1  # draft sources of a node (ddtree_serve/speculative/draft_sources.py)
DRAFT_SOURCES = ("dflash", "suffix")  # their names, by index


ROW_FIELDS = ("candidates", "parents", "depths", "node_logws", "num_nodes", "retrive_index", "retrive_next_token",
              "retrive_next_sibling", "positions", "tree_mask")  # DraftTree's per-request tensors
OPTIONAL_ROW_FIELDS = ("sources", "match_lens", "pop_depths", "pop_logws")  # the same, where not None


@dataclass
class DraftTree:
    """A batch of draft trees, D = 1 + max(budgets) slots per request (slot 0 = root).

    All tensors live on the device of the draft logits. Unused slots: candidates 0, parents -1, depths 0,
    node_logws -inf, links -1, positions = seq_len, mask row = itself only."""

    candidates: torch.Tensor  # [bs, D] int64, node tokens (root token at 0)
    parents: torch.Tensor  # [bs, D] int64, parent slot, -1 for root and unused
    depths: torch.Tensor  # [bs, D] int64, root 0
    node_logws: torch.Tensor  # [bs, D] float32, cumulative draft log-prob, root 0, unused -inf
    num_nodes: torch.Tensor  # [bs] int64, non-root nodes used
    retrive_index: torch.Tensor  # [bs, D] int64, b * D + i
    retrive_next_token: torch.Tensor  # [bs, D] int64, first child or -1
    retrive_next_sibling: torch.Tensor  # [bs, D] int64, next sibling (lower log-weight) or -1
    positions: torch.Tensor  # [bs, D] int64, seq_len + depth
    tree_mask: torch.Tensor  # [bs, D, D] bool, [b, i, j]: node i attends to node j
    sources: torch.Tensor | None = None  # [bs, D] int64 node's draft source (DFLASH, SUFFIX; -1 root, unused)
    match_lens: torch.Tensor | None = None  # [bs, D] int64 a suffix node's match length (0: other nodes)
    max_depth: int | None = None  # the deepest node's depth, as the host knows it (None: read depths back)
    on_host: dict[str, np.ndarray] | None = None  # host copies the tree was built from (no read back for them)
    pop_depths: torch.Tensor | None = None  # [bs, P] int64 the best-first pops behind the tree, P >= its nodes
    pop_logws: torch.Tensor | None = None  # [bs, P] float64 their log-weights (the auto budget learns from them)

    def row_fields(self) -> tuple[str, ...]:
        """The names of the per-request tensors this tree holds (``[bs, ...]``; ``retrive_index`` among them)."""
        return ROW_FIELDS + tuple(n for n in OPTIONAL_ROW_FIELDS if getattr(self, n) is not None)

    def numpy(self, name: str) -> np.ndarray:
        """Field ``name`` as a host array: the copy it was built from, or else read back from the device."""
        if self.on_host is not None and name in self.on_host:
            return self.on_host[name]
        return getattr(self, name).cpu().numpy()

    @property
    def batch_size(self) -> int:
        return int(self.candidates.shape[0])

    @property
    def num_slots(self) -> int:
        """D: slots per request, root included."""
        return int(self.candidates.shape[1])


def draft_topk(draft_logits: torch.Tensor, k: int, shard: VocabShard | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k draft log-probs (float64) and tokens per (request, depth), ordered (value desc, token asc):
    [bs, L, K] tensors on the logits' device that ``pop_nodes`` can reuse for every width up to ``k`` (the
    adaptive budget pops twice).

    One batched topk on raw logits minus one logsumexp (the full log_softmax is never materialised).
    ``shard``: the logits are this rank's vocabulary columns ``[bs, L, V/tp]`` (vocabulary-parallel TP): the
    top-k of every shard's top-k and the log-sum-exp of the shards' ones, ``tp * (k + 1)`` numbers a row."""
    logits = draft_logits.float()  # [bs, L, V]
    if shard is not None and shard.sharded:
        kk = min(k, logits.shape[-1])
        vals, ids = torch.topk(logits, kk, dim=-1)  # [bs, L, k'] this shard's
        pad = (*vals.shape[:-1], k - kk)
        vals = torch.cat([vals, vals.new_full(pad, float("-inf"))], -1)  # [bs, L, K]
        ids = torch.cat([ids + shard.start, ids.new_full(pad, shard.vocab)], -1)  # [bs, L, K] global ids
        lse = torch.logsumexp(shard.gather(torch.logsumexp(logits, dim=-1)), dim=0)  # [bs, L] over the ranks
        all_vals = torch.cat(list(shard.gather(vals)), -1)  # [bs, L, tp*K]
        all_ids = torch.cat(list(shard.gather(ids)), -1)  # [bs, L, tp*K]
        top_vals, pick = torch.topk(all_vals, k, dim=-1)  # [bs, L, K]
        top_ids = all_ids.gather(-1, pick)
        top_lp = top_vals - lse[..., None]  # [bs, L, K]
    else:
        top_vals, top_ids = torch.topk(logits, k, dim=-1)  # [bs, L, K] descending
        top_lp = top_vals - torch.logsumexp(logits, dim=-1, keepdim=True)  # [bs, L, K]
    # Deterministic order among equal values: ascending token id (stable sort of an id-sorted view).
    id_order = torch.argsort(top_ids, dim=-1)  # [bs, L, K]
    top_lp = top_lp.gather(-1, id_order)
    top_ids = top_ids.gather(-1, id_order)
    val_order = torch.argsort(top_lp, dim=-1, descending=True, stable=True)  # [bs, L, K]
    return top_lp.gather(-1, val_order).double(), top_ids.gather(-1, val_order)


def _host_pops(top_lp: np.ndarray, top_ids: np.ndarray, budgets: np.ndarray, depth_limits: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``batched_pops``' result from Algorithm 1's heap, one request at a time: on a CPU this Python loop is
    the faster of the two (docs/BENCHMARKS.md, benchmarks/bench_ddtree.py: ~3x at batch 128, budget 64)."""
    bs, _, k = top_lp.shape
    width = int(budgets.max()) if bs else 0
    tokens, parents = np.zeros((bs, width), dtype=np.int64), np.full((bs, width), -1, dtype=np.int64)
    depths, logws = np.zeros((bs, width), dtype=np.int64), np.full((bs, width), _NEG_INF)
    counts = np.zeros(bs, dtype=np.int64)
    for b in range(bs):
        kb, lim = min(int(budgets[b]), k), int(depth_limits[b])
        t, p, dep, w = reference_pops(top_lp[b, :lim, :kb].tolist(), top_ids[b, :lim, :kb].tolist(), int(budgets[b]), kb)
        n = counts[b] = len(t)
        tokens[b, :n], parents[b, :n], depths[b, :n], logws[b, :n] = t, p, dep, w
    return tokens, parents, depths, logws, counts


def _link_and_mask(parents: torch.Tensor, max_depth: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Retrieve links and ancestor mask from parent slots (slots in pop order). parents [bs, D]."""
    bs, d = parents.shape
    dev = parents.device
    idx = torch.arange(d, device=dev).expand(bs, d)  # [bs, D]
    used = parents >= 0  # [bs, D], non-root used nodes
    par0 = parents.clamp(min=0)  # [bs, D]
    # First child = smallest child slot (children are popped best first).
    first = torch.full((bs, d), d, dtype=torch.int64, device=dev)  # [bs, D]
    first.scatter_reduce_(1, par0, torch.where(used, idx, d), reduce="amin")
    next_token = torch.where(first < d, first, -1)  # [bs, D]
    # Next sibling = next slot with the same parent: sort by (parent, slot), link neighbours.
    key = torch.where(used, parents * d + idx, d * d + idx)  # [bs, D]
    order = torch.argsort(key, dim=1)  # [bs, D]
    sp = parents.gather(1, order)  # [bs, D]
    su = used.gather(1, order)  # [bs, D]
    same = su[:, :-1] & su[:, 1:] & (sp[:, :-1] == sp[:, 1:])  # [bs, D-1]
    next_sibling = torch.full((bs, d), -1, dtype=torch.int64, device=dev)  # [bs, D]
    next_sibling.scatter_(1, order[:, :-1], torch.where(same, order[:, 1:], -1))
    # Ancestor closure by pointer jumping: column cur+1 (column 0 absorbs "no ancestor").
    anc = torch.zeros(bs, d, d + 1, dtype=torch.bool, device=dev)  # [bs, D, D+1]
    cur = parents.clone()  # [bs, D]
    for _ in range(max_depth):
        anc.scatter_(2, (cur + 1).unsqueeze(-1), True)
        cur = torch.where(cur >= 0, parents.gather(1, cur.clamp(min=0)), -1)
    mask = anc[:, :, 1:] | torch.eye(d, dtype=torch.bool, device=dev)  # [bs, D, D]
    return next_token, next_sibling, mask


@dataclass
class PoppedNodes:
    """The best-first pop order of every request, before a tree is assembled (numpy, host memory).

    Row b holds ``counts[b]`` nodes in pop order (descending path probability); the first ``k`` of them are
    the optimal tree of budget ``k`` for every ``k <= counts[b]``, so one pop at the largest budget serves
    every smaller budget (``assemble_tree`` truncates). Unused entries: token 0, parent -1, depth 0,
    log-weight -inf."""

    tokens: np.ndarray  # [bs, B] int64
    parents: np.ndarray  # [bs, B] int64, parent slot (0 = root; slot of pop i is i + 1)
    depths: np.ndarray  # [bs, B] int64
    logws: np.ndarray  # [bs, B] float64, cumulative draft log-prob of the prefix
    counts: np.ndarray  # [bs] int64
    sources: np.ndarray | None = None  # [bs, B] int64 draft source per node (DRAFT_SOURCES); None: all DFlash
    match_lens: np.ndarray | None = None  # [bs, B] int64 suffix nodes: length of the match that proposed them
    evidence: np.ndarray | None = None  # [bs, 2] suffix drafts: the request's own (reached, offered) score sums

    def path_probs(self) -> np.ndarray:
        """Q(prefix) of every popped node, 0 for unused entries: [bs, B]. ``1 + cumsum(row)[k-1]`` is the
        expected number of tokens a budget-k tree emits if the drafter were the target (DDTree objective)."""
        return np.exp(self.logws)


def pop_nodes(
    draft_logits: torch.Tensor,
    budgets: torch.Tensor,
    chain: bool = False,
    max_depths: torch.Tensor | None = None,
    topk: tuple[torch.Tensor, torch.Tensor] | None = None,
    batched: bool | None = None,
) -> PoppedNodes:
    """Algorithm 1's pops for every request (see ``build_ddtree`` for the arguments). ``topk``: this
    ``draft_logits``'s ``draft_topk`` at a K of at least the widest budget (1 in chain mode), or None.
    ``batched``: pop with ``batched_pops`` (device ops) rather than the heap; None: on an accelerator only."""
    bs, depth_limit, vocab = draft_logits.shape
    budget_list = [int(x) for x in budgets.tolist()]
    if any(b < 0 for b in budget_list):
        raise ValueError(f"budgets must be >= 0, got {budget_list}")
    depth_list = (
        [depth_limit] * bs if max_depths is None else [min(int(x), depth_limit) for x in max_depths.tolist()]
    )
    budget_list = [bud if dep > 0 else 0 for bud, dep in zip(budget_list, depth_list, strict=True)]
    width = max(budget_list) if budget_list else 0
    k = 1 if chain else max(1, min(width, vocab))
    if width > 0:
        top_lp, top_ids = topk if topk is not None else draft_topk(draft_logits, k)  # [bs, L, K]
    out = PoppedNodes(
        tokens=np.zeros((bs, width), dtype=np.int64),
        parents=np.full((bs, width), -1, dtype=np.int64),
        depths=np.zeros((bs, width), dtype=np.int64),
        logws=np.full((bs, width), _NEG_INF, dtype=np.float64),
        counts=np.zeros(bs, dtype=np.int64),
    )
    if width > 0:
        args = (np.asarray(budget_list, dtype=np.int64), np.asarray(depth_list, dtype=np.int64))
        if chain:
            popped = batched_chain(top_lp.cpu().numpy(), top_ids.cpu().numpy(), *args)
        elif not (batched if batched is not None else top_lp.device.type != "cpu"):  # heap: faster on a CPU
            popped = _host_pops(top_lp.numpy(), top_ids.numpy(), *args)
        else:  # on the accelerator, no Python loop over requests or nodes; the [bs, W] results copied back at the end
            popped = batched_pops(top_lp, top_ids, *args)
        out.tokens, out.parents, out.depths, out.logws, out.counts = popped
    return out


def assemble_tree(
    popped: PoppedNodes,
    budgets: torch.Tensor,
    root_tokens: torch.Tensor,
    seq_lens: torch.Tensor,
    device: torch.device | str,
    width: int | None = None,
) -> DraftTree:
    """The retrieve-buffer tree of the first ``min(budgets[b], counts[b])`` pops of each request
    (budgets [bs] int64 >= 0; a prefix of the pop order is itself the optimal tree of that size). ``width``: D
    at least this (unused slots pad every request to it: a captured graph's width)."""
    bs = int(popped.counts.shape[0])
    n_used = np.minimum(np.asarray(budgets.tolist(), dtype=np.int64).reshape(bs), popped.counts)  # [bs]
    d = max(1 + (int(n_used.max()) if bs else 0), width or 0)
    used = np.arange(d - 1)[None, :] < n_used[:, None]  # [bs, D-1]

    def col(a: np.ndarray, fill: float) -> np.ndarray:  # [bs, D-1] the pops' first D-1 columns, padded with fill
        out = np.full((bs, d - 1), fill, dtype=a.dtype)
        w = min(d - 1, a.shape[1])
        out[:, :w] = a[:, :w]
        return out

    tokens = np.zeros((bs, d), dtype=np.int64)  # [bs, D]
    parents = np.full((bs, d), -1, dtype=np.int64)  # [bs, D]
    depths = np.zeros((bs, d), dtype=np.int64)  # [bs, D]
    logws = np.full((bs, d), _NEG_INF, dtype=np.float64)  # [bs, D]
    logws[:, 0] = 0.0
    tokens[:, 1:] = np.where(used, col(popped.tokens, 0), 0)
    parents[:, 1:] = np.where(used, col(popped.parents, -1), -1)
    depths[:, 1:] = np.where(used, col(popped.depths, 0), 0)
    logws[:, 1:] = np.where(used, col(popped.logws, _NEG_INF), _NEG_INF)

    sources = match_lens = None
    if popped.sources is not None:
        sources = np.full((bs, d), -1, dtype=np.int64)  # [bs, D]
        sources[:, 1:] = np.where(used, col(popped.sources, -1), -1)
    if popped.match_lens is not None:
        match_lens = np.zeros((bs, d), dtype=np.int64)  # [bs, D]
        match_lens[:, 1:] = np.where(used, col(popped.match_lens, 0), 0)

    dev = torch.device(device)  # the host arrays go up asynchronously (no sync: model_executor/uploads.py)
    candidates = upload(torch.as_tensor(tokens), dev)  # [bs, D]
    candidates[:, 0] = root_tokens.to(device=dev, dtype=torch.int64)
    parents_t = upload(torch.as_tensor(parents), dev)  # [bs, D]
    depths_t = upload(torch.as_tensor(depths), dev)  # [bs, D]
    max_depth = int(depths.max()) if depths.size else 0
    next_token, next_sibling, mask = _link_and_mask(parents_t, max_depth)
    return DraftTree(
        candidates=candidates,
        parents=parents_t,
        depths=depths_t,
        node_logws=upload(torch.as_tensor(logws.astype(np.float32)), dev),
        num_nodes=upload(torch.as_tensor(n_used), dev),
        retrive_index=torch.arange(bs * d, dtype=torch.int64, device=dev).view(bs, d),
        retrive_next_token=next_token,
        retrive_next_sibling=next_sibling,
        positions=seq_lens.to(device=dev, dtype=torch.int64).view(bs, 1) + depths_t,
        tree_mask=mask,
        sources=None if sources is None else upload(torch.as_tensor(sources), dev),
        match_lens=None if match_lens is None else upload(torch.as_tensor(match_lens), dev),
        max_depth=max_depth,
        on_host=dict(depths=depths, node_logws=logws.astype(np.float32), num_nodes=n_used,
                     **({} if sources is None else dict(sources=sources)),
                     **({} if match_lens is None else dict(match_lens=match_lens))),
    )


def assemble_device_tree(
    pops: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    root_tokens: torch.Tensor,
    seq_lens: torch.Tensor,
    width: int,
    max_depth: int,
) -> DraftTree:
    """``assemble_tree`` of pops that never left the device (``ddtree_pop.device_pops`` / ``device_chain``: tokens,
    parents, depths, log-weights [bs, W], counts [bs]), every request at ``width`` >= W + 1 slots, nothing read
    back: the sizes are the host's (``width``; ``max_depth``, a bound on the deepest node: the pointer jumps and
    the verification walk run that many levels). The tree equals ``assemble_tree``'s of the same pops read back
    at that width (tests/speculative/test_device_tree.py); ``on_host`` is None (no host copy exists)."""
    tokens, parents, depths, logws, counts = pops  # [bs, W] x 4, [bs]
    bs, w = tokens.shape
    if width < w + 1:
        raise ValueError(f"width {width} cannot hold {w} nodes and the root")

    def col(a: torch.Tensor, fill: float, dtype: torch.dtype = torch.int64) -> torch.Tensor:  # [bs, D]
        out = torch.full((bs, width), fill, dtype=dtype, device=a.device)
        out[:, 1:w + 1] = a
        return out

    candidates = col(tokens, 0)  # [bs, D]
    candidates[:, 0] = root_tokens
    parents_t, depths_t = col(parents, -1), col(depths, 0)  # [bs, D]
    node_logws = col(logws.float(), _NEG_INF, torch.float32)  # [bs, D]
    node_logws[:, 0] = 0.0
    next_token, next_sibling, mask = _link_and_mask(parents_t, max_depth)
    return DraftTree(
        candidates=candidates,
        parents=parents_t,
        depths=depths_t,
        node_logws=node_logws,
        num_nodes=counts,
        retrive_index=torch.arange(bs * width, dtype=torch.int64, device=tokens.device).view(bs, width),
        retrive_next_token=next_token,
        retrive_next_sibling=next_sibling,
        positions=seq_lens.to(dtype=torch.int64).view(bs, 1) + depths_t,
        tree_mask=mask,
        max_depth=max_depth,
    )


def build_device_tree(topk: tuple[torch.Tensor, torch.Tensor], budgets: torch.Tensor, limits: torch.Tensor,
                      shape: tuple[int, int, bool], root_tokens: torch.Tensor, seq_lens: torch.Tensor, width: int,
                      pairs: tuple[torch.Tensor, torch.Tensor] | None, pop_width: int = 0) -> DraftTree:
    """The fixed-budget tree of every request from its ``draft_topk`` ([bs, L, K], K >= the budget; 1 in chain
    mode), popped and assembled on the device at ``width`` slots with no read back and no copy up (``pop_nodes``
    + ``assemble_tree`` read the pops back to the host), so a CUDA graph can capture it
    (ddtree_serve/speculative/tree_graphs.py). budgets, limits [bs] int64 device tensors: nodes and depth cap
    per request (0 nodes where the cap is 0); ``shape``: (budget = the widest, a bound on the deepest node,
    chain) as the host knows them; ``pairs``: ``ddtree_pop.device_pairs(max(budget, pop_width), K)`` (None in
    chain mode). ``pop_width`` > budget (every row's budget ``budget`` or 0): pop that many (K >= it), build the
    tree from the first ``budget`` pops (the optimal tree of that budget: the pop order's prefix property), keep every pop's depth and log-weight
    in ``pop_depths`` / ``pop_logws`` (the auto budget's view past the tree it chose, speculative/auto_device.py)."""
    budget, deepest, chain = shape
    if chain:
        pops = device_chain(*topk, torch.minimum(budgets, limits), budget)
        return assemble_device_tree(pops, root_tokens, seq_lens, width, deepest)
    if pop_width <= budget:
        return assemble_device_tree(device_pops(*topk, budgets, limits, budget, pairs), root_tokens, seq_lens, width,
                                    deepest)
    wide = device_pops(*topk, torch.where(budgets > 0, pop_width, 0), limits, pop_width, pairs)  # [bs, P] ...
    tokens, parents, depths, logws, counts = wide
    narrow = (tokens[:, :budget], parents[:, :budget], depths[:, :budget], logws[:, :budget],
              torch.minimum(counts, budgets))  # the first pops: a parent pops before its child
    tree = assemble_device_tree(narrow, root_tokens, seq_lens, width, deepest)
    tree.pop_depths, tree.pop_logws = depths, logws
    return tree


def build_ddtree(
    draft_logits: torch.Tensor,
    budgets: torch.Tensor,
    root_tokens: torch.Tensor,
    seq_lens: torch.Tensor,
    chain: bool = False,
    max_depths: torch.Tensor | None = None,
) -> DraftTree:
    """Build one DDTree per request (arXiv 2604.12989, Algorithm 1).

    draft_logits [bs, L, V]: the drafter's logits for depths 1..L. budgets [bs] int64: non-root nodes per
    request (0 -> root only). root_tokens [bs]: last emitted token. seq_lens [bs]: position of the root.
    chain=True builds the top-1 path of length min(L, budget) instead (plain DFlash).
    max_depths [bs] (optional): request b only uses depths 1..max_depths[b] (a request close to
    max_tokens gains nothing from deeper nodes); the tree is then optimal over that truncated draft.
    The node set of request b is exactly the budgets[b] most probable prefixes under
    Q = prod_d softmax(draft_logits[b, d]) (ties: see the module docstring)."""
    popped = pop_nodes(draft_logits, budgets, chain=chain, max_depths=max_depths)
    return assemble_tree(popped, torch.as_tensor(popped.counts), root_tokens, seq_lens, draft_logits.device)
