"""Token sampling for a batch with per-request parameters (temperature 0 = greedy, top-k, top-p, min-p).

The logits pipeline, one order for every step (plain decode, prefill's first token, every node of a
verified tree): grammar mask (``grammar.masks``; per node in a tree) -> logit bias and repetition /
frequency / presence penalties (``penalties``; per node's own path in a tree) -> ``draw_tokens``:
temperature, top-k, top-p, min-p (``processed_probs``) and the inverse-CDF draw with the row's
position-keyed uniform (``position_uniforms``: u(seed, output position)); greedy rows take the argmax.
So a seeded request's token at output position t depends on its seed, t and its logits alone: not on the
batch, the step kind, or the tree that proposed it (docs/DESIGN.md 4.16)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from ddtree_serve.kernels.dispatch import one_kernel
from ddtree_serve.kernels.sampling import (
    min_p_renorm_prob,
    top_k_renorm_prob,
    top_p_renorm_prob,
)
from ddtree_serve.model_executor.grammar.masks import mask_logits
from ddtree_serve.model_executor.grammar.state import GrammarState
from ddtree_serve.model_executor.penalties import BatchPenalties, TokenCounts, apply_penalties
from ddtree_serve.model_executor.position_uniforms import SampleKeys
from ddtree_serve.model_executor.read_back import read_back
from ddtree_serve.model_executor.sampling_params import SamplingParams
from ddtree_serve.model_executor.sharded_sampling import sharded_argmax, sharded_draw
from ddtree_serve.model_executor.uploads import upload
from ddtree_serve.model_executor.vocab_shard import VocabShard


@dataclass(frozen=True)
class BatchSamplingInfo:
    """Per-request sampling parameters as tensors ``[bs]``."""

    temperature: torch.Tensor  # float32; greedy rows hold 1.0 (unused)
    top_k: torch.Tensor  # int64; vocab size when disabled
    top_p: torch.Tensor  # float32
    min_p: torch.Tensor  # float32
    is_greedy: torch.Tensor  # bool
    greedy_only: bool | None = None  # every row greedy, as the host knows it (None: read is_greedy back)
    # (top-k, top-p, min-p, greedy): whether any row MAY use each, as the host knows it (None: read back). A True
    # where no row does changes nothing (every filter keeps inactive rows as they are), so rows taken from the
    # batch keep the batch's flags
    maybe: tuple[bool, bool, bool, bool] | None = None

    @classmethod
    def build(cls, params: list[SamplingParams], vocab: int, device: torch.device) -> BatchSamplingInfo:
        greedy = [p.is_greedy for p in params]
        return cls(  # asynchronous copies: built in the verify forward's window (ddtree_serve/model_executor/uploads.py)
            temperature=upload([1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)], device,
                               torch.float32),
            top_k=upload([vocab if p.top_k <= 0 else min(p.top_k, vocab) for p in params], device, torch.int64),
            top_p=upload([p.top_p for p in params], device, torch.float32),
            min_p=upload([p.min_p for p in params], device, torch.float32),
            is_greedy=upload(greedy, device, torch.bool),
            greedy_only=all(greedy),
            maybe=(any(0 < p.top_k < vocab for p in params), any(p.top_p < 1.0 for p in params),
                   any(p.min_p > 0 for p in params), any(greedy)),
        )

    @property
    def all_greedy(self) -> bool:
        return self.greedy_only if self.greedy_only is not None else bool(self.is_greedy.all())

    def repeat(self, n: int) -> BatchSamplingInfo:
        """Each request's parameters for ``n`` consecutive rows (``[bs * n]``: a tree's nodes)."""
        return BatchSamplingInfo(*(x.repeat_interleave(n) for x in (self.temperature, self.top_k, self.top_p,
                                                                      self.min_p, self.is_greedy)),
                                 greedy_only=self.greedy_only, maybe=self.maybe)

    def take(self, rows: torch.Tensor) -> BatchSamplingInfo:
        """The parameters of ``rows`` (an index tensor)."""
        return BatchSamplingInfo(self.temperature[rows], self.top_k[rows], self.top_p[rows], self.min_p[rows],
                                 self.is_greedy[rows], maybe=self.maybe)

    def uses(self, i: int, active: torch.Tensor) -> bool:
        """Whether any row may use part ``i`` of ``maybe`` (``active``: the rows' tensor test, read back when the
        host does not know)."""
        return self.maybe[i] if self.maybe is not None else bool(active.any())


def processed_probs(logits: torch.Tensor, info: BatchSamplingInfo) -> torch.Tensor:
    """softmax(logits / T), then top-k, then top-p, then min-p renormalisation. logits [bs, ..., V] with the
    per-request parameters broadcast over the middle dims. Greedy rows become one-hot at the argmax."""
    bs, vocab = logits.shape[0], logits.shape[-1]
    mid = logits.shape[1:-1]
    flat = logits.reshape(bs, -1, vocab)  # [bs, n, V]
    n = flat.shape[1]

    def rep(x: torch.Tensor) -> torch.Tensor:
        return x.repeat_interleave(n)  # [bs * n]

    probs = torch.softmax(flat / info.temperature[:, None, None], dim=-1).reshape(bs * n, vocab)
    known = info.maybe is not None  # the filters then skip their own read of whether a row is active
    if info.uses(0, info.top_k < vocab):
        probs = top_k_renorm_prob(probs, rep(info.top_k), maybe_active=True if known else None)
    if info.uses(1, info.top_p < 1.0):
        probs = top_p_renorm_prob(probs, rep(info.top_p), maybe_active=True if known else None)
    if info.uses(2, info.min_p > 0):
        probs = min_p_renorm_prob(probs, rep(info.min_p), maybe_active=True if known else None)
    if info.uses(3, info.is_greedy):
        one_hot = torch.zeros_like(probs)
        one_hot.scatter_(1, flat.reshape(bs * n, vocab).argmax(-1, keepdim=True), 1.0)
        probs = torch.where(rep(info.is_greedy)[:, None], one_hot, probs)
    return probs.reshape(bs, *mid, vocab)


def draw_uniforms(
    generators: Sequence[torch.Generator | None], counts: Sequence[int], width: int, device: torch.device
) -> torch.Tensor:
    """Per-request uniforms on [0, 1): row b holds ``torch.rand(counts[b], generator=generators[b])`` in its
    first ``counts[b]`` columns and 0 after them (``counts[b] = 0`` draws nothing; a None generator is
    torch's default one). One small call per request: the generators are per request by contract, and
    torch has no batched multi-generator draw. The single coin source of the sampler and of tree
    verification (``ddtree_serve.speculative.verify.verify_coins``). Returns float32 [bs, width] on ``device``."""
    out = torch.zeros(len(generators), width, dtype=torch.float32)  # [bs, width]
    for b, (g, n) in enumerate(zip(generators, counts, strict=True)):
        if n > 0:
            gdev = g.device if g is not None else torch.device("cpu")
            out[b, :n] = torch.rand(n, generator=g, device=gdev).cpu()
    return out.to(device)


PROBS_BUDGET_BYTES = 256 << 20  # largest float32 probability block ``draw_tokens`` holds at once


def draw_tokens(logits: torch.Tensor, info: BatchSamplingInfo, uniforms: torch.Tensor,
                budget_bytes: int = PROBS_BUDGET_BYTES, shard: VocabShard | None = None) -> torch.Tensor:
    """The shared last stage of the logits pipeline. logits ``[n, V]`` (float, masks and penalties already
    applied; ``[n, V/tp]``, this rank's columns, under vocabulary-parallel TP: ``shard``), ``info`` per row ``[n]``,
    ``uniforms [n]`` (float64 in [0, 1)) -> token ids ``[n]`` int64: greedy rows the argmax (ties: the lowest
    id); sampled rows ``F^-1(u)`` of the processed distribution (temperature, top-k, top-p, min-p) in integer
    weights (``sharded_sampling``: the same tokens on one rank and on N, exchanging O(1) numbers a row). Rows run
    in blocks of at most ``budget_bytes`` of weights. On CUDA at TP 1 (``shard.device_kernel``) the Triton kernel
    ``kernels.triton_sampling`` draws instead (its masses are float sums: docs/DESIGN.md 4.16)."""
    shard = shard if shard is not None else VocabShard.whole(logits.shape[-1])
    n, width = logits.shape
    out = sharded_argmax(logits, shard)  # [n]
    if info.all_greedy:
        return out
    if logits.is_cuda and not shard.sharded and shard.device_kernel:  # a Triton program per row: no read back
        from ddtree_serve.kernels.triton_sampling import triton_draw_sampled

        drawn = triton_draw_sampled(logits, info.temperature, info.top_k, info.top_p, info.min_p, uniforms)  # [n]
        return torch.where(info.is_greedy, out, drawn)
    step = max(1, budget_bytes // (max(width, 1) * 8 * 4))  # e, q, keys, cumsum of one block
    maybe = info.maybe[:3] if info.maybe is not None else (True, True, True)
    with one_kernel():  # one launch of a fused kernel (a simulated device counts it so)
        if logits.is_cuda:  # every row: which rows sample is not read back from a device
            sampled = torch.arange(n, device=logits.device)  # [n]
        else:
            sampled = (~info.is_greedy).nonzero()[:, 0]  # [m] rows that sample (the same on every rank)
        for lo in range(0, sampled.numel(), step):
            rows = sampled[lo:lo + step]  # [k]
            drawn = sharded_draw(logits[rows], info.temperature[rows], info.top_k[rows], info.top_p[rows],
                                 info.min_p[rows], uniforms[rows].to(logits.device), shard, maybe)  # [k]
            out[rows] = torch.where(info.is_greedy[rows], out[rows], drawn)
    return out


def sample(logits: torch.Tensor, info: BatchSamplingInfo, keys: SampleKeys,
           penalties: BatchPenalties | None = None, shard: VocabShard | None = None) -> torch.Tensor:
    """logits [bs, V] float32 (``shard``: its columns [bs, V/tp]) -> token ids [bs] int64 at each request's next
    output position (``keys.positions``). ``penalties`` (logit bias, repetition, frequency, presence;
    ``ddtree_serve.model_executor.penalties``; the shard's columns) apply first."""
    logits = apply_penalties(logits, penalties)  # [bs, V]
    if info.all_greedy:
        return sharded_argmax(logits, shard) if shard is not None else logits.argmax(-1)
    u = keys.uniforms(torch.zeros(logits.shape[0], 1, dtype=torch.int64, device=keys.seeds.device))[:, 0]  # [bs]
    return draw_tokens(logits, info, u.to(logits.device), shard=shard)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top_n: int) -> list[tuple[float, list[tuple[int, float]]]]:
    """Raw-model logprobs of ``tokens`` [n] under ``logits`` [n, V] with the top ``top_n`` alternatives."""
    lp = torch.log_softmax(logits.float(), dim=-1)  # [n, V]
    vals, ids = lp.topk(top_n, dim=-1)  # [n, top_n] each (top_n may be 0)
    chosen, vals_h, ids_h = read_back(lp.gather(1, tokens[:, None])[:, 0], vals, ids)  # one read
    tops = [list(zip(i, v, strict=True)) for i, v in zip(ids_h.tolist(), vals_h.tolist(), strict=True)]
    return list(zip(chosen.tolist(), tops, strict=True))


class SamplingRequest(Protocol):
    """What ``sample_requests`` reads from a running request."""

    params: SamplingParams
    seed: int  # concrete (drawn at admission when the request gave none)
    output_ids: list[int]
    token_counts: TokenCounts | None
    grammar: GrammarState | None


def sample_requests(reqs: Sequence[SamplingRequest], logits: torch.Tensor, shard: VocabShard | None = None,
                    ) -> tuple[torch.Tensor, list[list[tuple[float, list[tuple[int, float]]]] | None]]:
    """One plain sampling step for running requests (the scheduler's decode and prefill, and the speculative
    worker's all-plain step): grammar masks, logit bias and penalties, then ``sample``. ``shard``: the logits are
    its vocabulary columns (``ModelRunner.step_logits``); only the rows of requests that ask for logprobs are
    gathered. Returns the tokens ``[bs]`` and, per request, the logprobs it asked for (under the raw logits) or
    None."""
    dev = logits.device
    shard = shard if shard is not None else VocabShard.whole(logits.shape[-1])
    vocab = shard.vocab
    params = [q.params for q in reqs]
    pen = BatchPenalties.build(params, [q.token_counts for q in reqs], vocab, dev, [len(q.output_ids) for q in reqs])
    masked = mask_logits([q.grammar for q in reqs], logits, shard)  # a masked copy only when a request has a grammar
    keys = SampleKeys.build([q.seed for q in reqs], [len(q.output_ids) for q in reqs], dev)
    tokens = sample(masked, BatchSamplingInfo.build(params, vocab, dev), keys,
                    pen.for_shard(shard) if pen is not None else None, shard)  # [bs]
    want = [i for i, q in enumerate(reqs) if q.params.logprobs is not None]
    lps: list = [None] * len(reqs)
    if want:  # the logprob rows alone, over the whole vocabulary, read back together
        idx = upload(want, dev, torch.int64)  # [w]
        top = max(reqs[i].params.logprobs for i in want)
        got = token_logprobs(shard.full_rows(logits[idx]), tokens[idx], top)  # rows [w, V]
        for i, (chosen, alts) in zip(want, got, strict=True):
            lps[i] = [(chosen, alts[:reqs[i].params.logprobs])]
    return tokens, lps
