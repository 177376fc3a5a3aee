"""The one description of a target (or drafter) forward that every model and attention backend reads.

A forward covers ``bs`` requests. Request ``b`` already has ``prefix_lens[b]`` tokens in the KV cache and
adds ``extend_lens[b]`` new tokens whose KV goes to ``out_cache_loc``. New tokens are flattened request
after request into ``T = sum(extend_lens)`` rows. Attention uses a padded per-request layout:

- ``kv_indices[b, j]``: KV slot of key ``j`` of request ``b`` (prefix first, then the new tokens; slot 0,
  the padding slot, where ``j >= prefix_lens[b] + extend_lens[b]``).
- ``attn_mask[b, i, j]``: query ``i`` of request ``b`` may see key ``j``. EXTEND/DECODE: the whole prefix
  and the new tokens causally. TARGET_VERIFY: the whole prefix, and among the new (tree) tokens only the
  ancestors of node ``i`` and itself (docs/DESIGN.md 4.1). Padded query rows see key 0 only (their output is
  discarded), so no row is fully masked.
- ``q_index[t]``: row of flat token ``t`` in the padded ``[bs * Q]`` layout.

The dense ``attn_mask`` (and the ``[bs, Q, K]`` temporaries that build it) is O(Q x K): 4 GiB for one
16,384-token prefill chunk at a 262k context. It is built only for models whose attention reads it
(``dense_mask=True``: the torch reference, flashinfer, DFlash drafters); the Triton MLA kernels bound the
keys by the lengths and read only ``tree_mask``, so their runner passes ``dense_mask=False`` and gets a
``[bs, Q, 1]`` placeholder (an expanded scalar, no memory) that carries ``Q`` alone
(``ForwardBatch.has_dense_mask`` tells them apart; ``masked_paged_attention`` refuses a placeholder).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch

from ddtree_serve.kernels.attention import AttentionMeta


@dataclass(frozen=True)
class HostShape:
    """A forward's sizes as the host already knows them (docs/DESIGN.md 4.17): ``tokens`` = sum(extend_lens),
    ``max_q`` = max(extend_lens), ``max_k`` = max(prefix_lens + extend_lens). Given to ``build_forward_batch`` (and
    ``tokens`` to ``KVSlots.place``), no size is read back from the device."""

    tokens: int
    max_q: int
    max_k: int


def flat_rows(lens: torch.Tensor, width: int, total: int) -> torch.Tensor:
    """[total] row of each flat token in a padded ``[bs * width]`` layout (request after request, ``lens[b]``
    tokens each): ``b * width + i`` for the i-th token of request b, with no value-dependent shape."""
    dev = lens.device
    req = torch.repeat_interleave(torch.arange(lens.shape[0], device=dev), lens, output_size=total)  # [T]
    first = torch.cumsum(lens, 0) - lens  # [bs] each request's first flat token
    return req * width + torch.arange(total, device=dev) - first.index_select(0, req)


class ForwardMode(Enum):
    EXTEND = "extend"  # prefill or chunked prefill; also drafter context/blocks
    DECODE = "decode"  # one new token per request
    TARGET_VERIFY = "target_verify"  # a tree of new tokens per request with an ancestor-only mask


@dataclass(frozen=True)
class RowKinds:
    """Per request, as the host knows it: whether its logits rows sample (not greedy) and whether it asks for
    logprobs. Read only by a simulated device, to charge the logits exchange the sampler makes after the forward
    (ddtree_serve/sim/machines.py ``logits_exchange_s``)."""

    sampled: tuple[bool, ...] = ()
    logprobs: tuple[bool, ...] = ()

    @classmethod
    def of(cls, params: Sequence[Any] | None) -> RowKinds | None:
        """From the requests' ``SamplingParams`` (None: unknown)."""
        if params is None:
            return None
        return cls(tuple(not p.is_greedy for p in params), tuple(p.logprobs is not None for p in params))


@dataclass
class ForwardBatch:
    mode: ForwardMode
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] int64, KV slot per new token
    kv_indices: torch.Tensor  # [bs, K] int64
    attn_mask: torch.Tensor  # [bs, Q, K] bool
    q_index: torch.Tensor  # [T] int64 into [bs * Q]
    prefix_lens: torch.Tensor  # [bs] int64
    extend_lens: torch.Tensor  # [bs] int64
    logits_indices: torch.Tensor | None = None  # [n] rows of T that need logits; None = all rows
    capture_layer_ids: tuple[int, ...] = ()  # decoder layers whose outputs are returned
    input_embeds: torch.Tensor | None = None  # [T, hidden]; when set, replaces the embedding of input_ids
    tree_mask: torch.Tensor | None = None  # [bs, Q, Q] bool, TARGET_VERIFY: node i sees node j (attn_mask's new-token block)
    row_kinds: RowKinds | None = None  # per request: sampled / logprob rows (a simulated device's exchange cost)

    @property
    def batch_size(self) -> int:
        return int(self.extend_lens.shape[0])

    @property
    def max_q(self) -> int:
        return int(self.attn_mask.shape[1])

    @property
    def has_dense_mask(self) -> bool:
        """False when ``attn_mask`` is the ``[bs, Q, 1]`` placeholder of a ``dense_mask=False`` build."""
        return self.attn_mask.shape[2] == self.kv_indices.shape[1]

    def attention_meta(self) -> AttentionMeta:
        """The per-forward attention metadata a backend plans from (``begin_forward``): EXTEND and DECODE
        masks are causal by construction, so backends may use causal kernels for them; TARGET_VERIFY
        (trees, drafter blocks) carries an arbitrary mask."""
        return AttentionMeta(
            causal=self.mode in (ForwardMode.EXTEND, ForwardMode.DECODE),
            decode=self.mode == ForwardMode.DECODE,
            kv_indices=self.kv_indices,
            attn_mask=self.attn_mask,
            q_index=self.q_index,
            prefix_lens=self.prefix_lens,
            extend_lens=self.extend_lens,
        )


