"""Logit penalties and biases per request: ``logit_bias``, ``repetition_penalty``, ``frequency_penalty``,
``presence_penalty``; the same formula for plain decoding and for every node of a draft tree.

Definitions, applied in this order to the raw logits ``l`` of a request (vLLM v1's order: logit bias,
then the penalties; temperature and the top-k/top-p/min-p filters come after, in the sampler):

1. ``logit_bias`` {token id: bias}: ``l[t] += bias`` (OpenAI).
2. ``repetition_penalty`` r (SGLang/vLLM, CTRL arXiv 1909.05858): for every token ``t`` in the prompt
   or the generated tokens, ``l[t] = l[t] / r`` if ``l[t] > 0`` else ``l[t] * r``.
3. ``frequency_penalty`` f and ``presence_penalty`` p (OpenAI), over the GENERATED tokens only, with
   ``c[t]`` the number of times ``t`` was generated: ``l[t] -= c[t] * f + (c[t] > 0) * p``.
4. ``min_tokens`` m (vLLM): while fewer than m tokens are generated, ``l[t] = -inf`` for the stop ids
   (``min_tokens_ban``: EOS and ``stop_token_ids``). A tree node at depth d samples output position
   ``generated + d``, so its row is banned while ``generated + d < m``.

Tree verification (DDTree): the row of tree node ``i`` is the distribution of the token that follows the
path root..i, so its counts are the request's counts plus the drafted tokens on that path (the root is the
last committed token, already counted). ``apply_tree_penalties`` penalises every row with the request's
``[bs, V]`` state broadcast over the nodes, then recomputes only the logits of path tokens, from a
``[bs, D, D]`` ancestor-match count; no ``[bs, D, V]`` count tensor is built. With these logits the tree
walk reproduces plain decoding with penalties (greedy: token for token; sampled: in distribution).

Per-request state (``TokenCounts``) is kept incrementally: created at admission from the prompt and
updated when tokens are committed, on the device of the model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from ddtree_serve.model_executor.sampling_params import SamplingParams
from ddtree_serve.model_executor.uploads import upload
from ddtree_serve.model_executor.vocab_shard import VocabShard


class TokenCounts:
    """One request's token statistics over a vocabulary of ``V``: ``generated`` float32 [V] (how often each
    token was generated) and ``seen`` bool [V] (the token is in the prompt or was generated)."""

    def __init__(self, prompt_ids: Sequence[int], vocab: int, device: torch.device) -> None:
        self.generated = torch.zeros(vocab, dtype=torch.float32, device=device)  # [V]
        self.seen = torch.zeros(vocab, dtype=torch.bool, device=device)  # [V]
        if prompt_ids:
            self.seen[upload(list(prompt_ids), device, torch.int64)] = True

    def add(self, tokens: Sequence[int]) -> None:
        """Record committed generated tokens."""
        if tokens:
            ids = upload(list(tokens), self.generated.device, torch.int64)  # [n]
            self.generated.index_add_(0, ids, torch.ones(len(tokens), device=ids.device))
            self.seen[ids] = True


@dataclass(frozen=True)
class BatchPenalties:
    """The batch's penalty parameters and state as tensors; rows of requests without penalties are neutral."""

    presence: torch.Tensor  # [bs] float32
    frequency: torch.Tensor  # [bs] float32
    repetition: torch.Tensor  # [bs] float32 (1 = off)
    generated: torch.Tensor  # [bs, V] float32 generated-token counts
    seen: torch.Tensor  # [bs, V] bool prompt or generated
    bias: torch.Tensor | None  # [bs, V] float32 logit bias, None when no request has one
    ban: torch.Tensor | None = None  # [bs, V] bool min_tokens' stop ids, None when no request has min_tokens
    ban_left: torch.Tensor | None = None  # [bs] int64 outputs still short of min_tokens (<= 0: no ban)

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        counts: Sequence[TokenCounts | None],
        vocab: int,
        device: torch.device,
        lengths: Sequence[int] | None = None,
    ) -> BatchPenalties | None:
        """None when no request of the batch has a penalty, a logit bias or min_tokens (the common, free
        case). ``lengths``: each request's generated tokens so far (min_tokens)."""
        if not any(p.has_logit_processing for p in params):
            return None
        bs = len(params)
        generated = torch.zeros(bs, vocab, dtype=torch.float32, device=device)  # [bs, V]
        seen = torch.zeros(bs, vocab, dtype=torch.bool, device=device)  # [bs, V]
        for b, c in enumerate(counts):
            if c is not None:
                generated[b] = c.generated
                seen[b] = c.seen
        bias = None
        if any(p.logit_bias for p in params):
            entries = [(b, int(t), float(v)) for b, p in enumerate(params) for t, v in (p.logit_bias or {}).items()]
            bias = _scattered(entries, bs, vocab, torch.float32, device)  # [bs, V]

        def col(name: str) -> torch.Tensor:
            return upload([float(getattr(p, name)) for p in params], device, torch.float32)  # [bs]

        ban = ban_left = None
        if any(p.min_tokens > 0 and p.min_tokens_ban for p in params):
            entries = [(b, t, True) for b, p in enumerate(params) if p.min_tokens > 0 for t in p.min_tokens_ban
                       if 0 <= t < vocab]
            ban = _scattered(entries, bs, vocab, torch.bool, device)  # [bs, V]
            done = list(lengths) if lengths is not None else [0] * bs
            ban_left = upload([p.min_tokens - n for p, n in zip(params, done, strict=True)], device,
                              torch.int64)  # [bs]
        return cls(
            col("presence_penalty"),
            col("frequency_penalty"),
            col("repetition_penalty"),
            generated,
            seen,
            bias,
            ban,
            ban_left,
        )

    def for_shard(self, shard: VocabShard) -> BatchPenalties:
        """The state of ``shard``'s vocabulary columns (``[bs, V/tp]`` views; itself when unsharded)."""
        if not shard.sharded:
            return self
        return replace(self, generated=shard.cols(self.generated), seen=shard.cols(self.seen),
                       bias=None if self.bias is None else shard.cols(self.bias),
                       ban=None if self.ban is None else shard.cols(self.ban))


