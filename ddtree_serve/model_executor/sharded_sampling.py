"""The last stage of the logits pipeline on vocabulary shards: argmax, the processed distribution's integer
weights, and the inverse-CDF draw, each exchanging O(1) numbers per row (``VocabShard.gather``).

Exactness by construction (docs/DESIGN.md 4.16): every number two ranks combine is either a max (order-free) or
an INTEGER sum (exact in any order), so one rank holding the whole vocabulary (TP 1, gathered logits) and N ranks
holding slices compute the same thresholds and the same crossing, bit for bit. The definitions, per row:

- ``m`` the max logit (-inf rows: 0); ``e = exp((l - m) / T)`` float32 in [0, 1] (elementwise: the same bits
  on every rank); ``q = floor(e * 2^40)`` int64, the token's weight (a token with ``e < 2^-40`` weighs 0; a
  vocabulary below 2^22 tokens keeps every sum below 2^62).
- top-k keeps ``e >= `` the k-th largest ``e`` (ties kept); top-p then keeps ``e >= t``, ``t`` the largest
  value whose kept mass ``sum(q; e >= t)`` reaches ``max(1, ceil(p * S_k))`` (``S_k``: top-k's kept mass);
  min-p keeps ``e >= min_p`` (``max e = 1``). Both thresholds by radix select on the float32 bits of ``e``
  (order-preserving for ``e >= 0``): 4 passes of 256-bin integer histograms (counts for top-k, masses for
  top-p), summed over the ranks.
- the draw: with ``S`` the kept mass and ``target = min(floor(u * S), S - 1)``, the first token whose
  inclusive prefix sum of kept ``q`` exceeds ``target`` (never a token of weight 0); each rank learns its
  shard's offset from the ranks' kept totals, and the shard holding the crossing names the token. ``S = 0``
  (every logit -inf): ``V - 1`` (flashinfer's convention).
- greedy: the max logit, ties to the lowest global id (``torch.argmax``'s first maximum).
"""

from __future__ import annotations

import torch

from ddtree_serve.model_executor.vocab_shard import VocabShard

FRAC_BITS = 40  # fixed-point bits of a token's weight q = floor(e * 2^FRAC_BITS)
_RADIX_SHIFTS = (24, 16, 8, 0)  # 8-bit digits of a float32's 31 value bits (sign bit 0 for e >= 0)


