"""Per-request grammar state: an xgrammar matcher behind an optional reasoning gate, positioned at exactly the
request's committed output.

Invariant (scheduler and speculative worker): ``accept`` is called once per committed token, after stop
truncation, so the state's position equals ``len(output_ids)``. Tree walks and draft masking move it
temporarily with ``push`` / ``pop`` and always pop back to that position. A retraction keeps the output, so
it keeps the state; an abort drops both.

Reasoning gate (a thinking model's constrained reply, docs/DESIGN.md "Grammar masks under speculation"):
with ``end_ids`` set, the state starts *dormant*: every token is allowed (the mask is all ones) and the
matcher does not move, until a token of ``end_ids`` (``</think>``) is taken; the grammar then holds from the
next token on. A token of ``handoff_ids`` (Kimi's ``<|tool_calls_section_begin|>``, which ends the reasoning
and belongs to the answer) also wakes the grammar, as its first token: while dormant it is allowed only
where the grammar may start with it. A stop token (EOS) while dormant ends the reply before its answer: only
stop tokens follow (as after a complete grammar). One state machine for plain decoding, tree verification,
drafter masking and pruning: all of them move the state through ``push`` / ``pop`` / ``fill``.

A terminated state (the grammar accepted EOS, or EOS came while dormant) allows only the stop tokens
(``ignore_eos``: generation goes on after EOS, and the grammar has nothing more to say than EOS).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

DORMANT, AWAKE, CLOSED = 0, 1, 2  # phases: before the reasoning ended; grammar active; EOS while dormant


@dataclass(frozen=True)
class ReasoningGate:
    """The token ids that end a reasoning section. ``end_ids``: consumed by the reasoning (the grammar starts
    after them); ``handoff_ids``: the answer's first token (the grammar starts with them)."""

    end_ids: tuple[int, ...] = ()
    handoff_ids: tuple[int, ...] = ()

    @property
    def active(self) -> bool:
        return bool(self.end_ids or self.handoff_ids)


NO_GATE = ReasoningGate()


class GrammarState:
    def __init__(self, compiled, stop_token_ids: tuple[int, ...], vocab_size: int,
                 gate: ReasoningGate = NO_GATE) -> None:
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=list(stop_token_ids) or None)
        self.stop_token_ids = tuple(stop_token_ids)
        self.vocab_size = vocab_size
        self.gate = gate
        self.phase = DORMANT if gate.active else AWAKE
        self.accepted = 0  # committed tokens the state has taken
        self.failed = False  # a committed token the grammar rejected (should not happen): mask turned off
        self._trail: list[tuple[int, int]] = []  # per push: (phase before, matcher tokens it accepted: 0 or 1)
        self._handoff_ok: dict[int, bool] | None = None  # handoff id -> the grammar may start with it

    @property
    def dormant(self) -> bool:
        return self.phase == DORMANT and not self.failed

    @property
    def terminated(self) -> bool:
        return self.phase == CLOSED or (self.phase == AWAKE and self.matcher.is_terminated())

    def _step(self, t: int) -> tuple[bool, int]:
        """Take token ``t``: (allowed, matcher tokens accepted). On False nothing moved."""
        if self.phase == DORMANT:
            if t in self.stop_token_ids:
                self.phase = CLOSED
                return True, 0
            if t in self.gate.end_ids:
                self.phase = AWAKE
                return True, 0
            if t in self.gate.handoff_ids:
                if not self.matcher.accept_token(t):
                    return False, 0
                self.phase = AWAKE
                return True, 1
            return True, 0
        if self.terminated:
            return t in self.stop_token_ids, 0
        ok = bool(self.matcher.accept_token(t))
        return ok, int(ok)

    def push(self, t: int) -> bool:
        """Tentatively take token ``t`` (a tree or draft walk); False (nothing moved) when it is not allowed.
        Every True must be undone by ``pop`` before the next committed ``accept``."""
        if self.failed:
            self._trail.append((self.phase, 0))
            return True
        phase = self.phase
        ok, n = self._step(int(t))
        if ok:
            self._trail.append((phase, n))
        return ok

    def pop(self, n: int = 1) -> None:
        """Undo the last ``n`` successful ``push``es."""
        steps = 0
        for _ in range(n):
            phase, k = self._trail.pop()
            self.phase = phase
            steps += k
        if steps:
            self.matcher.rollback(steps)

    def accept(self, tokens: list[int]) -> None:
        """Advance by committed tokens (in order)."""
        assert not self._trail, "a walk left the grammar state moved"
        for t in tokens:
            self.accepted += 1
            if self.failed or self.terminated:
                continue
            if not self._step(int(t))[0]:
                logger.error("grammar rejected committed token %d at output position %d; constraint dropped",
                             t, self.accepted - 1)
                self.failed = True

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """The next-token mask at the current position into ``bitmask[row]`` (int32 [W], CPU)."""
        if self.failed:
            bitmask[row].fill_(-1)
        elif self.terminated:
            stop_only_row(bitmask, row, self.stop_token_ids)
        elif self.phase == DORMANT:
            bitmask[row].fill_(-1)
            for t, ok in self._handoffs().items():
                if not ok:
                    bitmask[row, t >> 5] &= ~_bit(t)
        else:
            self.matcher.fill_next_token_bitmask(bitmask, row)

    def _handoffs(self) -> dict[int, bool]:
        """Whether the grammar may start with each handoff token (the matcher is at its start while dormant)."""
        if self._handoff_ok is None:
            ok = {}
            for t in self.gate.handoff_ids:
                ok[t] = bool(self.matcher.accept_token(t))
                if ok[t]:
                    self.matcher.rollback(1)
            self._handoff_ok = ok
        return self._handoff_ok


def stop_only_row(bitmask: torch.Tensor, row: int, stop_ids: tuple[int, ...]) -> None:
    bitmask[row].zero_()
    for t in stop_ids:
        bitmask[row, t >> 5] |= _bit(t)


def _bit(t: int) -> int:
    """The int32 word value with bit ``t & 31`` set (bit 31 is the sign bit)."""
    b = 1 << (t & 31)
    return b - (1 << 32) if b >= 1 << 31 else b
