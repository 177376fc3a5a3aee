"""The DFlash training objective (arXiv 2602.06036; semantics as in SpecForge's DFlash trainer).

Per sequence, ``N`` random anchor positions ``a`` in the response each open a block ``[tok[a], MASK x
(B-1)]`` at positions ``a..a+B-1``. Attention keys are ``[context (S tokens) ; block_0 ; ... ; block_N-1]``:
block n sees context positions strictly before its anchor, itself bidirectionally, and no other block.
Block position k = 1..B-1 predicts ``tok[a+k]`` with weight ``exp(-(k-1)/gamma)``; the anchor position
(k = 0) and labels past the sequence end carry no loss.

Soft targets (``kd_weight`` alpha > 0, records with ``teacher_ids``/``teacher_logp`` from the data stage):
a row's loss is ``(1 - alpha) CE(label) + alpha soft-CE(q)``, q the target's top-K distribution at that
position renormalised over its K ids, with the same position weights; rows without teacher data use CE.

Greedy labels (``greedy_labels``): where a record carries teacher data, the hard label at a position is the
target's most probable token there (its top-1 given the recorded prefix) instead of the recorded token. On a
greedy response the two agree; on a sampled one the label becomes the token a greedy verifier accepts after
that prefix, while the context (features, anchors) stays the sampled sequence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class BlockBatch:
    ctx_feats: torch.Tensor  # [b, S, n*H] target features (zero-padded past each sequence)
    ctx_positions: torch.Tensor  # [b, S]
    block_ids: torch.Tensor  # [b, N*B] anchor token then mask token per block
    block_positions: torch.Tensor  # [b, N*B]
    attn_mask: torch.Tensor  # [b, N*B, S + N*B] bool
    labels: torch.Tensor  # [b, N*B] token at anchor + k (0 where no loss)
    weights: torch.Tensor  # [b, N*B] float loss weight (0: no loss)
    teacher_ids: torch.Tensor | None = None  # [b, N*B, K] the target's top-K ids for the label position
    teacher_logp: torch.Tensor | None = None  # [b, N*B, K] their log-probabilities (-inf: padding)
    has_teacher: torch.Tensor | None = None  # [b, N*B] bool: the row's record carries teacher data


def sample_anchors(prompt_len: int, seq_len: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """Up to ``n`` distinct sorted anchors in ``[prompt_len, seq_len - 2]`` (each has >= 1 label)."""
    lo, hi = prompt_len, seq_len - 2
    if hi < lo:
        return torch.zeros(0, dtype=torch.int64)
    cand = torch.arange(lo, hi + 1)
    pick = torch.randperm(cand.numel(), generator=gen)[:n]
    return cand[pick].sort().values


def block_attention_mask(anchors: torch.Tensor, valid: torch.Tensor, ctx_len: int, block_size: int) -> torch.Tensor:
    """anchors [b, N], valid [b, N] bool -> mask [b, N*B, S + N*B]. An invalid block sees only itself
    (no row is fully masked; it carries no loss)."""
    b, n = anchors.shape
    q = n * block_size
    q_block = torch.arange(q) // block_size  # [Q]
    kv = torch.arange(ctx_len + q)  # [S+Q]
    anchor_q = anchors[:, q_block]  # [b, Q]
    ctx_ok = (kv[None, None, :] < ctx_len) & (kv[None, None, :] < anchor_q[:, :, None])  # [b, Q, S+Q]
    ctx_ok = ctx_ok & valid[:, q_block][:, :, None]
    kv_block = (kv - ctx_len).div(block_size, rounding_mode="floor")  # [S+Q]
    blk_ok = (kv[None, :] >= ctx_len) & (kv_block[None, :] == q_block[:, None])  # [Q, S+Q]
    return ctx_ok | blk_ok[None]


def make_block_batch(seqs: list[dict], n_anchors: int, block_size: int, mask_token_id: int, gamma: float,
                     gen: torch.Generator, teacher: bool = False, greedy_labels: bool = False) -> BlockBatch:
    """Collate records ``{"tokens" [S], "prompt_len", "feats" [S, n*H]}`` into one training batch. With
    ``teacher`` and any record carrying ``teacher_ids``/``teacher_logp`` [R, K], the batch also holds the
    target's top-K at every label position; with ``greedy_labels`` such records' labels are the top-1 of
    that top-K (the random draws are the same either way)."""
    b = len(seqs)
    s_max = max(int(r["tokens"].numel()) for r in seqs)
    feat_dim = seqs[0]["feats"].shape[1]
    feats = torch.zeros(b, s_max, feat_dim, dtype=seqs[0]["feats"].dtype)
    tokens = torch.zeros(b, s_max, dtype=torch.int64)
    anchors = torch.zeros(b, n_anchors, dtype=torch.int64)
    valid = torch.zeros(b, n_anchors, dtype=torch.bool)
    lens = torch.zeros(b, dtype=torch.int64)
    for i, r in enumerate(seqs):
        s = int(r["tokens"].numel())
        feats[i, :s], tokens[i, :s], lens[i] = r["feats"], r["tokens"].long(), s
        a = sample_anchors(int(r["prompt_len"]), s, n_anchors, gen)
        anchors[i, : a.numel()], valid[i, : a.numel()] = a, True
    k = torch.arange(block_size)  # [B]
    pos = (anchors[:, :, None] + k).reshape(b, -1)  # [b, N*B]
    in_seq = pos < lens[:, None]  # [b, N*B]
    labels = torch.gather(tokens, 1, pos.clamp(max=s_max - 1)) * in_seq
    ids = torch.full_like(pos, mask_token_id)
    ids[:, ::block_size] = torch.gather(tokens, 1, anchors)
    decay = torch.exp(-(k - 1).clamp(min=0).float() / gamma) * (k > 0)  # [B]
    weights = decay.repeat(n_anchors)[None, :] * in_seq * valid.repeat_interleave(block_size, 1)
    batch = BlockBatch(
        ctx_feats=feats, ctx_positions=torch.arange(s_max).expand(b, -1), block_ids=ids, block_positions=pos,
        attn_mask=block_attention_mask(anchors, valid, s_max, block_size), labels=labels, weights=weights.float(),
    )
    if (teacher or greedy_labels) and any("teacher_ids" in r for r in seqs):
        _add_teacher(batch, seqs, in_seq)
        if greedy_labels:
            batch.labels = torch.where(batch.has_teacher, batch.teacher_ids[:, :, 0], batch.labels)
        if not teacher:
            batch.teacher_ids = batch.teacher_logp = batch.has_teacher = None
    return batch


def _add_teacher(batch: BlockBatch, seqs: list[dict], in_seq: torch.Tensor) -> None:
    """Gather each label position's teacher row ``pos - prompt_len`` (row r predicts tokens[prompt_len + r])."""
    b, q = batch.labels.shape
    k = max(int(r["teacher_ids"].shape[1]) for r in seqs if "teacher_ids" in r)
    t_ids = torch.zeros(b, q, k, dtype=torch.int64)
    t_logp = torch.full((b, q, k), float("-inf"))
    has = torch.zeros(b, q, dtype=torch.bool)
    for i, r in enumerate(seqs):
        if "teacher_ids" not in r:
            continue
        tid, tlp = r["teacher_ids"].long(), r["teacher_logp"].float()  # [R, K_i]
        row = batch.block_positions[i] - int(r["prompt_len"])  # [Q]
        ok = in_seq[i] & (row >= 0) & (row < tid.shape[0])  # [Q]
        sel = row.clamp(0, tid.shape[0] - 1)
        t_ids[i, :, : tid.shape[1]] = tid[sel] * ok[:, None]
        t_logp[i, :, : tid.shape[1]] = tlp[sel].masked_fill(~ok[:, None], float("-inf"))
        has[i] = ok
    batch.teacher_ids, batch.teacher_logp, batch.has_teacher = t_ids, t_logp, has


