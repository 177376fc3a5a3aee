"""The unified commit of a verified tree (docs/DESIGN.md 4.4): greedy and sampled verification end the same way.

Keeps the root's and the accepted path's KV slots (path order) up to a stop, frees every other tree slot, feeds
the kept nodes' captured target features to the drafter's context and emits the tokens; the commit never knows
which verification ran. Also the OpenAI logprobs of the emitted tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from ddtree_serve.model_executor.model_runner import ModelRunner
from ddtree_serve.model_executor.sampler import token_logprobs
from ddtree_serve.model_executor.sampling_params import find_stop
from ddtree_serve.model_executor.uploads import upload
from ddtree_serve.model_executor.vocab_shard import VocabShard
from ddtree_serve.speculative.ddtree import DraftTree
from ddtree_serve.speculative.draft_sources import accepted_by_source
from ddtree_serve.speculative.types import DecodeResult
from ddtree_serve.speculative.verify import VerifyResult

if TYPE_CHECKING:
    from ddtree_serve.speculative.types import SpecRequest


def commit_paths(r: ModelRunner, res: VerifyResult, idx: torch.Tensor, cached: torch.Tensor,
                 tree_slots: torch.Tensor, captured: torch.Tensor | None,
                 write_context: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]) -> None:
    """The commit's device half, queued before the step reads anything back: every accepted path's KV slots
    (root first) moved to consecutive table columns ``cached[b] + j`` and their captured target features
    written to the drafter's context (``write_context``; ``captured`` None: no drafter), over the fixed
    ``[bs, S]`` path layout. Columns past a request's accepted length get stale slot ids (past ``num_cached``,
    never read as context) and their features go to the padding slot 0. A stop inside the path is the host's
    (``commit``, after the read): the slots past it are freed then, so nothing here depends on a host value."""
    bs, d = tree_slots.shape
    s = res.accept_index.shape[1]
    cols = torch.arange(s, device=idx.device)  # [S]
    path = res.accept_index.clamp(min=0)  # [bs, S] local node ids (-1 past the path: the root's)
    flat = (torch.arange(bs, device=idx.device)[:, None] * d + path).view(-1)  # [bs*S] rows of the [bs * D] layout
    slots = tree_slots.view(-1)[flat]  # [bs*S]
    pos = (cached[:, None] + cols[None, :]).view(-1)  # [bs*S] absolute positions
    r.slots.point(idx[:, None].expand(bs, s).reshape(-1), pos, slots)
    if captured is not None:
        accepted = (cols[None, :] <= res.accept_length[:, None]).view(-1)  # [bs*S]
        write_context(captured[flat], pos, torch.where(accepted, slots, torch.zeros_like(slots)))


def commit(r: ModelRunner, reqs: Sequence[SpecRequest], tree: DraftTree, res: VerifyResult,
           tree_slots: torch.Tensor, eos_ids: tuple[int, ...], placed: int,
           paths: tuple[np.ndarray, np.ndarray]) -> list[DecodeResult]:
    """The commit's host half, after the step's read (``commit_paths`` queued the device half): per request the
    tokens up to a stop (root and accepted path, then the bonus), ``num_cached`` advanced by them, and every
    placed tree slot not kept (rejected nodes, accepted ones past a stop) freed; accepted suffix-draft nodes
    counted. ``placed``: the tree slots the verify forward placed in all (roots included), as the host knows them.
    ``paths``: ``accept_length`` [bs] and ``emitted_tokens`` [bs, S] as the step read them back
    (``model_executor/read_back.py``)."""
    bs, d = tree_slots.shape
    acc = paths[0].tolist()
    emitted = paths[1].tolist()
    keep = []
    results = []
    for b, q in enumerate(reqs):  # per-request stop scan over at most S tokens
        toks = emitted[b][: acc[b] + 1]
        k, _ = find_stop(toks, q.params, eos_ids, q.remaining_tokens)
        keep.append(k)
        results.append(DecodeResult(toks[:k], min(acc[b], k)))
    # the kept (request, path column) pairs are the host's (keep): index tensors, no value-dependent shapes
    vb = np.repeat(np.arange(bs), keep)  # [n_kept] request of each kept entry
    vj = np.arange(vb.shape[0]) - np.repeat(np.cumsum(keep) - keep, keep)  # [n_kept] its column in the path
    vb_t, vj_t = upload(torch.as_tensor(vb), r.device), upload(torch.as_tensor(vj), r.device)  # [n_kept]
    kept_flat = vb_t * d + res.accept_index[vb_t, vj_t]  # [n_kept] rows of the padded [bs * D] layout
    r.slots.drop_tree(_dropped_slots(tree_slots, kept_flat, placed - len(vb)))  # [n_drop] every other placed slot
    for q, k in zip(reqs, keep, strict=True):
        q.num_cached += k
    if tree.sources is not None:  # accepted tokens by draft source (metrics)
        suffix = accepted_by_source(tree.numpy("sources"), res.accept_index.cpu().numpy(),
                                    [o.accepted for o in results])
        for o, n in zip(results, suffix, strict=True):
            o.accepted_suffix = n
    return results


def _dropped_slots(tree_slots: torch.Tensor, kept_flat: torch.Tensor, n_drop: int) -> torch.Tensor:
    """[n_drop] the placed tree slots (>= 0) not kept, in row-major order: a stable sort brings them first, so
    the count the host knows gives the shape (no boolean-mask gather)."""
    flat = tree_slots.view(-1)  # [bs*D]
    drop = (flat >= 0).index_fill_(0, kept_flat, False)  # [bs*D]
    order = torch.sort((~drop).to(torch.int8), stable=True).indices[:n_drop]  # [n_drop] dropped first, in order
    return flat.index_select(0, order)


def attach_logprobs(reqs: Sequence[SpecRequest], res: VerifyResult, logits: torch.Tensor, out: list[DecodeResult],
                    shard: VocabShard | None = None) -> None:
    """OpenAI logprobs of the emitted tokens under the raw target distribution at their parent nodes, with
    the requested number of alternatives (only for requests that asked). ``shard``: the logits are this rank's
    vocabulary columns; the rows of requests that asked are gathered (every rank knows which: the same call)."""
    asked = [(b, q, r) for b, (q, r) in enumerate(zip(reqs, out, strict=True))
             if q.params.logprobs is not None and r.tokens]
    if not asked:
        return
    dev = logits.device
    row_of = upload([b for b, _, r in asked for _ in r.tokens], dev, torch.int64)  # [n] each emitted token's row
    depth = upload([j for _, _, r in asked for j in range(len(r.tokens))], dev, torch.int64)  # [n]
    rows = logits[row_of, res.accept_index[row_of, depth]]  # [n, V] the root's and accepted nodes' rows
    rows = shard.full_rows(rows) if shard is not None else rows  # [n, V]
    tokens = upload([t for _, _, r in asked for t in r.tokens], dev, torch.int64)  # [n]
    got = token_logprobs(rows, tokens, max(q.params.logprobs for _, q, _ in asked))  # one read for all
    at = 0
    for _, q, r in asked:
        r.logprobs = [(chosen, alts[:q.params.logprobs]) for chosen, alts in got[at:at + len(r.tokens)]]
        at += len(r.tokens)