def sharded_argmax(logits: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """Global argmax ``[n]`` int64 of ``logits [n, V/tp]`` (this shard's columns): the largest logit, ties to the
    lowest global id. Exchanges 2 numbers a row."""
    if not shard.sharded:
        return logits.argmax(-1)
    vals, idx = logits.float().max(-1)  # [n] first maximum of the shard
    both = shard.gather(torch.stack([vals.double(), (idx + shard.start).double()]))  # [tp, 2, n]
    top = both[:, 0].amax(0)  # [n]
    ids = torch.where(both[:, 0] == top, both[:, 1], float(shard.vocab))  # [tp, n]
    return ids.amin(0).long()


def _weights(logits: torch.Tensor, temperature: torch.Tensor, shard: VocabShard
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(e float32, q int64), both ``[n, V/tp]``: the temperature softmax's numerators and their weights."""
    x = logits.float()  # [n, Vs]
    m = shard.max(x.amax(-1) if x.shape[-1] else torch.full(x.shape[:1], float("-inf"), device=x.device))  # [n]
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # [n] every logit -inf: e = 0
    e = torch.exp((x - m[:, None]) / temperature.float()[:, None]).nan_to_num_(0.0)  # [n, Vs] in [0, 1]
    q = (e * float(1 << FRAC_BITS)).floor_().long()  # [n, Vs] (a power-of-two scaling: exact in float32)
    return e, q


def _pick_digit(hist: torch.Tensor, above: torch.Tensor, target: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From the ranks' summed histogram ``[n, 256]`` of the keys under the prefix: the largest digit whose suffix
    weight plus ``above`` reaches ``target`` (0 where none does), the weight above that digit, and whether one
    did. ``[n]`` each."""
    suffix = hist.flip(-1).cumsum(-1).flip(-1)  # [n, 256] weight of digits >= d
    d = ((above[:, None] + suffix) >= target[:, None]).sum(-1) - 1  # [n] true for d <= the chosen digit
    reach = d >= 0
    d = d.clamp(min=0)
    nxt = torch.cat([suffix[:, 1:], torch.zeros_like(suffix[:, :1])], dim=1)  # [n, 256] digits > d
    return d, above + nxt.gather(1, d[:, None])[:, 0], reach


def _radix_threshold(keys: torch.Tensor, w: torch.Tensor, target: torch.Tensor, shard: VocabShard,
                     compact: bool | None = None) -> torch.Tensor:
    """The largest key ``t`` with ``sum(w; keys >= t) >= target`` ``[n]`` int64 (0 when even all keys fall
    short). keys ``[n, Vs]`` int64 in [0, 2^31); w ``[n, Vs]`` int64 >= 0; target ``[n]`` int64. 4 radix passes
    of a 256-bin histogram each, summed over the ranks (exact integers). ``compact`` (default: off CUDA): passes
    2-4 read only the elements under the first digit chosen (a local, data-sized gather: the exchanged
    histograms keep their shape); else every element (no size read back from a device)."""
    n = keys.shape[0]
    zero = torch.zeros(n, dtype=torch.int64, device=keys.device)  # [n]
    hist = torch.zeros(n, 256, dtype=torch.int64, device=keys.device).scatter_add_(1, keys >> 24, w)  # [n, 256]
    d, above, reach = _pick_digit(shard.sum(hist), zero, target)
    prefix = d << 24  # [n] digits chosen so far
    if not (compact if compact is not None else not keys.is_cuda):  # every element [M = n*Vs]
        rows = torch.arange(n, device=keys.device)[:, None].expand_as(keys).reshape(-1)  # [M]
        ck, cw = keys.reshape(-1), w.reshape(-1)  # [M]
    else:
        rows, cols = ((keys >> 24) == d[:, None]).nonzero(as_tuple=True)  # [M] the elements under that digit
        ck, cw = keys[rows, cols], w[rows, cols]  # [M]
    for shift in _RADIX_SHIFTS[1:]:
        match = (ck >> (shift + 8)) == (prefix[rows] >> (shift + 8))  # [M] share the chosen digits
        flat = rows * 256 + ((ck >> shift) & 255)  # [M] row-major bin
        hist = torch.zeros(n * 256, dtype=torch.int64, device=keys.device)  # [n * 256]
        hist.index_add_(0, flat, torch.where(match, cw, torch.zeros_like(cw)))
        d, above, _ = _pick_digit(shard.sum(hist.view(n, 256)), above, target)
        prefix = prefix | (d << shift)
    return torch.where(reach, prefix, zero)


def kept_weights(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 min_p: torch.Tensor, shard: VocabShard, maybe: tuple[bool, bool, bool] = (True, True, True)
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The processed distribution of ``logits [n, V/tp]`` (after masks and penalties) as integer weights:
    (``qk [n, V/tp]`` int64, 0 off the kept set; ``total [n]`` int64, the kept mass over every shard). Per-row
    ``temperature``, ``top_k`` (``>= V``: off), ``top_p`` (``>= 1``: off), ``min_p`` (``<= 0``: off) ``[n]``.
    ``maybe``: whether any row may use top-k / top-p / min-p (as the host knows it; False skips the pass)."""
    e, q = _weights(logits, temperature, shard)  # [n, Vs]
    keys = e.view(torch.int32).long()  # [n, Vs] order-preserving for e >= 0
    keep = torch.ones_like(q, dtype=torch.bool)  # [n, Vs]
    if maybe[0]:
        active = (top_k > 0) & (top_k < shard.vocab)  # [n]
        t = _radix_threshold(keys, torch.ones_like(q), top_k.long(), shard)  # [n] the k-th largest key
        keep &= (keys >= t[:, None]) | ~active[:, None]
    if maybe[1]:
        active = top_p < 1.0  # [n]
        w = torch.where(keep, q, torch.zeros_like(q))  # [n, Vs]
        s_k = shard.sum(w.sum(-1))  # [n]
        target = (top_p.double().clamp(min=0.0) * s_k.double()).ceil().long().clamp(min=1)  # [n]
        t = _radix_threshold(keys, w, target, shard)  # [n]
        keep &= (keys >= t[:, None]) | ~active[:, None]
    if maybe[2]:
        keep &= (e >= min_p.float()[:, None]) | (min_p <= 0)[:, None]
    qk = torch.where(keep, q, torch.zeros_like(q))  # [n, Vs]
    return qk, shard.sum(qk.sum(-1))


def inverse_cdf_draw(qk: torch.Tensor, uniforms: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """Global token ids ``[n]`` int64: the first token whose inclusive prefix of the kept weights ``qk [n, V/tp]``
    exceeds ``min(floor(u * S), S - 1)`` (``S`` the row's kept mass; ``uniforms [n]`` in [0, 1)); ``V - 1`` for a
    row of weight 0. Exchanges the ranks' kept totals and the chosen id: ``tp + 1`` numbers a row."""
    local = qk.sum(-1)  # [n]
    totals = shard.gather(local)  # [tp, n] in rank (= vocabulary) order
    s = totals.sum(0)  # [n]
    before = totals.cumsum(0)[shard.rank] - local  # [n] kept weight of the shards before this one
    target = (uniforms.double() * s.double()).floor().long()  # [n]
    target = torch.minimum(target, s - 1).clamp(min=0)  # [n]
    crossed = (before[:, None] + qk.cumsum(-1)) > target[:, None]  # [n, Vs]
    here = (before <= target) & crossed[:, -1] if qk.shape[-1] else torch.zeros_like(s, dtype=torch.bool)  # [n]
    first = crossed.to(torch.uint8).argmax(-1) + shard.start  # [n] first crossing (argmax: first maximum)
    mine = torch.where(here, first, torch.full_like(first, -1))  # [n]
    tok = shard.max(mine)  # [n] the one shard that holds the crossing names it
    return torch.where(s > 0, tok, torch.full_like(tok, shard.vocab - 1))


def sharded_draw(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 min_p: torch.Tensor, uniforms: torch.Tensor, shard: VocabShard,
                 maybe: tuple[bool, bool, bool] = (True, True, True)) -> torch.Tensor:
    """``F^-1(u)`` of each row's processed distribution (``kept_weights`` then ``inverse_cdf_draw``): ``[n]``."""
    qk, _ = kept_weights(logits, temperature, top_k, top_p, min_p, shard, maybe)
    return inverse_cdf_draw(qk, uniforms, shard)
