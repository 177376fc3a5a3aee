"""DFlash drafter with DFlash2's grouped dynamic causal convolution (models/dflash_conv.py): the convolution
equals a loop transcription of its rule and stays inside each block; at the identity a conv drafter computes
exactly what the plain one does; with trained-like (random) convolutions the paged path equals the dense
path (also at a block other than the config's); the z-lab export round trip; DFlash2's candidate selector
is refused."""

from __future__ import annotations

import json

import pytest
import torch

from ddtree_serve.model_executor.model_config import ModelConfig
from ddtree_serve.model_executor.model_registry import get_model_class
from ddtree_serve.model_executor.models.dflash import DFlashDraftModel
from ddtree_serve.model_executor.models.dflash_conv import GroupedDynamicCausalConv, conv_settings
from ddtree_serve.model_executor.weight_loader import iter_weights
from ddtree_serve.speculative.train.export import drafter_config, save_drafter
from ddtree_serve.speculative.train.objective import block_attention_mask
from tests.model_executor.test_dflash import BLOCK, TARGET_HF, _drafter, _paged_draft

H = TARGET_HF["hidden_size"]
CONV_NAMES = ("attention_conv.base_kernel", "attention_conv.kernel_projection.weight", "mlp_conv.base_kernel",
              "mlp_conv.kernel_projection.weight")


