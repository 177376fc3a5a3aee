"""MoonViT + projector (ddtree_serve/model_executor/models/moonvit.py, loaded by models/kimi_k25.py) against an independent
reference forward written here from the architecture's definition: the patch convolution as a matmul, the
position table resized bicubically, attention with 2D rotary positions as complex multiplication, an explicit
softmax, explicit LayerNorm / GELU formulas, the 2x2 merge by index arithmetic, the projector. float32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ddtree_serve.model_executor.model_config import ModelConfig
from ddtree_serve.model_executor.model_runner import ModelRunner
from ddtree_serve.model_executor.models.moonvit import MoonViTConfig
from tests.model_executor.moonvit_reference import reference_embed
from tests.model_executor.tiny_deepseek import write_tiny_deepseek
from tests.model_executor.tiny_moonvit import tiny_vision_config


@pytest.fixture(scope="module")
def vision_ckpt(tmp_path_factory):
    tiny = write_tiny_deepseek(tmp_path_factory.mktemp("kimi_vision"), int4=True, kimi=True, vision=True,
                               media_token_id=500)
    runner = ModelRunner(ModelConfig.load(tiny.path, "float32"), max_total_tokens=256, max_reqs=2, max_context=128)
    return tiny, runner


@pytest.mark.parametrize("grid", [(8, 8), (6, 10), (4, 2)])
def test_tower_and_projector_match_the_reference_forward(vision_ckpt, grid):
    """(8, 8) is the position table's own size; the others resize it (bicubic), one of them non-square."""
    tiny, runner = vision_ckpt
    h, w = grid
    g = torch.Generator().manual_seed(h * 100 + w)
    patches = torch.rand(h * w, 3, 14, 14, generator=g) * 2 - 1  # [L, 3, 14, 14], normalised pixel range
    got = runner.model.embed_images([patches], [(1, h, w)])[0]
    vc = tiny_vision_config(tiny.text_config["hidden_size"])
    want = reference_embed(tiny.vision_state, vc, patches, h, w)
    assert got.shape == (h * w // 4, tiny.text_config["hidden_size"])
    torch.testing.assert_close(got, want, atol=5e-5, rtol=1e-4)


def test_images_are_encoded_independently_and_the_model_knows_its_placeholder(vision_ckpt):
    tiny, runner = vision_ckpt
    a = torch.rand(16, 3, 14, 14, generator=torch.Generator().manual_seed(1))
    b = torch.rand(24, 3, 14, 14, generator=torch.Generator().manual_seed(2))
    alone = runner.model.embed_images([a], [(1, 4, 4)])[0]
    both = runner.model.embed_images([b, a], [(1, 4, 6), (1, 4, 4)])
    torch.testing.assert_close(both[1], alone, atol=0, rtol=0)
    assert runner.model.media_placeholder_token_id == 500


def test_config_from_published_keys_and_parameter_count(tmp_path):
    """The published K2.6 vision_config (tests/data) gives the real widths; the count is the tower's ~0.4B."""
    import json
    from pathlib import Path

    full = json.loads((Path(__file__).parents[1] / "data" / "kimi-k2.6-config.json").read_text())
    cfg = MoonViTConfig.from_hf(full["vision_config"], full["text_config"]["hidden_size"])
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.head_dim, cfg.intermediate_size) == \
        (1152, 27, 16, 72, 4304)
    assert (cfg.patch_size, cfg.merge_kernel, cfg.pos_emb_height, cfg.text_hidden_size) == (14, (2, 2), 64, 7168)
    assert 0.40e9 < cfg.num_parameters() < 0.55e9
    tiny = MoonViTConfig.from_hf(tiny_vision_config(64), 64)
    from ddtree_serve.model_executor.models.moonvit import KimiVision

    assert tiny.num_parameters() == sum(p.numel() for p in KimiVision(tiny, torch.float32).parameters())
    with pytest.raises(ValueError, match="merge_type"):
        MoonViTConfig.from_hf(tiny_vision_config(64, merge_type="other"), 64)


def test_attention_is_4d_so_fused_kernels_apply(vision_ckpt, monkeypatch):
    """The tower hands SDPA [1, heads, L, head_dim] (fused kernels take 4-D inputs; 3-D ones ruled them out):
    every call is 4-D, and its result equals the reference (test above)."""
    tiny, runner = vision_ckpt
    seen = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, *a, **kw):
        seen.append(q.dim())
        return real(q, k, v, *a, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    runner.model.embed_images([torch.rand(16, 3, 14, 14)], [(1, 4, 4)])
    assert seen and set(seen) == {4}


def test_encoder_reserve_follows_the_kernel_and_the_checkpoints_patch_limit(tmp_path, vision_ckpt):
    """The reserve counts [heads, L, L] scores only for the math path; the patch bound comes from the
    checkpoint's preprocessor_config.json (in_patch_limit, the side limit, the merge padding), with the
    published 16384 when absent."""
    import json

    from ddtree_serve.model_executor.models.moonvit import encoder_peak_bytes, max_image_patches

    cfg = MoonViTConfig.from_hf(tiny_vision_config(64), 64)
    fused, math_path = encoder_peak_bytes(cfg, 1000, 2), encoder_peak_bytes(cfg, 1000, 2, fused=False)
    assert math_path - fused == 2 * cfg.num_heads * 1000 * 1000 * 2
    assert max_image_patches(str(tmp_path)) == 16384 + 2 * 512 + 1
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(
        {"media_proc_cfg": {"in_patch_limit": 4096, "patch_limit_on_one_side": 256, "merge_kernel_size": 2}}))
    assert max_image_patches(str(tmp_path)) == 4096 + 2 * 256 + 1
    tiny, runner = vision_ckpt
    model = runner.model
    assert model.encoder_peak_bytes("cpu") == encoder_peak_bytes(model.vision.cfg, model.max_image_patches, 4)
