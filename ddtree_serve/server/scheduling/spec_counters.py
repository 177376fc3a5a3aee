"""Cumulative speculative-decoding counters of one scheduler, with vLLM's meanings (exported as
``vllm:spec_decode_*``, ddtree_serve/server/http/metrics_vllm.py)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecCounters:
    """drafts: request-steps that verified a draft (a tree of at least one node); draft_tokens: the nodes
    offered in them; accepted: draft tokens accepted; per_pos[i]: request-steps that accepted a token at draft
    position i (depth i + 1 of the tree), so per_pos[0] >= per_pos[1] >= ...."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    per_pos: list[int] = field(default_factory=list)

    def record(self, accepted: int, budget: int) -> None:
        """One request's step: ``budget`` nodes offered (0: a plain step, not a draft), ``accepted`` accepted."""
        if budget <= 0:
            return
        self.drafts += 1
        self.draft_tokens += budget
        self.accepted += accepted
        if accepted > len(self.per_pos):
            self.per_pos.extend([0] * (accepted - len(self.per_pos)))
        for i in range(accepted):
            self.per_pos[i] += 1
