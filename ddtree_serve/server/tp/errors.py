"""The errors of tensor-parallel serving (below protocol.py and step_recovery.py, which both raise or read them)."""

from __future__ import annotations


class TPRankError(RuntimeError):
    """A TP rank died or a collective failed; the TP world is unusable."""


class TPDivergence(TPRankError):
    """Ranks produced different outputs: the identical-sampling invariant is broken."""


class TPStepFailed(RuntimeError):
    """A step failed on some ranks and every rank agreed on it (ddtree_serve/server/tp/step_agreement.py): each
    fails the step's requests alike and serving goes on (not fatal). ``ranks``: the ranks whose step raised;
    ``partial``: not every rank's."""

    def __init__(self, message: str, ranks: tuple[int, ...] = (), partial: bool = False) -> None:
        super().__init__(message)
        self.ranks, self.partial = ranks, partial
