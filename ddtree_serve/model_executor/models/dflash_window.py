"""Which keys a DFlash drafter layer's block queries see: sliding windows, block causality, a context cap
(docs/DESIGN.md 4.5).

Semantics (github z-lab/dflash ``dflash/model.py``, ``Qwen3DFlashAttention`` and ``_attention_mask``; the config
is read through transformers' ``Qwen3Config``, which derives ``layer_types`` when a config has none):

- Layer types: ``layer_types[i]`` is ``"sliding_attention"`` or ``"full_attention"``. Without ``layer_types``,
  layer i slides when ``use_sliding_window`` is true and ``i >= max_window_layers`` (transformers' rule), else
  every layer is full.
- Window: a sliding layer's query at absolute position p sees a key at position k only when ``p - k < W``
  (``W = sliding_window``; the query's own position counts, as in Hugging Face: SGLang's ``window_left`` is
  ``W - 1``, sgl-project/sglang ``speculative/dflash_utils.py``); a non-causal layer also bounds later keys,
  ``k - p < W`` (within a block of at most W tokens this hides nothing). Keys are the layer's context K/V at
  the context tokens' positions, then the block's own at positions ``anchor .. anchor + B - 1``.
- Causality among the block's queries: the config's ``is_causal`` when present; otherwise causal exactly on
  sliding layers (z-lab's rule). Causal: block query i sees block keys j <= i only; else the whole block.
  (SGLang's DFlash model runs sliding layers causal and full layers bidirectional whatever ``is_causal`` says;
  the published configs that carry ``is_causal: false`` are therefore run as z-lab's code runs them.)
- Context cap (``--speculative-dflash-draft-window-size N``, SGLang's name): every layer sees at most the last
  N context tokens before the anchor (positions >= anchor - N); it bounds the drafter's reads at long context
  and is not part of any checkpoint's training.

The paged path reads only what a layer can see: ``windowed_batch`` drops each request's older context slots
from the layer's key list (a sliding layer needs the last ``W - 1`` context tokens, its first query's window),
so attention over a 262k-token context reads ``W - 1 + B`` keys per sliding layer. Nothing is freed: the
drafter's context cache keeps one slot per target slot (the target still needs its own KV for every token).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from ddtree_serve.model_executor.forward_batch import ForwardBatch

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class DraftAttention:
    """One drafter layer's visibility: ``window`` (Hugging Face ``sliding_window``; None = the whole context)
    and ``causal`` (block queries see only earlier-or-equal block keys)."""

    window: int | None = None
    causal: bool = False


def layer_attention(hf: dict[str, Any], what: str) -> tuple[DraftAttention, ...]:
    """Each layer's ``DraftAttention`` from a drafter config (module docstring). ValueError, naming the key,
    for a layer type other than sliding/full, a ``layer_types`` of the wrong length, or sliding layers without
    a usable window (``sliding_window`` missing or <= 0, or ``use_sliding_window`` not true: transformers then
    drops the window while z-lab's code still makes those layers causal, and SGLang refuses the config)."""
    n = int(hf["num_hidden_layers"])
    use, window = hf.get("use_sliding_window"), hf.get("sliding_window")
    types = hf.get("layer_types")
    if types is None:
        start = int(hf.get("max_window_layers", 28))
        types = [SLIDING if use and window is not None and i >= start else FULL for i in range(n)]
    types = list(types)
    if len(types) != n:
        raise ValueError(f"{what}: layer_types has {len(types)} entries for {n} layers (num_hidden_layers)")
    bad = sorted({t for t in types if t not in (SLIDING, FULL)})
    if bad:
        raise ValueError(f"{what}: layer_types {bad} are not implemented (only {SLIDING!r} and {FULL!r})")
    if SLIDING in types and (use is not True or window is None or int(window) <= 0):
        raise ValueError(f"{what}: layer_types has {SLIDING!r} layers but the window is unusable "
                         f"(use_sliding_window={use!r}, sliding_window={window!r}); a sliding layer needs "
                         "use_sliding_window true and sliding_window >= 1")
    is_causal = hf.get("is_causal")
    return tuple(DraftAttention(int(window) if t == SLIDING else None,
                                (t == SLIDING) if is_causal is None else bool(is_causal)) for t in types)


def visibility(q_pos: torch.Tensor, k_pos: torch.Tensor, spec: DraftAttention) -> torch.Tensor:
    """The window and causality terms of the mask: q_pos [..., Q], k_pos [..., K] (absolute positions) ->
    [..., Q, K] bool, True where ``spec`` lets query q see key k. Context keys lie before every block query, so
    the causal term hides only later block keys; what else is hidden (other blocks, padding) is the caller's
    mask, which this is ANDed with."""
    d = q_pos[..., :, None] - k_pos[..., None, :]  # [..., Q, K]: query position - key position
    ok = torch.ones_like(d, dtype=torch.bool)
    if spec.causal:
        ok &= d >= 0
    if spec.window is not None:
        ok &= d < spec.window
        if not spec.causal:
            ok &= -d < spec.window
    return ok


def windowed_batch(fb: ForwardBatch, spec: DraftAttention, cap: int | None) -> ForwardBatch:
    """``fb`` (a drafter block batch: request b's keys are its ``prefix_lens[b]`` context tokens at positions
    ``0 ..`` then its block, queries at ``prefix_lens[b] + i``) restricted for one layer kind: each request's
    context keys start at ``prefix - keep`` with ``keep = min(prefix, W - 1, cap)``, and the mask adds the
    window and causal terms (``visibility``). ``fb`` itself when nothing restricts."""
    if spec.window is None and cap is None and not spec.causal:
        return fb
    dev = fb.kv_indices.device
    prefix, ext = fb.prefix_lens, fb.extend_lens  # [bs]
    keep = prefix
    for bound in (None if spec.window is None else spec.window - 1, cap):
        if bound is not None:
            keep = keep.clamp(max=bound)
    drop = prefix - keep  # [bs] context tokens this layer never reads
    total = keep + ext  # [bs]
    bs, q_max = int(ext.shape[0]), fb.max_q
    k_max = int(total.max().item()) if bs else 0
    jj = torch.arange(k_max, device=dev)  # [K]
    src = (drop[:, None] + jj[None, :]).clamp(max=max(fb.kv_indices.shape[1] - 1, 0))  # [bs, K]
    kv_indices = torch.gather(fb.kv_indices, 1, src) if k_max else fb.kv_indices[:, :0]
    key_used = jj[None, :] < total[:, None]  # [bs, K]
    kv_indices = torch.where(key_used, kv_indices, torch.zeros_like(kv_indices))
    ii = torch.arange(q_max, device=dev)  # [Q]
    q_pos = prefix[:, None] + ii[None, :]  # [bs, Q]
    k_pos = drop[:, None] + jj[None, :]  # [bs, K] (context and block keys alike)
    mask = key_used[:, None, :] & visibility(q_pos, k_pos, spec)  # [bs, Q, K]
    q_valid = ii[None, :] < ext[:, None]  # [bs, Q]
    pad_row = torch.zeros(k_max, dtype=torch.bool, device=dev)
    if k_max:
        pad_row[0] = True  # padded query rows see key 0 only (forward_batch.py)
    mask = torch.where(q_valid[:, :, None], mask, pad_row[None, None, :])
    tree = None
    if fb.tree_mask is not None:  # the block part of the mask, for backends that read it
        blk = torch.arange(fb.tree_mask.shape[1], device=dev)
        tree = fb.tree_mask & visibility(blk, blk, spec)
    return dataclasses.replace(fb, kv_indices=kv_indices, attn_mask=mask, prefix_lens=keep, tree_mask=tree)
