"""DFlash drafter (arXiv 2602.06036): paged inference path == dense training path, z-lab format round trip,
default target layers."""

from __future__ import annotations

import json

import pytest
import torch

from ddtree_serve.kernels.attention import TorchAttentionBackend
from ddtree_serve.model_executor.forward_batch import ForwardMode, build_forward_batch
from ddtree_serve.model_executor.kv_cache import KVCache, TokenSlotAllocator
from ddtree_serve.model_executor.model_config import ModelConfig
from ddtree_serve.model_executor.models.dflash import (
    DFlashDraftModel,
    default_target_layer_ids,
)
from ddtree_serve.model_executor.weight_loader import iter_weights
from ddtree_serve.speculative.train.export import drafter_config, save_drafter

TARGET_HF = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
             "num_hidden_layers": 6, "vocab_size": 97, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
             "max_position_embeddings": 512, "tie_word_embeddings": True}
BLOCK = 4


def _drafter(seed: int = 0, layers: int = 2, kv_heads: int = 0) -> tuple[DFlashDraftModel, dict]:
    cfg = drafter_config(TARGET_HF, layers, BLOCK, [1, 3, 4], mask_token_id=96, num_kv_heads=kv_heads)
    model = DFlashDraftModel(ModelConfig("", cfg, "DFlashDraftModel", (), torch.float32))
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        scale = 0.3 if "norm" in name else 0.1
        p.data.copy_((1.0 if "norm" in name else 0.0) + scale * torch.randn(p.shape, generator=g))
    return model, cfg


def _paged_draft(model: DFlashDraftModel, feats: list[torch.Tensor], embeds: list[torch.Tensor]) -> torch.Tensor:
    """Write each request's context, then draft all blocks in one TARGET_VERIFY batch."""
    kv = KVCache(model.kv_cache_layout(), 256, torch.float32, "cpu")
    alloc = TokenSlotAllocator(256)
    table = torch.zeros(len(feats), 64, dtype=torch.int64)
    for b, f in enumerate(feats):
        slots = alloc.alloc(f.shape[0])
        table[b, : f.shape[0]] = slots
        model.write_context(f, torch.arange(f.shape[0]), slots, kv)
    prefix = torch.tensor([f.shape[0] for f in feats])
    blk = alloc.alloc(BLOCK * len(feats))
    for b, p in enumerate(prefix.tolist()):
        table[b, p:p + BLOCK] = blk[b * BLOCK:(b + 1) * BLOCK]
    pos = torch.cat([torch.arange(p, p + BLOCK) for p in prefix.tolist()])
    fb = build_forward_batch(ForwardMode.TARGET_VERIFY, torch.zeros(len(pos), dtype=torch.int64), pos, blk, table,
                             torch.arange(len(feats)), prefix, torch.full((len(feats),), BLOCK),
                             tree_mask=torch.ones(len(feats), BLOCK, BLOCK, dtype=torch.bool),
                             input_embeds=torch.cat(embeds))
    return model(fb, kv, TorchAttentionBackend()).view(len(feats), BLOCK, -1)


@pytest.mark.parametrize("kv_heads", [0, 4])  # the target's 2 KV heads; one per query head (--num-kv-heads 4)
def test_paged_inference_equals_dense_training_path(kv_heads: int):
    model, _ = _drafter(kv_heads=kv_heads)
    g = torch.Generator().manual_seed(1)
    lens = [9, 14]
    feats = [torch.randn(n, 3 * 64, generator=g) * 3 for n in lens]
    embeds = [torch.randn(BLOCK, 64, generator=g) for _ in lens]
    head = torch.randn(97, 64, generator=g)
    paged = _paged_draft(model, feats, embeds)  # [2, B, H]
    for b, n in enumerate(lens):  # dense: context = everything before the anchor at position n
        mask = torch.ones(1, BLOCK, n + BLOCK, dtype=torch.bool)
        with torch.no_grad():
            dense = model.forward_train(feats[b][None], torch.arange(n)[None], embeds[b][None],
                                        torch.arange(n, n + BLOCK)[None], mask)[0]
        torch.testing.assert_close(paged[b] @ head.T, dense @ head.T, atol=1e-4, rtol=1e-4)


def test_dense_mask_hides_later_context_and_other_blocks():
    """Two blocks in one dense forward (anchors 5 and 9 over a 12-token context) equal two separate
    forwards that only see their own prefix."""
    model, _ = _drafter(seed=3)
    g = torch.Generator().manual_seed(2)
    feats, emb = torch.randn(1, 12, 192, generator=g), torch.randn(1, 2 * BLOCK, 64, generator=g)
    from ddtree_serve.speculative.train.objective import block_attention_mask

    anchors = torch.tensor([[5, 9]])
    pos = (anchors[:, :, None] + torch.arange(BLOCK)).reshape(1, -1)
    with torch.no_grad():
        both = model.forward_train(feats, torch.arange(12)[None], emb, pos,
                                   block_attention_mask(anchors, torch.ones(1, 2, dtype=torch.bool), 12, BLOCK))
        for i, a in enumerate((5, 9)):
            one = model.forward_train(feats[:, :a], torch.arange(a)[None], emb[:, i * BLOCK:(i + 1) * BLOCK],
                                      pos[:, i * BLOCK:(i + 1) * BLOCK], torch.ones(1, BLOCK, a + BLOCK, dtype=torch.bool))
            torch.testing.assert_close(both[:, i * BLOCK:(i + 1) * BLOCK], one, atol=1e-5, rtol=1e-5)


def test_save_reload_zlab_format_drafts_identically(tmp_path):
    model, cfg = _drafter(seed=5)
    for p in model.parameters():  # the checkpoint is bf16: compare against bf16-representable weights
        p.data = p.data.bfloat16().float()
    save_drafter(model, cfg, tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["architectures"] == ["DFlashDraftModel"] and saved["block_size"] == BLOCK
    assert saved["dflash_config"] == {"mask_token_id": 96, "target_layer_ids": [1, 3, 4]}
    names = {n for n, _ in iter_weights(str(tmp_path))}
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.q_proj.weight",
            "layers.0.self_attn.k_norm.weight", "layers.0.mlp.gate_proj.weight", "layers.0.mlp.down_proj.weight",
            "layers.1.post_attention_layernorm.weight"} <= names
    loaded_cfg = ModelConfig.load(str(tmp_path), "float32")
    from ddtree_serve.model_executor.model_registry import get_model_class

    reloaded = get_model_class(loaded_cfg.architecture)(loaded_cfg)
    reloaded.load_weights(iter_weights(str(tmp_path)))
    assert reloaded.target_layer_ids == (1, 3, 4) and reloaded.mask_token_id == 96 and reloaded.block_size == BLOCK
    g = torch.Generator().manual_seed(7)
    feats, embeds = [torch.randn(11, 192, generator=g)], [torch.randn(BLOCK, 64, generator=g)]
    torch.testing.assert_close(_paged_draft(reloaded, feats, embeds), _paged_draft(model, feats, embeds))


def test_default_target_layer_ids():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(30, 5) == [1, 8, 14, 20, 27]
    assert default_target_layer_ids(30, 1) == [15]
    assert default_target_layer_ids(3, 3) == [1, 0, 0]
    # too shallow for 1..N-3: clamped into the target's layers (was [1, -1], a layer the target lacks)
    assert default_target_layer_ids(2, 2) == [1, 0]
    for n in range(1, 12):
        for k in range(1, 6):
            assert all(0 <= i < n for i in default_target_layer_ids(n, k)), (n, k)
