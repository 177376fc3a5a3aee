"""Per-request grammar state: an xgrammar matcher that has accepted exactly the request's committed output.

Invariant (scheduler and speculative worker): ``accept`` is called once per committed token, after stop
truncation, so the matcher's position equals ``len(output_ids)``. Tree walks and draft masking move the
matcher temporarily and always roll it back to that position. A retraction keeps the output, so it keeps
the matcher; an abort drops both.

A terminated matcher (it accepted EOS) allows only the stop tokens (``ignore_eos``: generation goes on
after EOS, and the grammar has nothing more to say than EOS).
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


class GrammarState:
    def __init__(self, compiled, stop_token_ids: tuple[int, ...], vocab_size: int) -> None:
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=list(stop_token_ids) or None)
        self.stop_token_ids = tuple(stop_token_ids)
        self.vocab_size = vocab_size
        self.accepted = 0  # committed tokens the matcher has taken
        self.failed = False  # a committed token the grammar rejected (should not happen): mask turned off

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()

    def accept(self, tokens: list[int]) -> None:
        """Advance by committed tokens (in order)."""
        for t in tokens:
            self.accepted += 1
            if self.failed or self.terminated:
                continue
            if not self.matcher.accept_token(int(t)):
                logger.error("grammar rejected committed token %d at output position %d; constraint dropped",
                             t, self.accepted - 1)
                self.failed = True

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """The next-token mask at the current position into ``bitmask[row]`` (int32 [W], CPU)."""
        if self.failed:
            bitmask[row].fill_(-1)
        elif self.terminated:
            stop_only_row(bitmask, row, self.stop_token_ids)
        else:
            self.matcher.fill_next_token_bitmask(bitmask, row)


def stop_only_row(bitmask: torch.Tensor, row: int, stop_ids: tuple[int, ...]) -> None:
    bitmask[row].zero_()
    for t in stop_ids:
        bitmask[row, t >> 5] |= _bit(t)


def _bit(t: int) -> int:
    """The int32 word value with bit ``t & 31`` set (bit 31 is the sign bit)."""
    b = 1 << (t & 31)
    return b - (1 << 32) if b >= 1 << 31 else b
