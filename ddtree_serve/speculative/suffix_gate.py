"""Whether a step's suffix drafts are worth leaving the device path for, on an accelerator (docs/DESIGN.md 4.13).

Suffix drafts (``suffix_index.py``) come from the host's index of the request's latest tokens, so a step that
merges them reads the DFlash pops back, assembles its tree on the host and runs serially (``host_tree.py``): it
cannot take the tree the previous step drafted ahead, and it discards that tree's verify forward, already
queued on the device (``draft_ahead.py``). With a suffix match of two tokens enough to propose, some request of
a batch has one most steps; taking the host path then costs every such step the pipeline and the device a
discarded forward (measured: docs/BENCHMARKS.md, "Session 27").

The gate lets the suffix drafts in where they are expected to add at least a step's worth of tokens beyond
what the DFlash tree can give: the calibrated scores of the suffix nodes deeper than any DFlash node (depth >=
the drafter's block size; a node's score is its reach estimate, scaled by the request's suffix calibration
ratio), summed over the batch, against the batch's tokens per step (its running mean). A request copying a
long span (an agent rewriting a file: suffix runs of tens of tokens at ratios near 1) passes at small batches;
a two-token match in a chat does not. Otherwise the step keeps the device path and its DFlash tree; the
suffix index still takes in every token, so the next step's proposal is current. Either path is lossless: the
gate only chooses which drafts are verified. On a CPU every step runs serially anyway and the gate is not
used."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ddtree_serve.speculative.ddtree import PoppedNodes

TOKENS_EMA = 0.2  # weight of a step's mean tokens per request in the running mean


@dataclass
class SuffixGate:
    """The accelerator's suffix gate (module docstring) for a drafter of ``block_size``."""

    block_size: int
    tokens_per_step: float = 1.0  # running mean of the tokens a request emits per speculative step
    admitted: int = 0  # steps whose suffix drafts took the host path
    deferred: int = 0  # steps whose suffix drafts the gate left out

    def admits(self, suffix: PoppedNodes, ratios: np.ndarray) -> bool:
        """Whether this step's suffix drafts (``ratios`` [bs]: each request's suffix calibration ratio) are
        expected to add a step's worth of tokens beyond the DFlash tree; counts the decision."""
        bs, width = suffix.tokens.shape
        held = np.arange(width)[None, :] < suffix.counts[:, None]  # [bs, W] the proposal's nodes
        deep = held & (suffix.depths >= self.block_size)  # [bs, W] deeper than any DFlash node
        reach = np.exp(np.where(deep, suffix.logws, -np.inf)).sum(1) * np.clip(ratios, 0.0, 1.0)  # [bs]
        ok = bool(reach.sum() >= bs * self.tokens_per_step)
        self.admitted += ok
        self.deferred += not ok
        return ok

    def observe(self, emitted: Sequence[int]) -> None:
        """A verified step's tokens per request (``emitted[b]``)."""
        if len(emitted):
            self.tokens_per_step += TOKENS_EMA * (float(np.mean(emitted)) - self.tokens_per_step)


def evidence_ratios(suffix: PoppedNodes) -> np.ndarray:
    """[bs] each request's own suffix record (reached over offered score), 1 where it has none: the ratio the
    gate uses without the auto budget's calibrator (``BudgetController.suffix_ratios``)."""
    if suffix.evidence is None:
        return np.ones(suffix.tokens.shape[0])
    hit, offered = suffix.evidence[:, 0], suffix.evidence[:, 1]  # [bs] each
    return np.where(offered > 0, hit / np.maximum(offered, 1e-12), 1.0)
