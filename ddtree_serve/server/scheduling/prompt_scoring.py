"""Prompt logprobs of a prefill chunk (``prompt_logprobs`` / ``echo`` + ``logprobs``), scored from the extend
forward's hidden states in one batched projection over the requests that asked for them."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ddtree_serve.model_executor.prompt_logprobs import chunk_rows, score_rows
from ddtree_serve.server.scheduling.request import Req


def score_prompt_chunk(logits: Callable[[torch.Tensor], torch.Tensor], reqs: Sequence[Req],
                       chunk_lens: Sequence[int], hidden: torch.Tensor) -> None:
    """Append to each request's ``prompt_lps`` the logprobs of this chunk's prompt rows, only for requests with
    ``prompt_logprobs``. ``hidden`` [T, H] is the extend forward's output, rows in ``reqs`` order, ``chunk_lens``
    rows each (a chunk starts at the request's ``num_cached``)."""
    rows, targets, owners = [], [], []
    off = 0
    for req, n in zip(reqs, chunk_lens, strict=True):
        if req.params.prompt_logprobs is not None:
            start = req.num_cached
            for q in chunk_rows(start, n, len(req.prompt_ids), len(req.prompt_lps)):
                rows.append(off + q - start)
                targets.append(req.prompt_ids[q + 1])
                owners.append(req)
        off += n
    if not rows:
        return
    dev = hidden.device
    top_n = max(q.params.prompt_logprobs for q in owners)
    scored = score_rows(logits, hidden, torch.tensor(rows, device=dev), torch.tensor(targets, device=dev), top_n)
    for req, (lp, top) in zip(owners, scored, strict=True):
        req.prompt_lps.append((lp, top[:req.params.prompt_logprobs]))
