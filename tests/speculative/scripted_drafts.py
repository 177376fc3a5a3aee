"""A test-only draft source with scripted proposals, so any model (tiny random ones included) gets trees with
accepted and rejected nodes at several depths (issue 37).

``ScriptedProposer`` has the interface of ``ddtree_serve.speculative.suffix_index.SuffixProposer`` (``propose`` / ``release``
/ ``observe``): it replaces only where the draft candidates of the suffix source come from. The merge with the
DFlash pops (``ddtree_serve.speculative.draft_sources.merge_popped``), the tree build, the verify forward, verification and
the commit are the production code. ``install`` puts it in place of rank 0's suffix proposer of an engine (the
followers of a TP engine never call ``propose``: ``SpecWorker._suffix_drafts`` broadcasts rank 0's drafts, so
under TP the engine must be configured with suffix drafts, which ``speculative_draft_sources`` auto does for
ddtree) and records every step's ``DecodeResult``s, so a test can assert that speculation ran and accepted.

Scripts: ``greedy_script(refs)`` proposes the target's own plain greedy continuation (computed first by a plain
engine) with a corruption at a depth that cycles with the output length, the true token as the corrupted node's
lower-ranked sibling, and a wrong sibling at every depth: every step's tree holds accepted and rejected nodes,
and greedy acceptance goes through depth >= 2 paths. ``fixed_script(nodes)`` proposes one given tree at every
step (the law tests).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ddtree_serve.speculative.ddtree import PoppedNodes

# (prompt, output, max_depth) -> nodes in pop order: (parent, token), parent 0 = root, i + 1 = the i-th node
Script = Callable[[list[int], list[int], int], list[tuple[int, int]]]


@dataclass
class ScriptedProposer:
    """Proposes ``script``'s nodes for every request (scores descending in pop order, match length 4)."""

    script: Script
    proposed_depth: int = 0  # deepest node ever proposed
    proposals: int = 0  # requests x steps given at least one node
    evidence: dict = field(default_factory=dict)  # SuffixProposer's per-request record (unused: empty)

    def propose(self, rids: list[str], prompts: list[list[int]], outputs: list[list[int]],
                max_depths: list[int]) -> PoppedNodes:
        trees = [_limit(self.script(list(p), list(o), d), d) if d > 0 else []
                 for p, o, d in zip(prompts, outputs, max_depths, strict=True)]
        bs, width = len(trees), max((len(t) for t in trees), default=0)
        out = PoppedNodes(tokens=np.zeros((bs, width), dtype=np.int64),
                          parents=np.full((bs, width), -1, dtype=np.int64),
                          depths=np.zeros((bs, width), dtype=np.int64), logws=np.full((bs, width), -np.inf),
                          counts=np.zeros(bs, dtype=np.int64), match_lens=np.zeros((bs, width), dtype=np.int64),
                          evidence=np.zeros((bs, 2)))
        for b, nodes in enumerate(trees):
            depth = [0]
            for i, (par, tok) in enumerate(nodes):
                depth.append(depth[par] + 1)
                out.tokens[b, i], out.parents[b, i], out.depths[b, i] = tok, par, depth[-1]
                out.logws[b, i] = -0.01 * (i + 1)  # descending in pop order: parents first
            out.counts[b] = len(nodes)
            out.match_lens[b, :len(nodes)] = 4
            self.proposed_depth = max(self.proposed_depth, max(depth))
            self.proposals += bool(nodes)
        return out

    def release(self, rid: str, output: list[int] | None = None) -> None:
        pass

    def observe(self, rids: list[str], reached: np.ndarray, offered: np.ndarray) -> None:
        pass


def _limit(nodes: list[tuple[int, int]], max_depth: int) -> list[tuple[int, int]]:
    """``nodes`` without those deeper than ``max_depth`` (renumbered parents)."""
    depth, keep, new = [0], [], {0: 0}
    for i, (par, tok) in enumerate(nodes):
        depth.append(depth[par] + 1)
        if depth[-1] <= max_depth and par in new:
            keep.append((new[par], tok))
            new[i + 1] = len(keep)
    return keep