def dflash_loss(hidden: torch.Tensor, lm_head_weight: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
                vocab_subset: torch.Tensor | None = None, kd_weight: float = 0.0,
                teacher_ids: torch.Tensor | None = None, teacher_logp: torch.Tensor | None = None,
                has_teacher: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Weighted cross-entropy of the target's (frozen) LM head over the drafter's block outputs.
    hidden [b, Q, H], lm_head_weight [V, H], labels/weights [b, Q]. ``vocab_subset`` (sorted ids [V'],
    containing every label) restricts the softmax to those tokens to save compute on CPU.
    ``kd_weight`` alpha > 0 with teacher_ids/teacher_logp [b, Q, K] and has_teacher [b, Q]: rows with teacher
    data score ``(1 - alpha) CE + alpha soft-CE`` against softmax(teacher_logp) over the teacher ids (ids
    outside ``vocab_subset`` are dropped and the rest renormalised; a row left with none uses CE alone).
    Returns (loss, stats) with stats: weighted-mean loss, top-1 accuracy at k=1 and over all rows."""
    if kd_weight > 0 and teacher_ids is not None:
        return _kd_loss(hidden, lm_head_weight, labels, weights, vocab_subset, kd_weight, teacher_ids,
                        teacher_logp, has_teacher)
    rows = weights.reshape(-1) > 0  # [b*Q]
    h = hidden.reshape(-1, hidden.shape[-1])[rows]  # [M, H]
    y = labels.reshape(-1)[rows]
    w = weights.reshape(-1)[rows]
    head = lm_head_weight
    if vocab_subset is not None:
        head = lm_head_weight[vocab_subset]
        y = torch.searchsorted(vocab_subset, y)
    logits = F.linear(h, head.to(h.dtype)).float()  # [M, V']
    ce = F.cross_entropy(logits, y, reduction="none")  # [M]
    loss = (ce * w).sum() / w.sum().clamp_min(1e-6)
    return loss, _stats(loss, logits, y, w)


def _stats(loss: torch.Tensor, logits: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> dict[str, float]:
    with torch.no_grad():
        hit = (logits.argmax(-1) == y).float()
        first = torch.isclose(w, torch.ones_like(w))  # k = 1 rows carry weight exp(0) = 1
        return {"loss": float(loss), "acc": float(hit.mean()) if hit.numel() else 0.0,
                "acc_k1": float(hit[first].mean()) if bool(first.any()) else 0.0}


def _kd_loss(hidden: torch.Tensor, lm_head_weight: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
             vocab_subset: torch.Tensor | None, alpha: float, teacher_ids: torch.Tensor,
             teacher_logp: torch.Tensor | None, has_teacher: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, float]]:
    assert teacher_logp is not None and has_teacher is not None
    rows = weights.reshape(-1) > 0  # [b*Q]
    h = hidden.reshape(-1, hidden.shape[-1])[rows]  # [M, H]
    y, w = labels.reshape(-1)[rows], weights.reshape(-1)[rows]  # [M]
    k = teacher_ids.shape[-1]
    t_ids = teacher_ids.reshape(-1, k)[rows].to(h.device)  # [M, K]
    t_logp = teacher_logp.reshape(-1, k)[rows].to(h.device).float()  # [M, K]
    has = has_teacher.reshape(-1)[rows].to(h.device)  # [M]
    head = lm_head_weight
    if vocab_subset is not None:
        head = lm_head_weight[vocab_subset]
        y = torch.searchsorted(vocab_subset, y)
        idx = torch.searchsorted(vocab_subset, t_ids).clamp(max=vocab_subset.numel() - 1)  # [M, K]
        t_logp = t_logp.masked_fill(vocab_subset[idx] != t_ids, float("-inf"))  # outside the subset: dropped
        t_ids = idx
    has = has & torch.isfinite(t_logp).any(-1)  # [M]
    q = torch.softmax(t_logp.masked_fill(~has[:, None], 0.0), -1)  # [M, K] renormalised over the kept ids
    logits = F.linear(h, head.to(h.dtype)).float()  # [M, V']
    logp = torch.log_softmax(logits, -1)  # [M, V']
    ce = -logp.gather(1, y[:, None]).squeeze(1)  # [M]
    soft = -(q * logp.gather(1, t_ids)).sum(-1)  # [M]
    row = torch.where(has, (1 - alpha) * ce + alpha * soft, ce)  # [M]
    loss = (row * w).sum() / w.sum().clamp_min(1e-6)
    stats = _stats(loss, logits, y, w)
    stats["soft_ce"] = float((soft.detach() * w * has).sum() / (w * has).sum().clamp_min(1e-6))
    return loss, stats


def lr_at(step: int, total: int, peak: float, warmup: int, min_ratio: float = 0.1) -> float:
    """Linear warm-up then cosine decay to ``min_ratio * peak``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t)))