def _reference_stage(x: torch.Tensor, dyn: torch.Tensor, base: torch.Tensor, group: int) -> torch.Tensor:
    """The rule written out: x [n, B, H], dyn [n, B, K, G], base [K, H]; y[t] = sum_o (base[o] + dyn[t, o, g(c)])
    * x[t - o] within a block, zero before its start."""
    n, blk, hidden = x.shape
    out = torch.zeros_like(x)
    for b in range(n):
        for t in range(blk):
            for o in range(base.shape[0]):
                if t - o < 0:
                    continue
                for c in range(hidden):
                    out[b, t, c] += (base[o, c] + dyn[b, t, o, c // group]) * x[b, t - o, c]
    return out


def _random_conv(conv: GroupedDynamicCausalConv, g: torch.Generator) -> None:
    with torch.no_grad():
        conv.base_kernel.copy_(torch.randn(conv.base_kernel.shape, generator=g) * 0.5)
        conv.kernel_projection.weight.copy_(torch.randn(conv.kernel_projection.weight.shape, generator=g) * 0.2)


@pytest.mark.parametrize("taps", [2, 3])
def test_conv_equals_the_rule_and_stays_in_its_block(taps):
    g = torch.Generator().manual_seed(taps)
    n, blk, hidden, group = 3, 5, 32, 8
    conv = GroupedDynamicCausalConv(hidden, taps, group, torch.float64)
    _random_conv(conv, g)
    x, out = torch.randn(n, blk, hidden, generator=g, dtype=torch.float64), torch.randn(n, blk, hidden, generator=g,
                                                                                       dtype=torch.float64)
    with torch.no_grad():
        y, dyn = conv.prepare(x)
        z = conv.finish(out, dyn)
        full = conv.kernel_projection(x).view(n, blk, 2, taps, hidden // group)  # [n, B, 2, K, G]
    assert dyn.shape == (n, blk, taps, hidden // group)
    torch.testing.assert_close(y, _reference_stage(x, full[:, :, 0], conv.base_kernel[0], group), atol=1e-6, rtol=0)
    torch.testing.assert_close(z, _reference_stage(out, full[:, :, 1], conv.base_kernel[1], group), atol=1e-6, rtol=0)
    # no leakage: another block 1 leaves block 0 alone; a later position leaves the earlier ones alone
    x2 = x.clone()
    x2[1] += 1.0
    x2[0, 3] += 1.0
    with torch.no_grad():
        y2, dyn2 = conv.prepare(x2)
        z2 = conv.finish(out, dyn2)
    assert torch.equal(y2[0, :3], y[0, :3]) and torch.equal(z2[0, :3], z[0, :3])
    assert torch.equal(y2[2], y[2]) and torch.equal(z2[2], z[2])
    assert not torch.equal(y2[0, 3], y[0, 3]) and not torch.equal(y2[1, 0], y[1, 0])


def test_identity_conv_and_a_tap_longer_than_the_block():
    g = torch.Generator().manual_seed(0)
    conv = GroupedDynamicCausalConv(32, 3, 16, torch.float32)  # starts at the identity
    x = torch.randn(2, 2, 32, generator=g)
    with torch.no_grad():
        y, dyn = conv.prepare(x)
        assert torch.equal(y, x) and torch.equal(conv.finish(x, dyn), x)
        _random_conv(conv, g)  # 3 taps over 2-token blocks: the third tap only ever reads zeros
        y, dyn = conv.prepare(x)
        full = conv.kernel_projection(x).view(2, 2, 2, 3, 2)
    torch.testing.assert_close(y, _reference_stage(x, full[:, :, 0], conv.base_kernel[0], 16), atol=1e-6, rtol=0)


def _conv_drafter(plain: DFlashDraftModel, taps: int = 2, block: int = BLOCK, seed: int | None = None
                  ) -> tuple[DFlashDraftModel, dict]:
    """A conv drafter with ``plain``'s weights; its convolutions at the identity, or random with ``seed``."""
    cfg = drafter_config(TARGET_HF, len(plain.layers), block, list(plain.target_layer_ids), plain.mask_token_id,
                         conv_kernel_size=taps, conv_group_size=16)
    model = DFlashDraftModel(ModelConfig("", cfg, "DFlashDraftModel", (), torch.float32))
    missing, unexpected = model.load_state_dict(plain.state_dict(), strict=False)
    assert not unexpected and sorted(missing) == sorted(f"layers.{i}.{n}" for i in range(len(plain.layers))
                                                        for n in CONV_NAMES)
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        for layer in model.layers:
            _random_conv(layer.attention_conv, g)
            _random_conv(layer.mlp_conv, g)
    return model, cfg


def _dense(model: DFlashDraftModel, feats: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
    """One block at the end of ``feats`` [S, n*H] through ``forward_train`` -> [B, H]."""
    n, blk = feats.shape[0], embeds.shape[0]
    mask = torch.ones(1, blk, n + blk, dtype=torch.bool)
    with torch.no_grad():
        return model.forward_train(feats[None], torch.arange(n)[None], embeds[None], torch.arange(n, n + blk)[None],
                                   mask)[0]


def _inputs(seed: int, lens: list[int], blk: int = BLOCK) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return ([torch.randn(n, 3 * H, generator=g) * 3 for n in lens], [torch.randn(blk, H, generator=g) for _ in lens])


def test_identity_conv_drafter_computes_the_plain_drafter_exactly():
    plain, _ = _drafter(seed=11)
    conv, _ = _conv_drafter(plain)
    assert not any("_conv." in n for n, _ in plain.named_parameters())  # the plain drafter is unchanged
    feats, embeds = _inputs(1, [9, 14])
    torch.testing.assert_close(_paged_draft(conv, feats, embeds), _paged_draft(plain, feats, embeds), atol=0, rtol=0)
    for f, e in zip(feats, embeds, strict=True):
        torch.testing.assert_close(_dense(conv, f, e), _dense(plain, f, e), atol=0, rtol=0)


@pytest.mark.parametrize("taps", [2, 3])
def test_paged_inference_equals_dense_training_path_with_conv(taps):
    """The paged path (blocks of B tokens per request) equals the dense one; with a config block of 8 and a
    served block of 4 (speculative_block_size), the paged path takes its block from the batch."""
    plain, _ = _drafter(seed=4)
    conv, _ = _conv_drafter(plain, taps, seed=5)
    wide, _ = _conv_drafter(plain, taps, block=8, seed=5)  # the same weights, config block 8
    feats, embeds = _inputs(2, [9, 14])
    head = torch.randn(97, H, generator=torch.Generator().manual_seed(3))
    paged, paged_wide = _paged_draft(conv, feats, embeds), _paged_draft(wide, feats, embeds)  # [2, B, H]
    torch.testing.assert_close(paged_wide, paged, atol=0, rtol=0)
    assert not torch.allclose(paged, _paged_draft(plain, feats, embeds), atol=1e-2)  # the convolutions act
    for b in range(len(feats)):
        torch.testing.assert_close(paged[b] @ head.T, _dense(conv, feats[b], embeds[b]) @ head.T, atol=1e-4, rtol=1e-4)


def test_dense_conv_stays_inside_each_block():
    """Two blocks in one dense forward (anchors 5 and 9) equal two forwards of one block each."""
    plain, _ = _drafter(seed=3)
    model, _ = _conv_drafter(plain, 3, seed=6)
    g = torch.Generator().manual_seed(2)
    feats, emb = torch.randn(1, 12, 3 * H, generator=g), torch.randn(1, 2 * BLOCK, H, generator=g)
    anchors = torch.tensor([[5, 9]])
    pos = (anchors[:, :, None] + torch.arange(BLOCK)).reshape(1, -1)
    with torch.no_grad():
        both = model.forward_train(feats, torch.arange(12)[None], emb, pos,
                                   block_attention_mask(anchors, torch.ones(1, 2, dtype=torch.bool), 12, BLOCK))
        with pytest.raises(ValueError, match="whole blocks"):
            model.forward_train(feats, torch.arange(12)[None], emb[:, :3], pos[:, :3], torch.ones(1, 3, 15).bool())
    for i, a in enumerate((5, 9)):
        one = _dense(model, feats[0, :a], emb[0, i * BLOCK:(i + 1) * BLOCK])
        torch.testing.assert_close(both[0, i * BLOCK:(i + 1) * BLOCK], one, atol=1e-5, rtol=1e-5)


def test_conv_drafter_export_round_trip(tmp_path):
    plain, _ = _drafter(seed=8)
    model, cfg = _conv_drafter(plain, 2, seed=9)
    for p in model.parameters():  # the checkpoint is bf16: compare against bf16-representable weights
        p.data = p.data.bfloat16().float()
    save_drafter(model, cfg, tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["dflash_config"] == {"mask_token_id": 96, "target_layer_ids": [1, 3, 4], "conv_kernel_size": 2,
                                      "conv_group_size": 16}
    shapes = {n: tuple(t.shape) for n, t in iter_weights(str(tmp_path))}
    for i in range(2):
        assert shapes[f"layers.{i}.attention_conv.base_kernel"] == (2, 2, H)
        assert shapes[f"layers.{i}.mlp_conv.kernel_projection.weight"] == (2 * 2 * (H // 16), H)
        assert {f"layers.{i}.{n}" for n in CONV_NAMES} <= set(shapes)
    loaded_cfg = ModelConfig.load(str(tmp_path), "float32")
    reloaded = get_model_class(loaded_cfg.architecture)(loaded_cfg)
    reloaded.load_weights(iter_weights(str(tmp_path)))
    assert (reloaded.conv_kernel_size, reloaded.conv_group_size) == (2, 16)
    feats, embeds = _inputs(7, [11])
    torch.testing.assert_close(_paged_draft(reloaded, feats, embeds), _paged_draft(model, feats, embeds))


def test_dflash2_candidate_selector_and_bad_group_size_are_refused(tmp_path):
    from ddtree_serve.server.startup import check_drafter

    base = drafter_config(TARGET_HF, 1, BLOCK, [1, 3, 4], 96, conv_kernel_size=2)
    assert conv_settings(drafter_config(TARGET_HF, 1, BLOCK, [1], 96)) == (0, 0)
    selector = {**base, "dflash_config": {**base["dflash_config"], "selector_rank": 32, "selector_top_k": 8}}
    dflash2 = {**base, "architectures": ["DFlash2DraftModel"]}
    for cfg in (selector, dflash2):
        with pytest.raises(ValueError, match="candidate selector is not supported"):
            DFlashDraftModel(ModelConfig("", cfg, "DFlashDraftModel", (), torch.float32))
    (tmp_path / "config.json").write_text(json.dumps({**selector, "architectures": ["DFlash2DraftModel"]}))
    loaded = ModelConfig.load(str(tmp_path), "float32")  # the registry maps DFlash2 onto the refusing class
    with pytest.raises(ValueError, match="selector_rank.*candidate selector is not supported"):
        get_model_class(loaded.architecture)(loaded)
    with pytest.raises(ValueError, match="candidate selector, which is not supported"):
        check_drafter(str(tmp_path), "")
    odd = {**base, "dflash_config": {**base["dflash_config"], "conv_group_size": 24}}  # 64 % 24 != 0
    with pytest.raises(ValueError, match="conv_group_size 24 does not divide"):
        DFlashDraftModel(ModelConfig("", odd, "DFlashDraftModel", (), torch.float32))
    with pytest.raises(ValueError, match="does not divide"):
        drafter_config(TARGET_HF, 1, BLOCK, [1], 96, conv_kernel_size=2, conv_group_size=24)
