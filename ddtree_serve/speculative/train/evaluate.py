"""Offline acceptance of a DFlash drafter on held-out greedy responses (arXiv 2602.06036 / 2604.12989).

For a response the target produced greedily, a speculative decoder's steps are fully determined: the
first root is the first response token (emitted by prefill), the context is everything before the root,
and after each step the next root is the target's token right after the accepted path. So chain DFlash
(top-1 path) and DDTree (the ``budget`` most probable prefixes, built with ``ddtree_serve.speculative.ddtree``)
acceptance can be simulated exactly from the drafter alone: accept while the tree holds the next
response token. tau = tokens emitted by speculative steps / steps (accepted drafts + the bonus token;
the prefill's first token is not counted).
"""

from __future__ import annotations

import torch

from ddtree_serve.model_executor.models.dflash import DFlashDraftModel
from ddtree_serve.speculative.ddtree import build_ddtree
from ddtree_serve.speculative.train.objective import block_attention_mask


@torch.no_grad()
def draft_hidden_all_anchors(model: DFlashDraftModel, embed_w: torch.Tensor, rec: dict) -> torch.Tensor:
    """Final-normed drafter states for a block at every response anchor: [A, B, H] for anchors
    ``prompt_len .. S-2`` (dense path; one forward)."""
    tokens = rec["tokens"].long()
    s, p0, bsz = tokens.numel(), int(rec["prompt_len"]), model.block_size
    anchors = torch.arange(p0, s - 1)[None]  # [1, A]
    a = anchors.shape[1]
    ids = torch.full((1, a * bsz), model.mask_token_id, dtype=torch.int64)
    ids[:, ::bsz] = tokens[anchors]
    pos = (anchors[:, :, None] + torch.arange(bsz)).reshape(1, -1)
    mask = block_attention_mask(anchors, torch.ones_like(anchors, dtype=torch.bool), s, bsz)
    dt = model.fc.weight.dtype
    h = model.forward_train(rec["feats"][None].to(dt), torch.arange(s)[None], embed_w[ids].to(dt), pos, mask)
    return h.view(a, bsz, -1)


def _walk(tree_tokens: list[int], parents: list[int], truth: list[int]) -> int:
    """Accepted depth when the target's continuation is ``truth``."""
    node, depth = 0, 0
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        if i > 0 and p >= 0:
            children.setdefault(p, []).append(i)
    while depth < len(truth):
        nxt = [c for c in children.get(node, []) if tree_tokens[c] == truth[depth]]
        if not nxt:
            break
        node, depth = nxt[0], depth + 1
    return depth


@torch.no_grad()
def offline_acceptance(model: DFlashDraftModel, embed_w: torch.Tensor, head_w: torch.Tensor, records: list[dict],
                       budget: int = 16) -> dict[str, float]:
    """Chain and DDTree(budget) tau over greedy records, plus the per-depth top-1 accuracy."""
    totals = {"chain": [0, 0], "ddtree": [0, 0]}
    depth_hits = torch.zeros(model.block_size - 1)
    depth_n = torch.zeros(model.block_size - 1)
    for rec in records:
        if float(rec.get("temperature", 0.0)) != 0.0:
            continue
        tokens = rec["tokens"].long().tolist()
        p0, s = int(rec["prompt_len"]), len(tokens)
        if s - p0 < 2:
            continue
        hid = draft_hidden_all_anchors(model, embed_w, rec)  # [A, B, H]
        logits_cache: dict[int, torch.Tensor] = {}

        def logits_at(root: int, hid=hid, p0=p0, cache=logits_cache) -> torch.Tensor:
            if root not in cache:
                cache[root] = torch.nn.functional.linear(hid[root - p0, 1:], head_w.to(hid.dtype)).float()
            return cache[root]  # [B-1, V]

        for mode in ("chain", "ddtree"):
            root, steps = p0, 0
            while root < s - 1:
                truth = tokens[root + 1:]
                lg = logits_at(root)[None]  # [1, L, V]
                tree = build_ddtree(lg, torch.tensor([budget]), torch.tensor([tokens[root]]), torch.tensor([root]),
                                    chain=mode == "chain")
                acc = _walk(tree.candidates[0].tolist(), tree.parents[0].tolist(), truth)
                if mode == "chain":
                    top1 = lg[0].argmax(-1).tolist()
                    for d in range(min(len(top1), len(truth))):
                        depth_n[d] += 1
                        depth_hits[d] += top1[d] == truth[d]
                root += acc + 1
                steps += 1
            totals[mode][0] += s - p0 - 1  # tokens emitted by the steps (the first comes from prefill)
            totals[mode][1] += steps
    out = {f"tau_{m}": (t / n if n else 0.0) for m, (t, n) in totals.items()}
    for d in range(depth_n.numel()):
        out[f"acc_d{d + 1}"] = float(depth_hits[d] / depth_n[d]) if depth_n[d] else 0.0
    return out
