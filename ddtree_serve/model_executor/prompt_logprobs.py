"""Prompt scoring from a prefill forward: the logprob of each prompt token given the tokens before it.

Hidden row ``q`` of an extend forward (absolute position ``q``) predicts the token at position ``q + 1``.
Only the rows of requests that ask are projected to the vocabulary, in blocks of ``block`` rows so that a
long chunk never materialises a ``[chunk, V]`` float32 tensor at once. The logprobs are exactly those of
generation (``sampler.token_logprobs``: log-softmax of the raw float32 logits, no temperature or
truncation), so a prompt scored here and the same text generated are scored identically.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ddtree_serve.model_executor.sampler import token_logprobs

PromptLogprob = tuple[float, list[tuple[int, float]]]  # (logprob of the prompt token, top-k alternatives)


def score_rows(
    logits_fn: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    rows: torch.Tensor,
    targets: torch.Tensor,
    top_n: int,
    block: int = 256,
) -> list[PromptLogprob]:
    """Logprob of ``targets`` [m] under the logits of ``hidden[rows]`` ([m] row indices into ``hidden``
    [T, H]) with the top ``top_n`` alternatives of each row; ``logits_fn`` maps [b, H] -> float32 [b, V]."""
    out: list[PromptLogprob] = []
    for lo in range(0, rows.numel(), block):
        h = hidden[rows[lo : lo + block]]  # [b, H]
        out.extend(token_logprobs(logits_fn(h), targets[lo : lo + block], top_n))  # logits [b, V]
    return out


def chunk_rows(start: int, n: int, prompt_len: int, scored: int) -> range:
    """Absolute positions ``q`` in a chunk covering positions ``[start, start + n)`` whose prediction is a
    prompt token not scored yet: ``scored`` tokens after the first are done, so ``q >= scored``, and
    ``q + 1 < prompt_len`` (the last prompt position predicts the first generated token, not a prompt one)."""
    return range(max(start, scored), min(start + n, prompt_len - 1))
