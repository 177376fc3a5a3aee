"""Draft sources and the merged tree (docs/DESIGN.md 4.13).

A step's tree can take nodes from two sources: the DFlash drafter's best-first pops (``ddtree_serve.speculative.ddtree``,
scored by the factorised draft probability Q_d of the prefix) and suffix drafts (``ddtree_serve.speculative.suffix_index``,
scored by the share of earlier occurrences that continued that way, Q_s). One best-first order ranks the union
of both node sets under one budget: a prefix proposed by either source gets the score

    s(x) = min(s(parent(x)), max(r_d[depth] * Q_d(x), r_s * Q_s(x)))

(Q of a source that did not propose x is 0; r: the source's calibration ratio for the request's sampling
mode, DFlash's at the node's depth, the suffix drafts' the request's own on a prior of the ratio at the
length n of the match that proposed them, which tells copying (long matches) from ordinary text (short ones)
better than the depth; 1 without the adaptive budget). The minimum with the parent keeps s non-increasing
along every path, so sorting by (-s, depth) puts parents first and every prefix of the order is a tree: the
best tree of that size under s. A node belongs to the source whose term is larger (DFlash on a tie); the
calibration and the accepted-token metrics count it there. The DFlash pops are the top ``width`` prefixes under
Q_d, so a prefix outside them and outside the suffix trie is never offered (its Q_d is at most the last pop's).
Verification does not read the scores: target-only verification is exact for any tree (distinct sibling
tokens, which the merge keeps by identifying nodes by (parent, token)).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from ddtree_serve.speculative.ddtree import DFLASH, DRAFT_SOURCES, SUFFIX, PoppedNodes

if TYPE_CHECKING:
    from ddtree_serve.model_executor.parallel_state import TPGroup
    from ddtree_serve.speculative.suffix_index import SuffixProposer
    from ddtree_serve.speculative.types import SpecRequest


def parse_sources(text: str) -> tuple[str, ...]:
    """``"dflash,suffix"`` -> ``("dflash", "suffix")`` (order of DRAFT_SOURCES); ValueError on unknown names."""
    names = {s.strip() for s in text.split(",") if s.strip()}
    unknown = names - set(DRAFT_SOURCES)
    if unknown or not names:
        raise ValueError(f"speculative_draft_sources must name one or more of {', '.join(DRAFT_SOURCES)} "
                         f"(comma-separated); got {text!r}")
    return tuple(s for s in DRAFT_SOURCES if s in names)


def resolve_sources(sources: str, algorithm: str, has_drafter: bool) -> str:
    """``sources`` with ``auto`` resolved: ``dflash`` for the dflash algorithm; for ddtree ``dflash,suffix`` when
    there is a drafter, ``suffix`` otherwise."""
    if sources != "auto":
        return sources
    if algorithm == "dflash":
        return "dflash"
    return "dflash,suffix" if has_drafter else "suffix"


def step_suffix_drafts(proposer: SuffixProposer, reqs: Sequence[SpecRequest], max_depths: list[int], tp: TPGroup
                       ) -> PoppedNodes | None:
    """A step's suffix drafts (tagged SUFFIX; rank 0's, broadcast under TP), or None when no request has one."""
    suffix = None
    if tp.rank == 0:
        texts = [q.prompt_ids + list(q.params.draft_hint) if q.params.draft_hint else q.prompt_ids
                 for q in reqs]  # a predicted output is indexed after the prompt (OpenAI's prediction)
        suffix = proposer.propose([q.rid for q in reqs], texts, [q.output_ids for q in reqs], max_depths)
        suffix = tag(suffix, SUFFIX) if suffix.counts.any() else None
    return tp.broadcast_object(suffix)


def tag(popped: PoppedNodes, source: int) -> PoppedNodes:
    """``popped`` with every node attributed to ``source`` (in place)."""
    popped.sources = np.full(popped.tokens.shape, source, dtype=np.int64)
    return popped


def no_pops(bs: int) -> PoppedNodes:
    """``bs`` requests without a popped node (a step whose drafter did not run)."""
    return PoppedNodes(tokens=np.zeros((bs, 0), dtype=np.int64), parents=np.zeros((bs, 0), dtype=np.int64),
                       depths=np.zeros((bs, 0), dtype=np.int64), logws=np.zeros((bs, 0)),
                       counts=np.zeros(bs, dtype=np.int64))


def merge_popped(draft: PoppedNodes, suffix: PoppedNodes, width: int,
                 scale: tuple[np.ndarray, np.ndarray] | None = None) -> PoppedNodes:
    """The first ``width`` nodes of each request's merged best-first order (module docstring), with ``sources``,
    ``match_lens`` and ``logws`` = log Q of the node's source (uncalibrated, for the calibration). ``suffix``
    carries ``match_lens``. ``scale``: (r_d [bs, L+1] by depth, r_s [bs] at each request's match length), the
    factors r (None: 1)."""
    bs = int(draft.counts.shape[0])
    rows = [_merge_row(draft, suffix, b, width, None if scale is None else (scale[0][b], float(scale[1][b])))
            for b in range(bs)]
    w = max((len(r[0]) for r in rows), default=0)
    out = PoppedNodes(tokens=np.zeros((bs, w), dtype=np.int64), parents=np.full((bs, w), -1, dtype=np.int64),
                      depths=np.zeros((bs, w), dtype=np.int64), logws=np.full((bs, w), -np.inf),
                      counts=np.zeros(bs, dtype=np.int64), sources=np.zeros((bs, w), dtype=np.int64),
                      match_lens=np.zeros((bs, w), dtype=np.int64), evidence=suffix.evidence)
    for b, (toks, pars, deps, logw, src) in enumerate(rows):
        n = len(toks)
        out.counts[b] = n
        out.tokens[b, :n], out.parents[b, :n], out.depths[b, :n] = toks, pars, deps
        out.logws[b, :n], out.sources[b, :n] = logw, src
        if suffix.match_lens is not None and suffix.counts[b] > 0:
            out.match_lens[b, :n] = np.where(out.sources[b, :n] == SUFFIX, suffix.match_lens[b, 0], 0)
    return out


def _merge_row(draft: PoppedNodes, suffix: PoppedNodes, b: int, width: int, scale: tuple[np.ndarray, float] | None):
    """One request's merged order: (tokens, parent slots, depths, log Q of the source, sources)."""
    tokens: list[int] = []
    parents: list[int] = []  # merged node id of the parent (0: root), ids 1-based in insertion order
    depths: list[int] = []
    logq = [[], []]  # per source: log Q of every merged node (-inf: not proposed by it)
    ids: dict[tuple[int, int], int] = {}
    for source, popped in ((DFLASH, draft), (SUFFIX, suffix)):
        n = int(popped.counts[b]) if b < popped.counts.shape[0] else 0
        local = [0] * (n + 1)  # the source's slot -> merged id
        toks, pars = popped.tokens[b, :n].tolist(), popped.parents[b, :n].tolist()
        deps, lws = popped.depths[b, :n].tolist(), popped.logws[b, :n].tolist()
        for i in range(n):
            key = (local[pars[i]], toks[i])
            m = ids.get(key)
            if m is None:
                tokens.append(toks[i])
                parents.append(key[0])
                depths.append(deps[i])
                logq[DFLASH].append(-math.inf)
                logq[SUFFIX].append(-math.inf)
                m = ids[key] = len(tokens)
            logq[source][m - 1] = lws[i]
            local[i + 1] = m
    n = len(tokens)
    score = [math.inf] * (n + 1)  # merged id -> s (root: inf)
    src = [DFLASH] * n
    for i in range(n):
        d = depths[i]
        sd, ss = logq[DFLASH][i], logq[SUFFIX][i]
        if scale is not None:  # log r (a ratio of 0 takes the source's term out)
            sd += math.log(scale[0][d]) if scale[0][d] > 0 else -math.inf
            ss += math.log(scale[1]) if scale[1] > 0 else -math.inf
        if ss > sd:
            src[i] = SUFFIX
        score[i + 1] = min(score[parents[i]], max(sd, ss))
    order = sorted(range(n), key=lambda i: (-score[i + 1], depths[i], i))[:width]
    order = [i for i in order if score[i + 1] > -math.inf]
    slot = [0] * (n + 1)
    for rank, i in enumerate(order):
        slot[i + 1] = rank + 1
    return ([tokens[i] for i in order], [slot[parents[i]] for i in order], [depths[i] for i in order],
            [logq[src[i]][i] for i in order], [src[i] for i in order])


def accepted_by_source(sources: np.ndarray, accept_index: np.ndarray, accepted: list[int]) -> list[int]:
    """Accepted suffix-draft nodes per request. sources [bs, D] (-1 root), accept_index [bs, S] local node ids
    (root first), accepted[b]: accepted nodes kept (the path's nodes 1..accepted[b])."""
    out = []
    for b, k in enumerate(accepted):
        path = accept_index[b, 1:k + 1]
        out.append(int((sources[b, path] == SUFFIX).sum()) if k > 0 else 0)
    return out
