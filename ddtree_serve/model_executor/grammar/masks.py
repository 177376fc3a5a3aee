"""Token bitmasks of a batch: plain decode rows, one row per draft-tree node, and drafter-side masking.

Bitmask layout (xgrammar's): int32 ``[..., W]``, W = ceil(V / 32); bit ``t & 31`` of word ``t >> 5`` is 1
when token ``t`` is allowed. Applying a mask sets the logits of disallowed tokens to -inf, so softmax, the
top-k/top-p/min-p filters and the argmax all act on the grammar-restricted distribution (renormalised over
the allowed tokens); penalties keep -inf at -inf. Rows of requests without a grammar are never touched, so
constrained and free requests share a batch.

Target side (exact; DDTree verification stays lossless): the mask of tree node i is the grammar's
next-token mask after the path root..i (``GrammarMatcher.traverse_draft_tree``: a walk that accepts a
child's token on entering it and rolls back on leaving). Rows that verification can never sample from get
no mask: padding slots, nodes whose token the grammar rejects at their parent (their parent's mask gives
them probability 0) and their subtrees. A node holding a stop token gets the stop-only mask, as plain
decoding does after the grammar terminates.

Drafter side (best effort, for acceptance): the drafter predicts a block of depths in parallel, and the
mask at depth d depends on the tokens above it. ``mask_draft_logits`` masks depth 1 exactly and depth d > 1
with the mask after the masked top-1 tokens of depths 1..d-1 (each the best of the depth's 8 raw candidates
the grammar allows, all read back at once; the chain ends where none is allowed); ``prune_popped`` then walks every popped DDTree node with the matcher and removes the ones the
grammar rejects (and their subtrees), so the tree holds only allowed tokens; nodes are popped with a
doubled budget first so that pruning rarely leaves the tree short.

Every walk moves the request's ``GrammarState`` (``push`` / ``pop`` / ``fill``), never the matcher directly,
so a reasoning gate (state.py: the grammar dormant until ``</think>``) holds on every path: a tree whose root
is dormant is walked node by node (``_walk_rows``), an awake one by xgrammar's ``traverse_draft_tree``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ddtree_serve.model_executor.grammar.state import GrammarState, stop_only_row
from ddtree_serve.model_executor.read_back import read_back
from ddtree_serve.model_executor.uploads import upload
from ddtree_serve.model_executor.vocab_shard import VocabShard


def bitmask_width(vocab: int) -> int:
    return (vocab + 31) // 32


def allowed_bits(bitmask: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Whether ``tokens`` [...] are allowed by the rows ``bitmask`` [..., W] (same leading dims) -> bool."""
    words = bitmask.gather(-1, (tokens >> 5).unsqueeze(-1)).squeeze(-1)  # [...]
    return ((words >> (tokens & 31)) & 1).bool()


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """In place: ``logits[r, t] = -inf`` for every disallowed ``t`` of the rows ``rows``.
    logits [N, V] float; bitmask [N, W] int32 (any device; moved to the logits' device)."""
    if not rows:
        return
    import xgrammar as xgr

    vocab = logits.shape[-1]
    mask = upload(bitmask, logits.device) if bitmask.device != logits.device else bitmask  # asynchronous copy up
    xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=vocab, indices=list(rows))


def apply_bitmask_cols(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int], shard: VocabShard) -> None:
    """``apply_bitmask`` on ``shard``'s columns: logits [N, V/tp] (in place), bitmask [N, W] of the whole
    vocabulary; the same -inf entries as masking the gathered row."""
    if not rows:
        return
    if not shard.sharded:
        apply_bitmask(logits, bitmask, rows)
        return
    idx = torch.tensor(list(rows), dtype=torch.int64)  # [r]
    ids = torch.arange(shard.start, shard.end)  # [V/tp] global token ids of the columns
    words = bitmask[idx][:, ids >> 5]  # [r, V/tp]
    allowed = upload(((words >> (ids & 31)) & 1).bool(), logits.device)  # [r, V/tp] (asynchronous copies up)
    dev_idx = upload(idx, logits.device)
    logits[dev_idx] = logits[dev_idx].masked_fill(~allowed, float("-inf"))


