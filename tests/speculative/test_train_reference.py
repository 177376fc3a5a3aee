"""The training path of the DFlash drafter is z-lab's model (github z-lab/dflash ``dflash/model.py``,
``DFlashDraftModel.forward``; arXiv 2602.06036): a plain-torch transcription of its semantics (fused context
through ``fc`` + ``hidden_norm``, context K/V from every layer's own k/v projections with ``k_norm`` and RoPE
at the context positions, queries from ``[anchor, MASK...]`` only, non-causal attention over ``[context ;
block]``, final norm) run block by block with the context strictly before each anchor, equals
``forward_train`` on the batched training layout (``make_block_batch``'s mask and positions)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ddtree_serve.model_executor.model_config import ModelConfig
from ddtree_serve.model_executor.models.dflash import DFlashDraftModel
from ddtree_serve.speculative.train.export import drafter_config, zlab_state_dict
from ddtree_serve.speculative.train.objective import make_block_batch

TARGET_HF = {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
             "num_hidden_layers": 8, "vocab_size": 50, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
             "max_position_embeddings": 256}
HEADS, KV, DIM, EPS = 4, 2, 16, 1e-6


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Half-split (neox) rotary embedding, as transformers' Qwen3. x [h, T, d], pos [T]."""
    inv = 1.0 / theta ** (torch.arange(0, DIM, 2).float() / DIM)  # [d/2]
    ang = torch.cat([pos[:, None] * inv] * 2, -1)  # [T, d]
    half = torch.cat([-x[..., DIM // 2:], x[..., :DIM // 2]], -1)
    return x * ang.cos() + half * ang.sin()


def _zlab_block(w: dict[str, torch.Tensor], layers: int, ctx: torch.Tensor, emb: torch.Tensor, start: int,
                theta: float) -> torch.Tensor:
    """One block the way z-lab drafts it: ctx [S, n*H] features of positions 0..S-1 (S = start), emb [B, H]
    embeddings of ``[anchor, MASK...]`` at positions start..start+B-1 -> final-normed states [B, H]."""
    b = emb.shape[0]
    th = _rms(ctx @ w["fc.weight"].T, w["hidden_norm.weight"])  # [S, H]
    pos = torch.arange(start + b).float()
    h = emb
    for i in range(layers):
        p = f"layers.{i}.self_attn."
        x = _rms(h, w[f"layers.{i}.input_layernorm.weight"])
        q = _rms((x @ w[p + "q_proj.weight"].T).view(b, HEADS, DIM), w[p + "q_norm.weight"]).transpose(0, 1)
        k = torch.cat([th, x]) @ w[p + "k_proj.weight"].T  # [S+B, Hkv*d]
        v = (torch.cat([th, x]) @ w[p + "v_proj.weight"].T).view(-1, KV, DIM).transpose(0, 1)
        k = _rms(k.view(-1, KV, DIM), w[p + "k_norm.weight"]).transpose(0, 1)
        q, k = _rope(q, pos[start:], theta), _rope(k, pos, theta)
        k, v = k.repeat_interleave(HEADS // KV, 0), v.repeat_interleave(HEADS // KV, 0)
        o = F.scaled_dot_product_attention(q, k, v, scale=DIM**-0.5)  # no mask: non-causal
        h = h + o.transpose(0, 1).reshape(b, -1) @ w[p + "o_proj.weight"].T
        x = _rms(h, w[f"layers.{i}.post_attention_layernorm.weight"])
        m = f"layers.{i}.mlp."
        act = F.silu(x @ w[m + "gate_proj.weight"].T) * (x @ w[m + "up_proj.weight"].T)  # [B, I]
        h = h + act @ w[m + "down_proj.weight"].T
    return _rms(h, w["norm.weight"])


def test_forward_train_equals_zlab_drafting_block_by_block():
    cfg = drafter_config(TARGET_HF, 2, 4, [1, 3, 5], mask_token_id=49)
    model = DFlashDraftModel(ModelConfig("", cfg, "DFlashDraftModel", (), torch.float32))
    g = torch.Generator().manual_seed(0)
    for name, p in model.named_parameters():
        p.data.copy_((1.0 if "norm" in name else 0.0) + (0.3 if "norm" in name else 0.1) * torch.randn(
            p.shape, generator=g))
    w = {k: v.detach() for k, v in zlab_state_dict(model).items()}
    recs = [{"tokens": torch.randint(0, 49, (s,), generator=g, dtype=torch.int32), "prompt_len": 5,
             "feats": torch.randn(s, 3 * 64, generator=g)} for s in (19, 14)]
    batch = make_block_batch(recs, 3, 4, 49, 4.0, g)
    embed = torch.randn(50, 64, generator=g)  # the target's embedding table
    with torch.no_grad():
        got = model.forward_train(batch.ctx_feats, batch.ctx_positions, embed[batch.block_ids],
                                  batch.block_positions, batch.attn_mask)  # [b, N*B, H]
    for i, r in enumerate(recs):
        for n in range(3):
            a, ids = int(batch.block_positions[i, n * 4]), batch.block_ids[i, n * 4:n * 4 + 4]
            assert ids[0] == r["tokens"][a] and bool((ids[1:] == 49).all())  # [anchor, MASK x 3]
            want = _zlab_block(w, 2, r["feats"][:a], embed[ids], a, 10000.0)  # context strictly before a
            torch.testing.assert_close(got[i, n * 4:n * 4 + 4], want, atol=2e-5, rtol=2e-5)