def _scattered(entries: Sequence[tuple[int, int, float | bool]], bs: int, vocab: int, dtype: torch.dtype,
               device: torch.device) -> torch.Tensor:
    """A ``[bs, V]`` tensor of zeros with ``entries`` ``(row, token id, value)`` written in, uploaded as three
    host lists in one scatter (no per-row copy, no synchronisation: ``uploads.upload``)."""
    out = torch.zeros(bs, vocab, dtype=dtype, device=device)  # [bs, V]
    if entries:
        rows, ids, values = zip(*entries, strict=True)
        out.index_put_((upload(rows, device, torch.int64), upload(ids, device, torch.int64)),
                       upload(values, device, dtype))  # [n] each
    return out


def _subtrahend(count: torch.Tensor, pres: torch.Tensor, freq: torch.Tensor) -> torch.Tensor:
    """Step 3: ``count * frequency + (count > 0) * presence`` (broadcastable tensors)."""
    return count * freq + (count > 0).to(count.dtype) * pres


def _penalise_(x: torch.Tensor, seen: torch.Tensor, rep: torch.Tensor, sub: torch.Tensor) -> torch.Tensor:
    """Steps 2 and 3 in place on ``x`` (biased logits, owned by the caller): seen tokens are scaled by
    ``1 / rep`` when positive and by ``rep`` otherwise, then ``sub`` is subtracted. One elementwise formula
    for the dense rows and the path corrections, so both round identically. The result is clamped to float32's
    finite range: a ``rep`` below float32's range (5e-324 is valid input) is 0 here and ``1 / rep`` infinite,
    which would turn softmax into NaN (found by the schemathesis fuzz); clamped, the seen positive logits tie at
    the top instead."""
    scale = torch.where(seen & (x > 0), 1.0 / rep, torch.where(seen, rep, torch.ones_like(rep)))
    big = torch.finfo(torch.float32).max
    return x.mul_(scale).sub_(sub).clamp_(-big, big)