def mask_logits(states: Sequence[GrammarState | None], logits: torch.Tensor,
                shard: VocabShard | None = None) -> torch.Tensor:
    """Plain decode: logits [bs, V] (``shard``: its columns [bs, V/tp]) -> a masked copy (the input itself
    when no request has a grammar)."""
    rows = [b for b, s in enumerate(states) if s is not None]
    if not rows:
        return logits
    shard = shard if shard is not None else VocabShard.whole(logits.shape[-1])
    bitmask = torch.full((len(states), bitmask_width(shard.vocab)), -1, dtype=torch.int32)  # [bs, W]
    for b in rows:
        states[b].fill(bitmask, b)
    out = logits.float().clone()  # [bs, V]
    apply_bitmask_cols(out, bitmask, rows, shard)
    return out


def tree_bitmask(states: Sequence[GrammarState | None], candidates: torch.Tensor, parents: torch.Tensor,
                 next_token: torch.Tensor, next_sibling: torch.Tensor, vocab: int) -> torch.Tensor:
    """One mask row per tree node: int32 [bs, D, W] on the CPU (all-ones rows: no mask). Tree tensors
    [bs, D] as in ``ddtree_serve.speculative.ddtree.DraftTree`` (slot 0 = root, parents -1 for root and padding)."""
    bs, d = candidates.shape
    w = bitmask_width(vocab)
    bitmask = torch.full((bs, d, w), -1, dtype=torch.int32)  # [bs, D, W]
    cand, par, nxt, sib = (torch.as_tensor(a) for a in read_back(candidates, parents, next_token, next_sibling))
    for b, s in enumerate(states):
        if s is None:
            continue
        if s.failed or s.terminated or d == 1:
            s.fill(bitmask[b], 0)
            continue
        if s.dormant:  # the reasoning may end inside the tree: walk it through the gate
            _walk_rows(s, cand[b].tolist(), nxt[b].tolist(), sib[b].tolist(), bitmask[b])
        else:
            s.matcher.traverse_draft_tree(nxt[b].contiguous(), sib[b].contiguous(), cand[b].contiguous(),
                                          bitmask[b])
        _fix_unreachable(bitmask[b], cand[b], par[b], s.stop_token_ids)
    return bitmask


def _walk_rows(s: GrammarState, cand: list[int], nxt: list[int], sib: list[int], bitmask: torch.Tensor) -> None:
    """Rows [D, W] of one request's tree from its state: a depth-first walk (first child ``nxt``, next sibling
    ``sib``, -1: none) that pushes a child's token on entering it and pops it on leaving. Rows of nodes whose
    token the state rejects (and their subtrees) are left as they are (``_fix_unreachable`` clears them)."""
    s.fill(bitmask, 0)
    stack = [nxt[0]]  # per depth: the next child to visit (-1: none left)
    while stack:
        i = stack[-1]
        if i < 0:
            stack.pop()
            if stack:
                s.pop(1)
            continue
        stack[-1] = sib[i]
        if s.push(cand[i]):
            s.fill(bitmask, i)
            if cand[i] in s.stop_token_ids:  # nothing follows a stop token
                s.pop(1)
            else:
                stack.append(nxt[i])


