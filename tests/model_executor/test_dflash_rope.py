"""The DFlash drafter's rope as its authors' code computes it (docs/DESIGN.md 4.5). z-lab's modeling code
(github z-lab/dflash ``dflash/model.py``) and SpecForge's trainer (sgl-project/SpecForge
``specforge/modeling/draft/dflash.py``) both build transformers' ``Qwen3RotaryEmbedding``, whose YaRN init
(``modeling_rope_utils._compute_yarn_parameters``) is the reference here.

tests/data/kimi-k2.5-dflash-config.json: the keys of z-lab/Kimi-K2.5-DFlash's config.json as reproduced
("Metadata of z-lab/Kimi-K2.5-DFlash") in the unit test of vllm-project/vllm-ascend's
``vllm_ascend/patch/platform/patch_speculative_config.py``; ``intermediate_size`` and ``block_size`` from the
model card (the workspace's shared/FACTS.md). The Hugging Face file itself is not reachable from this machine."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import Qwen3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from ddtree_serve.model_executor.layers.rotary import RotaryEmbedding
from ddtree_serve.model_executor.model_config import rope_parameters
from tests.model_executor.test_dflash_window import inputs, make_drafter, paged_draft

K25 = json.loads((Path(__file__).parents[1] / "data" / "kimi-k2.5-dflash-config.json").read_text())
PLAIN_YARN = 1 + 0.1 * math.log(64)  # 1.4159: SGLang's and vLLM <= 0.29's plain YaRN amplitude


def _ours(cfg: dict) -> RotaryEmbedding:
    return RotaryEmbedding(int(cfg["head_dim"]), rope_parameters(cfg), int(cfg["max_position_embeddings"]))


def _transformers(cfg: dict) -> tuple[torch.Tensor, float]:
    return ROPE_INIT_FUNCTIONS["yarn"](Qwen3Config(**cfg), "cpu")


def test_published_k25_drafter_rope_is_transformers():
    """mscale = mscale_all_dim = 1: the attention factor is their ratio, 1.0 (not plain YaRN's 1.416)."""
    ours = _ours(K25)
    inv, factor = _transformers(K25)
    assert ours.attention_factor == factor == 1.0
    torch.testing.assert_close(ours.inv_freq, inv)


def test_attention_factor_derivations_match_transformers():
    no_mscale = {**K25, "rope_scaling": {k: v for k, v in K25["rope_scaling"].items() if "mscale" not in k}}
    assert _ours(no_mscale).attention_factor == pytest.approx(_transformers(no_mscale)[1]) == pytest.approx(PLAIN_YARN)
    given = {**K25, "rope_scaling": {**K25["rope_scaling"], "attention_factor": 1.25}}  # the config key wins
    assert _ours(given).attention_factor == _transformers(given)[1] == 1.25


def test_flag_overrides_the_factor_and_changes_drafts():
    yarn = {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                             "mscale": 1.0, "mscale_all_dim": 1.0}}
    model, _ = make_drafter(yarn)
    assert model.rotary.attention_factor == 1.0
    feats, embeds = inputs()
    before = paged_draft(model, feats, embeds)
    model.configure(None, PLAIN_YARN)  # --speculative-dflash-rope-attention-factor 1.4159
    assert model.rotary.attention_factor == PLAIN_YARN
    assert (paged_draft(model, feats, embeds) - before).abs().max() > 1e-3
    plain, _ = make_drafter({})
    with pytest.raises(ValueError, match="needs a drafter with YaRN rope"):
        plain.configure(None, 1.5)