def build_forward_batch(
    mode: ForwardMode,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    out_cache_loc: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    tree_mask: torch.Tensor | None = None,
    logits_indices: torch.Tensor | None = None,
    capture_layer_ids: tuple[int, ...] = (),
    input_embeds: torch.Tensor | None = None,
    dense_mask: bool = True,
    host: HostShape | None = None,
    row_kinds: RowKinds | None = None,
) -> ForwardBatch:
    """Build attention metadata. ``req_to_token[req_pool_indices[b], :prefix+extend]`` must already hold
    the slots of the prefix and of the new tokens. ``tree_mask`` ([bs, Q, Q] bool, node i sees node j) is
    required for TARGET_VERIFY and ignored otherwise. ``dense_mask=False``: skip the O(Q x K) ``attn_mask``
    (a placeholder instead: module docstring). ``host``: the sizes, known on the host (no read back); None:
    read from the lengths."""
    device = input_ids.device
    bs = int(extend_lens.shape[0])
    prefix_lens = prefix_lens.to(device=device, dtype=torch.int64)
    extend_lens = extend_lens.to(device=device, dtype=torch.int64)
    total = prefix_lens + extend_lens  # [bs]
    if host is not None:
        q_max, k_max = host.max_q, host.max_k
    else:
        q_max = int(extend_lens.max().item()) if bs else 0
        k_max = int(total.max().item()) if bs else 0
    jj = torch.arange(k_max, device=device)  # [K]
    kv_indices = req_to_token[:, :k_max][req_pool_indices.to(device)].to(torch.int64)  # [bs, K] (K columns only)
    kv_indices = torch.where(jj[None, :] < total[:, None], kv_indices, torch.zeros_like(kv_indices))
    ii = torch.arange(q_max, device=device)  # [Q]
    q_valid = ii[None, :] < extend_lens[:, None]  # [bs, Q]
    if host is not None:
        q_index = flat_rows(extend_lens, q_max, host.tokens)  # [T]
    else:
        q_index = (torch.arange(bs, device=device)[:, None] * q_max + ii[None, :])[q_valid]  # [T]
    tm = None
    if mode == ForwardMode.TARGET_VERIFY:
        if tree_mask is None:
            raise ValueError("tree_mask is required for TARGET_VERIFY")
        tm = tree_mask.to(device=device, dtype=torch.bool)  # [bs, Q, Q]
    if dense_mask:
        mask = _dense_mask(tm, prefix_lens, extend_lens, q_valid, q_max, k_max)  # [bs, Q, K]
    else:
        mask = torch.ones((), dtype=torch.bool, device=device).expand(bs, q_max, 1)  # [bs, Q, 1] placeholder
    return ForwardBatch(
        mode=mode,
        input_ids=input_ids,
        positions=positions,
        out_cache_loc=out_cache_loc,
        kv_indices=kv_indices,
        attn_mask=mask,
        q_index=q_index,
        prefix_lens=prefix_lens,
        extend_lens=extend_lens,
        logits_indices=logits_indices,
        capture_layer_ids=capture_layer_ids,
        input_embeds=input_embeds,
        tree_mask=tm,
        row_kinds=row_kinds,
    )


def _dense_mask(tm: torch.Tensor | None, prefix_lens: torch.Tensor, extend_lens: torch.Tensor,
                q_valid: torch.Tensor, q_max: int, k_max: int) -> torch.Tensor:
    """``attn_mask`` [bs, Q, K] (module docstring): causal, or the tree mask ``tm`` [bs, Q, Q] over the new
    tokens; the whole prefix visible; padded query rows see key 0 only."""
    device, bs = prefix_lens.device, int(prefix_lens.shape[0])
    jj = torch.arange(k_max, device=device)  # [K]
    ii = torch.arange(q_max, device=device)  # [Q]
    pre = prefix_lens[:, None, None]  # [bs, 1, 1]
    in_prefix = jj[None, None, :] < pre  # [bs, 1, K]
    rel = jj[None, None, :] - pre  # [bs, 1, K] index among the new tokens
    valid_new = (rel >= 0) & (rel < extend_lens[:, None, None])  # [bs, 1, K]
    if tm is not None:
        rel_c = rel.clamp(0, max(q_max - 1, 0)).expand(bs, q_max, k_max)  # [bs, Q, K]
        new_ok = torch.gather(tm, 2, rel_c) & valid_new
    else:
        new_ok = valid_new & (rel <= ii[None, :, None])
    mask = in_prefix | new_ok  # [bs, Q, K]
    pad_row = torch.zeros(k_max, dtype=torch.bool, device=device)
    if k_max:
        pad_row[0] = True
    return torch.where(q_valid[:, :, None], mask, pad_row[None, None, :])
