"""The speculative step's two tree-shaped forwards (docs/DESIGN.md 3, 4.17): the DFlash drafter over each
request's block, and the target over each request's tree with the ancestor-only mask, ragged or padded to a
captured width; their sizes come from the host (``HostShape``), so building them reads nothing back."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ddtree_serve.model_executor.forward_batch import (
    ForwardBatch,
    ForwardMode,
    HostShape,
    RowKinds,
    build_forward_batch,
    flat_rows,
)
from ddtree_serve.model_executor.kv_cache import KVCache
from ddtree_serve.model_executor.model_runner import ModelRunner
from ddtree_serve.model_executor.vocab_shard import VocabShard
from ddtree_serve.speculative.ddtree import DraftTree
from ddtree_serve.speculative.draft_graphs import DraftGraphs


def padded_width(widths: dict[int, tuple[int, ...]], bs: int, width: int, cap: int | None) -> int | None:
    """The smallest captured width (``widths``: padded batch size -> widths) of ``bs``'s padded batch size that
    holds a tree of ``width`` slots and keeps ``bs`` padded trees within ``cap``; None: stay ragged."""
    pad_bs = next((b for b in widths if b >= bs), None)
    if pad_bs is None:
        return None
    w = next((w for w in widths[pad_bs] if w >= width), None)
    return None if w is None or (cap is not None and bs * w > cap) else w


def draft_forward(r: ModelRunner, drafter: torch.nn.Module, draft_kv: KVCache, backend: object, bsz: int,
                  idx: torch.Tensor, cached: torch.Tensor, roots: torch.Tensor, max_cached: int,
                  local: bool = False, graphs: DraftGraphs | None = None) -> tuple[torch.Tensor, VocabShard]:
    """One drafter forward over [root, MASK x (B-1)] per request -> logits [bs, B-1, V] and their vocabulary
    shard; ``local``: this rank's vocabulary columns ``[bs, B-1, V/tp]`` under vocabulary-parallel TP (for
    ``draft_topk``'s top-k of top-k's), else gathered. ``max_cached``: the largest root position (the host's, so
    no size is read back). ``graphs``: the captured drafts (speculative/draft_graphs.py); a batch one of them
    holds replays it (the logits are then a view of the graph's output, valid until its next replay)."""
    if graphs is not None:
        out = graphs.draft(idx, cached, roots, local)
        if out is not None:
            return out
    bs = idx.shape[0]
    block = r.slots.place_block(idx, cached, bsz)  # [bs, B] temporary slots for the block's own K/V
    slots = block.view(-1)  # [bs*B]
    offs = torch.arange(bsz, device=r.device)  # [B]
    ids = torch.full((bs, bsz), int(drafter.mask_token_id), device=r.device)  # [bs, B]
    ids[:, 0] = roots
    fb = build_forward_batch(
        ForwardMode.TARGET_VERIFY, ids.view(-1), (cached[:, None] + offs).view(-1), slots, r.slots.table,
        idx, cached, torch.full((bs,), bsz, device=r.device),
        tree_mask=torch.ones(bs, bsz, bsz, dtype=torch.bool, device=r.device),
        input_embeds=r.model.embed(ids.view(-1)), dense_mask=getattr(drafter, "reads_attn_mask", True),
        host=HostShape(bs * bsz, bsz, max_cached + bsz))
    hidden = drafter(fb, draft_kv, backend).view(bs, bsz, -1)  # [bs, B, H]
    r.slots.free(slots)
    rows = hidden[:, 1:].reshape(bs * (bsz - 1), -1)  # [bs*(B-1), H]
    logits, shard = r.step_logits(rows) if local else (r.logits(rows), VocabShard.whole(r.config.vocab_size))
    return logits.view(bs, bsz - 1, -1), shard


@dataclass
class VerifyInputs:
    """A verify forward's inputs, its tree slots placed (``prepare_verify``): what ``run_verify`` launches."""

    fb: ForwardBatch
    dest: torch.Tensor  # [T] rows of the padded [bs * D] layout that run
    flat: torch.Tensor  # [T] the slots placed for them (the forward's out_cache_loc)
    slots: torch.Tensor  # [bs, D] each tree slot's KV slot, -1 for unused slots
    tokens: int  # T, as the host knows it
    host: HostShape | None  # the forward's sizes as the host knows them


def verify_forward(r: ModelRunner, tree: DraftTree, idx: torch.Tensor, cached: torch.Tensor,
                   capture_layer_ids: tuple[int, ...], host: HostShape | None = None, padded: bool = False,
                   params: Sequence | None = None):
    """Target forward over every used tree slot (root included) with the ancestor-only mask: ragged, a
    request with fewer nodes than the widest tree costs only its own tokens. Returns logits and captured
    features in the padded ``[bs, D]`` layout (rows of unused slots are zero and no link reaches them)
    and the KV slots ``[bs, D]`` (-1 for unused slots). ``host``: the forward's sizes as the host knows them
    (tokens, D, the longest context); None reads them back. ``padded``: every slot runs, unused ones too (a
    uniform width that replays a captured graph; their outputs are never read, their slots freed by the
    commit). ``params``: the requests' ``SamplingParams`` (``RowKinds``: a simulated device's exchange), or None."""
    return run_verify(r, prepare_verify(r, tree, idx, cached, capture_layer_ids, host, padded, params))


def prepare_verify(r: ModelRunner, tree: DraftTree, idx: torch.Tensor, cached: torch.Tensor,
                   capture_layer_ids: tuple[int, ...], host: HostShape | None = None, padded: bool = False,
                   params: Sequence | None = None) -> VerifyInputs:
    """``verify_forward``'s first half: the tree slots placed in the table (row after row at columns
    ``cached[b] ..``) and the forward batch built, nothing launched. The caller checked that the slots are free."""
    bs, d = tree.candidates.shape
    if padded:
        lens = torch.full((bs,), d, dtype=torch.int64, device=r.device)  # [bs] every slot
    else:
        lens = tree.num_nodes.to(r.device) + 1  # [bs] root + nodes
    if host is None:
        used = torch.arange(d, device=r.device)[None, :] < lens[:, None]  # [bs, D]
        dest = used.view(-1).nonzero().squeeze(1)  # [T] padded rows of the used slots
    else:
        dest = flat_rows(lens, d, host.tokens)  # [T] the same rows, no read back
    positions = tree.positions.view(-1)[dest]  # [T]
    tokens = int(dest.shape[0])
    # [T] row after row at table columns cached[b]..cached[b]+lens[b]-1; DCP: each node on its position's rank
    flat = r.slots.place(idx, cached, lens, positions=positions, total=tokens)
    slots = torch.full((bs * d,), -1, dtype=torch.int64, device=r.device).index_copy_(0, dest, flat)  # [bs*D]
    fb = build_forward_batch(  # a step whose trees are all the root alone never gets here (_plain_step)
        ForwardMode.TARGET_VERIFY, tree.candidates.view(-1)[dest], positions, flat, r.slots.table, idx, cached,
        lens, tree_mask=tree.tree_mask, capture_layer_ids=capture_layer_ids, dense_mask=r.dense_mask,
        host=host, row_kinds=RowKinds.of(params))
    return VerifyInputs(fb, dest, flat, slots.view(bs, d), tokens, host)


def run_verify(r: ModelRunner, inputs: VerifyInputs):
    """``verify_forward``'s second half: launch the forward of ``prepare_verify``'s inputs; logits ``[bs, D, V]``
    (or this rank's ``V/tp`` columns), captured features ``[bs * D, C]`` or None, the slots ``[bs, D]``."""
    bs, d = inputs.slots.shape
    dest = inputs.dest
    out = r.forward(inputs.fb)
    # scatters by index: a boolean-mask assignment here would synchronise while the forward runs
    rows = r.step_logits(out.hidden)[0]  # [T, V], or [T, V/tp] this rank's columns (``r.vocab_shard``)
    logits = rows.new_zeros(bs * d, rows.shape[-1]).index_copy_(0, dest, rows)  # [bs*D, V]
    captured = None  # no drafter: nothing captured
    if out.captured is not None:
        captured = out.captured.new_zeros(bs * d, out.captured.shape[-1]).index_copy_(0, dest, out.captured)
    return logits.view(bs, d, -1), captured, inputs.slots