def _fix_unreachable(bitmask: torch.Tensor, cand: torch.Tensor, par: torch.Tensor, stop_ids: tuple[int, ...]) -> None:
    """Rows of one request's tree [D, W]: nodes the grammar rejects (or below one) and padding -> all ones;
    nodes holding a stop token -> stop only. Parents precede children (pop order), so one pass suffices."""
    d = cand.shape[0]
    allow = allowed_bits(bitmask[par.clamp(min=0)], cand).tolist()  # [D] token allowed by its parent's row
    ok = [True] + [False] * (d - 1)  # node reachable under the grammar
    terminal = [False] * d  # reachable node holding a stop token
    stops = set(stop_ids)
    plist, clist = par.tolist(), cand.tolist()
    for i in range(1, d):
        p = plist[i]
        if p >= 0 and ok[p] and not terminal[p] and allow[i]:
            ok[i] = True
            terminal[i] = clist[i] in stops
    bitmask[~torch.tensor(ok)] = -1
    for i in range(d):
        if terminal[i]:
            stop_only_row(bitmask, i, stop_ids)


def mask_tree_logits(states: Sequence[GrammarState | None], tree, logits: torch.Tensor,
                     copy: bool = True, shard: VocabShard | None = None) -> torch.Tensor:
    """Target logits [bs, D, V] of a draft tree (``shard``: its columns [bs, D, V/tp]) -> masked logits (the
    input when no request has a grammar). ``copy`` False masks float32 logits in place (no second [bs, D, V]
    buffer when no raw logprobs are needed afterwards)."""
    rows_b = [b for b, s in enumerate(states) if s is not None]
    if not rows_b:
        return logits
    bs, d, width = logits.shape
    shard = shard if shard is not None else VocabShard.whole(width)
    bitmask = tree_bitmask(states, tree.candidates, tree.parents, tree.retrive_next_token,
                           tree.retrive_next_sibling, shard.vocab)  # [bs, D, W]
    out = logits.float()
    out = (out.clone() if copy and out is logits else out).view(bs * d, width)  # [bs*D, V]
    rows = [b * d + i for b in rows_b for i in range(d)]
    apply_bitmask_cols(out, bitmask.view(bs * d, -1), rows, shard)
    return out.view(bs, d, width)


DRAFT_MASK_TOPK = 8  # drafter side: candidates per depth read back for the masked top-1 chain


def mask_draft_logits(states: Sequence[GrammarState | None], draft_logits: torch.Tensor,
                      shard: VocabShard | None = None) -> None:
    """In place on the drafter's logits [bs, L, V] (``shard``: its columns [bs, L, V/tp]): depth 1 with the exact
    mask, depth d > 1 with the mask after the masked top-1 tokens above it. The masked top-1 of a depth is the
    best of its ``DRAFT_MASK_TOPK`` raw candidates the mask allows, all of them read back at once (one read a
    step, not one a depth); the chain stops at a depth where none is allowed, at a stop token or at a token the
    grammar rejects: deeper depths stay unmasked and ``prune_popped`` removes what the grammar rejects there."""
    rows = [b for b, s in enumerate(states) if s is not None and not s.failed]
    if not rows:
        return
    bs, depth, cols = draft_logits.shape
    shard = shard if shard is not None else VocabShard.whole(cols)
    k = min(DRAFT_MASK_TOPK, cols)
    picked = draft_logits.index_select(0, upload(rows, draft_logits.device, torch.int64)).float()  # [r, L, V/tp]
    vals, ids = torch.topk(picked, k, dim=-1)  # [r, L, k]
    if shard.sharded:  # the best k of every shard's best k (global ids)
        vals, ids = torch.cat(list(shard.gather(vals)), -1), torch.cat(list(shard.gather(ids + shard.start)), -1)
        vals, pick = torch.topk(vals, k, dim=-1)  # [r, L, k]
        ids = ids.gather(-1, pick)
    top_vals, top_ids = read_back(vals, ids)  # [r, L, k] host: the one read
    bitmask = torch.full((bs, depth, bitmask_width(shard.vocab)), -1, dtype=torch.int32)  # [bs, L, W]
    for j, b in enumerate(rows):
        s, taken = states[b], 0
        for dep in range(depth):
            s.fill(bitmask[b], dep)
            if s.terminated or dep + 1 == depth:
                break
            words = bitmask[b, dep].numpy().view(np.uint32)  # [W]
            allowed = [int(t) for t, v in zip(top_ids[j, dep], top_vals[j, dep], strict=True)
                       if v > -np.inf and (words[t >> 5] >> (t & 31)) & 1]
            if not allowed or allowed[0] in s.stop_token_ids or not s.push(allowed[0]):
                break
            taken += 1
        if taken:
            s.pop(taken)
    flat = [b * depth + dep for b in rows for dep in range(depth)]  # all-ones rows leave their logits as they are
    apply_bitmask_cols(draft_logits.view(bs * depth, cols), bitmask.view(bs * depth, -1), flat, shard)


