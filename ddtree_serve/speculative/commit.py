"""The unified commit of a verified tree (docs/DESIGN.md 4.4): greedy and sampled verification end the same way.

Keeps the root's and the accepted path's KV slots (path order) up to a stop, frees every other tree slot, feeds
the kept nodes' captured target features to the drafter's context and emits the tokens; the commit never knows
which verification ran. Also the OpenAI logprobs of the emitted tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from ddtree_serve.model_executor.model_runner import ModelRunner
from ddtree_serve.model_executor.sampler import token_logprobs
from ddtree_serve.model_executor.sampling_params import find_stop
from ddtree_serve.speculative.ddtree import DraftTree
from ddtree_serve.speculative.draft_sources import accepted_by_source
from ddtree_serve.speculative.types import DecodeResult
from ddtree_serve.speculative.verify import VerifyResult

if TYPE_CHECKING:
    from ddtree_serve.speculative.types import SpecRequest


def commit(r: ModelRunner, reqs: Sequence[SpecRequest], tree: DraftTree, res: VerifyResult, idx: torch.Tensor,
           cached: torch.Tensor, tree_slots: torch.Tensor, captured: torch.Tensor | None, eos_ids: tuple[int, ...],
           write_context: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]) -> list[DecodeResult]:
    """Unified commit for greedy and sampled verification: keep the KV of the root and the accepted
    nodes (path order) up to a stop, free every other tree slot, feed the kept nodes' hidden states
    to the drafter's context (``write_context``; ``captured`` None: no drafter), and return the emitted tokens
    with the accepted suffix-draft nodes counted."""
    bs, d = tree_slots.shape
    s = res.accept_index.shape[1]
    acc = res.accept_length.tolist()
    emitted = res.emitted_tokens.tolist()
    keep = []
    results = []
    for b, q in enumerate(reqs):  # per-request stop scan over at most S tokens
        toks = emitted[b][: acc[b] + 1]
        k, _ = find_stop(toks, q.params, eos_ids, q.remaining_tokens)
        keep.append(k)
        results.append(DecodeResult(toks[:k], min(acc[b], k)))
    keep_t = torch.tensor(keep, device=r.device)  # [bs] KV entries kept: root + (k-1) nodes
    cols = torch.arange(s, device=r.device)  # [S]
    valid = cols[None, :] < keep_t[:, None]  # [bs, S]
    path = res.accept_index.clamp(min=0)  # [bs, S] local node ids
    path_slots = tree_slots.gather(1, path)  # [bs, S]
    kept_mask = torch.zeros(bs, d, dtype=torch.bool, device=r.device)  # [bs, D]
    kept_mask[torch.arange(bs, device=r.device)[:, None].expand(bs, s)[valid], path[valid]] = True
    rows = idx[:, None].expand(bs, s)[valid]
    pos = (cached[:, None] + cols[None, :])[valid]  # [n_kept] absolute positions
    r.slots.keep_path(rows, pos, path_slots[valid], tree_slots[~kept_mask & (tree_slots >= 0)])
    if captured is not None:
        feat_rows = (torch.arange(bs, device=r.device)[:, None] * d + path)[valid]
        write_context(captured[feat_rows], pos, path_slots[valid])
    for q, k in zip(reqs, keep, strict=True):
        q.num_cached += k
    if tree.sources is not None:  # accepted tokens by draft source (metrics)
        suffix = accepted_by_source(tree.sources.cpu().numpy(), res.accept_index.cpu().numpy(),
                                    [o.accepted for o in results])
        for o, n in zip(results, suffix, strict=True):
            o.accepted_suffix = n
    return results


def attach_logprobs(reqs: Sequence[SpecRequest], res: VerifyResult, logits: torch.Tensor, out: list[DecodeResult]
                    ) -> None:
    """OpenAI logprobs of the emitted tokens under the raw target distribution at their parent nodes, with
    the requested number of alternatives (only for requests that asked)."""
    for b, (q, r) in enumerate(zip(reqs, out, strict=True)):
        if q.params.logprobs is None or not r.tokens:
            continue
        k = len(r.tokens)
        rows = logits[b, res.accept_index[b, :k]]  # [k, V] rows of the root and accepted nodes
        r.logprobs = token_logprobs(rows, torch.tensor(r.tokens, device=rows.device), q.params.logprobs)
