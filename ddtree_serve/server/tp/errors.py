"""The errors of tensor-parallel serving (below protocol.py and step_recovery.py, which both raise or read them)."""

from __future__ import annotations


class TPRankError(RuntimeError):
    """A TP rank died or a collective failed; the TP world is unusable."""


class TPDivergence(TPRankError):
    """Ranks produced different outputs: the identical-sampling invariant is broken."""