def draft_pop_budgets(states: Sequence[GrammarState | None], budgets: torch.Tensor) -> torch.Tensor:
    """Budgets to pop with before pruning: doubled for constrained requests. budgets [bs] int64."""
    over = budgets.clone()  # [bs]
    for b, s in enumerate(states):
        if s is not None:
            over[b] = 2 * budgets[b]
    return over


def prune_popped(popped, states: Sequence[GrammarState | None], budgets: torch.Tensor):
    """Drop the popped nodes the grammar rejects (and their subtrees), keep at most ``budgets[b]`` of the
    rest in pop order (still prefix-closed: a parent pops before its children), renumber the parent slots
    and cut the arrays to ``max(budgets)`` columns. ``popped``: ``ddtree_serve.speculative.ddtree.PoppedNodes`` (modified
    in place and returned)."""
    for b, s in enumerate(states):
        n = int(popped.counts[b])
        if s is None or n == 0:
            continue
        keep = _walk(s, popped.tokens[b, :n].tolist(), popped.parents[b, :n].tolist())
        idx = np.nonzero(keep)[0][: int(budgets[b])]  # kept pops, in pop order
        slot = np.zeros(n + 1, dtype=np.int64)  # old slot -> new slot (0: root)
        slot[idx + 1] = np.arange(1, len(idx) + 1)
        m = len(idx)
        arrays = [(popped.tokens, 0), (popped.depths, 0), (popped.logws, -np.inf)]
        for extra in (popped.sources, popped.match_lens):  # a node's draft source and match length follow it
            if extra is not None:
                arrays.append((extra, 0))
        for arr, fill in arrays:
            arr[b, :m] = arr[b, idx]
            arr[b, m:] = fill
        popped.parents[b, :m] = slot[popped.parents[b, idx]]
        popped.parents[b, m:] = -1
        popped.counts[b] = m
    w = int(budgets.max()) if len(budgets) else 0
    if popped.tokens.shape[1] > w:  # back to the width of an unconstrained pop
        for name in ("tokens", "parents", "depths", "logws", "sources", "match_lens"):
            if getattr(popped, name) is not None:
                setattr(popped, name, np.ascontiguousarray(getattr(popped, name)[:, :w]))
    return popped


def _walk(s: GrammarState, tokens: list[int], parents: list[int]) -> np.ndarray:
    """Which pops (tree slots 1..n) the grammar allows on their path: a depth-first walk that accepts a
    child's token on entering it and rolls back on leaving. Children of a stop token are dropped."""
    n = len(tokens)
    keep = np.zeros(n, dtype=bool)
    if s.failed:
        keep[:] = True
        return keep
    if s.terminated:
        return keep
    children: list[list[int]] = [[] for _ in range(n + 1)]  # slot -> child pop indices
    for i, p in enumerate(parents):
        children[p].append(i)
    stops = set(s.stop_token_ids)
    stack: list[tuple[int, int]] = [(0, 0)]  # (slot, next child position); depth = len(stack) - 1
    while stack:
        slot, pos = stack[-1]
        if pos == len(children[slot]):
            stack.pop()
            if stack:
                s.pop(1)
            continue
        stack[-1] = (slot, pos + 1)
        i = children[slot][pos]
        if s.push(tokens[i]):
            keep[i] = True
            if tokens[i] in stops:
                s.pop(1)
            else:
                stack.append((i + 1, 0))
    return keep