def greedy_script(refs: dict[tuple[int, ...], list[int]], vocab: int, depth: int = 4) -> Script:
    """Trees around the plain greedy continuation ``refs[prompt]`` (a request whose output left it gets none).
    With k tokens out and the reference continuation c_1..c_depth: the chain c_1 .. c_{j-1}, x_j, c_{j+1}..
    where x_j != c_j is a corruption at depth j = 1 + k % (depth + 1) (j = depth + 1: none), then for even k c_j
    as x_j's sibling (a lower-ranked true token) with its own child c_{j+1}, and a wrong sibling of c_1 and of
    c_2. Odd k leave the true token out, so verification must stop at a rejected node that has children."""

    def wrong(t: int, s: int) -> int:
        return (t + s) % vocab

    def script(prompt: list[int], output: list[int], max_depth: int) -> list[tuple[int, int]]:
        ref = refs.get(tuple(prompt))
        k = len(output)
        if ref is None or ref[:k] != output or len(ref) <= k:
            return []
        c = ref[k:k + depth]
        j = 1 + k % (depth + 1)
        nodes: list[tuple[int, int]] = []
        parent = 0
        true_at: dict[int, int] = {}  # depth -> node of the true token
        for d, t in enumerate(c, start=1):
            tok = wrong(t, 1) if d == j else t
            nodes.append((parent, tok))
            parent = len(nodes)
            if d != j:
                true_at[d] = parent
        if j <= len(c) and k % 2 == 0:  # the true token as the corrupted node's lower-ranked sibling, with one
            # more level (every other step: otherwise the walk ends at the corrupted node and its siblings)
            nodes.append((true_at.get(j - 1, 0), c[j - 1]))
            if j < len(c):
                nodes.append((len(nodes), c[j]))
        nodes.append((0, wrong(c[0], 2)))  # wrong siblings at depths 1 and 2
        if len(c) > 1 and 1 in true_at:
            nodes.append((true_at[1], wrong(c[1], 3)))
        return nodes

    return script


def fixed_script(nodes: list[tuple[int, int]]) -> Script:
    """The same tree at every step."""
    return lambda prompt, output, max_depth: list(nodes)


@dataclass
class StepLog:
    """Every speculative step's results of one engine (``install``)."""

    proposer: ScriptedProposer | None  # None: the engine's own draft sources (``install(engine, None)``)
    accepted: list[int] = field(default_factory=list)  # per request-step: accepted draft nodes
    budgets: list[int] = field(default_factory=list)  # per request-step: tree nodes offered

    def assert_accepted(self, min_depth: int = 2) -> None:
        """Speculation ran and accepted: tokens accepted, a path of ``min_depth`` accepted in one step, a
        proposed tree at least that deep, and some offered node rejected."""
        if self.proposer is not None:
            assert self.proposer.proposals > 0, "the scripted source proposed nothing"
            assert self.proposer.proposed_depth >= min_depth, self.proposer.proposed_depth
        assert sum(self.accepted) > 0, "no draft token accepted"
        assert max(self.accepted) >= min_depth, f"no depth-{min_depth} path accepted: {self.accepted}"
        assert any(b > a for a, b in zip(self.accepted, self.budgets, strict=True)), "no node rejected"


def install(engine, script: Script | None) -> StepLog:
    """Replace rank 0's suffix proposer of ``engine`` (an ``Engine`` or a scheduler) by ``script``'s and log
    every step's results (``script`` None: log only, the engine's own sources draft). The engine must run
    ddtree; under TP it must have suffix drafts configured."""
    sch = getattr(engine, "scheduler", engine)
    sch = getattr(sch, "scheduler", sch)  # TPScheduler: rank 0's own scheduler
    spec = sch.spec
    assert spec is not None and not spec.chain, "the scripted source needs a ddtree engine"
    log = StepLog(ScriptedProposer(script) if script is not None else None)
    if log.proposer is not None:
        spec.suffix = log.proposer
    real = spec.decode

    def decode(reqs: Sequence, eos_ids: tuple[int, ...]):
        out = real(reqs, eos_ids)
        log.accepted.extend(r.accepted for r in out)
        log.budgets.extend(r.budget for r in out)
        return out

    spec.decode = decode
    return log


def plain_refs(engine, prompts: list[list[int]], max_tokens: int) -> dict[tuple[int, ...], list[int]]:
    """Plain greedy continuations of ``prompts`` (ignore_eos) from a plain engine, for ``greedy_script``."""
    from ddtree_serve.server.engine import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = engine.generate(input_ids=prompts, sampling_params=sp)
    return {tuple(p): o.token_ids for p, o in zip(prompts, outs, strict=True)}
