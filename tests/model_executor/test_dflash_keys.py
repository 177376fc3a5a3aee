"""Drafter config keys that change the drafter's math and are not implemented are refused, naming the key
(models/dflash_keys.py): at model construction and in start-up's drafter check, before any weights load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ddtree_serve.model_executor.model_config import ModelConfig
from ddtree_serve.model_executor.models.dflash import DFlashDraftModel
from ddtree_serve.model_executor.models.dflash_keys import unimplemented_keys
from ddtree_serve.server.startup import check_drafter
from ddtree_serve.speculative.train.export import drafter_config
from tests.model_executor.test_dflash_window import TARGET_HF

K25 = json.loads((Path(__file__).parents[1] / "data" / "kimi-k2.5-dflash-config.json").read_text())
BASE = drafter_config(TARGET_HF, 2, 4, [1, 3, 4], mask_token_id=96)


@pytest.mark.parametrize(("extra", "named"), [
    ({"dflash_config": {**BASE["dflash_config"], "output_multiplier": 0.196}}, "output_multiplier=0.196"),
    ({"final_logit_softcapping": 20.0}, "final_logit_softcapping=20.0"),
    ({"dflash_config": {**BASE["dflash_config"], "input_embedding_scale": 2.0}}, "input_embedding_scale=2.0"),
    ({"dflash_config": {**BASE["dflash_config"], "attention_mode": "mla"}}, "attention_mode='mla'"),
    ({"dflash_config": {**BASE["dflash_config"], "attention_modes": ["gqa", "kda"]}}, "attention_modes="),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
])
def test_math_changing_keys_are_refused_by_name(extra, named, tmp_path):
    cfg = {**BASE, **extra}
    assert any(b.startswith(named) for b in unimplemented_keys(cfg)), unimplemented_keys(cfg)
    with pytest.raises(ValueError, match="not implemented"):
        DFlashDraftModel(ModelConfig("", cfg, "DFlashDraftModel", (), torch.float32))
    (tmp_path / "drafter").mkdir()
    (tmp_path / "drafter" / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text(json.dumps(TARGET_HF))
    with pytest.raises(ValueError, match=f"--speculative-draft-model-path.*{named.split('=')[0]}"):
        check_drafter(str(tmp_path / "drafter"), str(tmp_path / "target"))


def test_neutral_values_and_published_configs_pass():
    neutral = {**BASE, "final_logit_softcapping": None, "hidden_act": "silu",
               "dflash_config": {**BASE["dflash_config"], "output_multiplier": 1.0, "input_embedding_scale": 1,
                                 "attention_mode": "gqa"}}
    assert unimplemented_keys(neutral) == [] and unimplemented_keys(BASE) == []
    assert unimplemented_keys(K25) == []  # z-lab/Kimi-K2.5-DFlash's keys
    assert unimplemented_keys({**BASE, "final_logit_softcapping": 0.0}) == []  # z-lab: softcap only when > 0