def _biased(logits: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A new float32 tensor: the logits plus the logit bias (step 1); the input is never modified."""
    x = logits.float()
    return x + bias if bias is not None else x.clone()


def apply_penalties(logits: torch.Tensor, pen: BatchPenalties | None) -> torch.Tensor:
    """Processed logits [bs, V] (float32, a new tensor) of raw logits [bs, V]; ``pen`` None returns them."""
    if pen is None:
        return logits
    x = _biased(logits, pen.bias)  # [bs, V]
    sub = _subtrahend(pen.generated, pen.presence[:, None], pen.frequency[:, None])  # [bs, V]
    out = _penalise_(x, pen.seen, pen.repetition[:, None], sub)
    if pen.ban is not None:  # step 4
        out.masked_fill_(pen.ban & (pen.ban_left > 0)[:, None], float("-inf"))
    return out


def apply_tree_penalties(
    logits: torch.Tensor,
    pen: BatchPenalties | None,
    candidates: torch.Tensor,
    ancestors: torch.Tensor,
    is_node: torch.Tensor,
    shard: VocabShard | None = None,
) -> torch.Tensor:
    """Processed logits [bs, D, V] (float32, a new tensor) of a draft tree's raw logits [bs, D, V]: row i
    counts the request's tokens plus the tokens of the non-root nodes on root..i. Memory: the result (a view of
    a ``[bs, D, V + 1]`` buffer whose last column takes the writes of non-path pairs), one float and one bool
    tensor of the logits' shape, and ``[bs, D, D]`` pair tensors; the raw logits are not modified.

    candidates [bs, D] int64 node tokens; ancestors [bs, D, D] bool, [b, i, j]: j is on root..i (i
    included); is_node [bs, D] bool: j is a real non-root node (root and padding excluded). ``shard``: the
    logits are its columns ``[bs, D, V/tp]`` and ``pen`` its ``for_shard`` state; path tokens of other shards
    write to the spare column too. No read back: no ``nonzero`` of the path pairs (docs/DESIGN.md 4.17)."""
    if pen is None:
        return logits
    bs, d, w = logits.shape
    ext = logits.new_empty((bs, d, w + 1), dtype=torch.float32)  # [bs, D, V + 1]: a spare last column
    x = ext[..., :w]  # [bs, D, V]
    x.copy_(logits)
    if pen.bias is not None:
        x.add_(pen.bias[:, None, :])
    ext[..., w] = 0.0
    on_path = ancestors & is_node[:, None, :]  # [bs, D(i), D(j)] j is a non-root node on root..i
    if shard is not None and shard.sharded:
        local, inside = shard.local_ids(candidates)  # [bs, D] each: column in this shard, held here
    else:
        local, inside = candidates.clamp(0, w - 1), torch.ones_like(candidates, dtype=torch.bool)  # padding: any id
    # every (row i, node j) pair at once, no read back of which pairs are paths: a path token held here writes
    # its column, every other pair the spare one (padding of the dense form; its writes are discarded)
    col = torch.where(on_path & inside[:, None, :], local[:, None, :], w)  # [bs, D(i), D(j)]
    x_path = ext.gather(-1, col)  # [bs, D, D] biased logits of the path tokens, before the base penalties below
    sub = _subtrahend(pen.generated, pen.presence[:, None], pen.frequency[:, None])  # [bs, V]
    out = _penalise_(x, pen.seen[:, None, :], pen.repetition[:, None, None], sub[:, None, :])  # [bs, D, V]
    same = (candidates[:, :, None] == candidates[:, None, :]).float()  # [bs, D(k), D(j)] same token
    path_count = torch.bmm(on_path.float(), same)  # [bs, D(i), D(j)] count of j's token on root..i
    count = pen.generated.gather(1, local)[:, None, :] + path_count  # [bs, D(i), D(j)]
    seen = torch.ones_like(x_path, dtype=torch.bool)  # a path token has been generated
    sub_path = _subtrahend(count, pen.presence[:, None, None], pen.frequency[:, None, None])  # [bs, D, D]
    ext.scatter_(-1, col, _penalise_(x_path, seen, pen.repetition[:, None, None], sub_path))
    return _ban_tree_(out, pen, on_path)  # duplicates of one token on a path wrote the same value


def _ban_tree_(out: torch.Tensor, pen: BatchPenalties, on_path: torch.Tensor) -> torch.Tensor:
    """Step 4 on tree rows [bs, D, V], in place: row i samples output position generated + depth(i)."""
    if pen.ban is None:
        return out
    depth = on_path.sum(-1)  # [bs, D] non-root nodes on root..i
    banned = depth < pen.ban_left[:, None]  # [bs, D]
    return out.masked_fill_(pen.ban[:, None, :] & banned[:, :, None], float("-inf"))
