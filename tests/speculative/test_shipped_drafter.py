"""The shipped DFlash drafters of SmolLM2-135M-Instruct (issue 5 regression guard): the default and the one
it replaced (issue 49: the old one stays loadable) load in z-lab format with the default model's shapes, and
their offline DDTree(16) acceptance on fresh greedy responses to the eight general chat prompts held out from
training (``benchmarks.common.CHAT_PROMPTS``, 128 tokens) stays above issue 5's 1.5 (model cards: the
measured values)."""

from __future__ import annotations

import json

import pytest
import torch

from ddtree_serve.model_executor.default_drafter import default_drafter_path, previous_drafter_path
from ddtree_serve.model_executor.model_config import ModelConfig
from ddtree_serve.model_executor.models.dflash import DFlashDraftModel
from ddtree_serve.model_executor.weight_loader import iter_weights


def _load(path: str) -> DFlashDraftModel:
    model = DFlashDraftModel(ModelConfig.load(path, "float32"))
    model.load_weights(iter_weights(path))
    return model.eval()


@pytest.mark.parametrize("where", [default_drafter_path, previous_drafter_path])
def test_shipped_drafter_loads_with_default_model_shapes(where):
    cfg = json.loads((__import__("pathlib").Path(where()) / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["hidden_size"] == 576
    assert cfg["num_target_layers"] == 30 and all(0 <= i < 30 for i in cfg["dflash_config"]["target_layer_ids"])
    model = _load(where())
    assert model.block_size == cfg["block_size"]
    assert default_drafter_path() != previous_drafter_path()


@pytest.mark.slow
@pytest.mark.parametrize("where", [default_drafter_path, previous_drafter_path])
def test_shipped_drafter_offline_tau(default_model_path, where):
    from transformers import AutoTokenizer

    from benchmarks.common import CHAT_PROMPTS, chat_ids
    from ddtree_serve.speculative.train.datagen import generate_batch, make_runner
    from ddtree_serve.speculative.train.evaluate import offline_acceptance
    from ddtree_serve.speculative.train.trainer import target_embed_and_head

    model = _load(where())
    tok = AutoTokenizer.from_pretrained(default_model_path)
    ids = chat_ids(tok, CHAT_PROMPTS)
    runner = make_runner(default_model_path, 8192)
    eos = set(ModelConfig.load(default_model_path).eos_token_ids)
    seqs, feats = generate_batch(runner, ids, [0.0] * len(ids), 128, eos, model.target_layer_ids, torch.Generator())
    recs = [{"tokens": torch.tensor(s), "prompt_len": len(p), "feats": f, "temperature": 0.0}
            for s, p, f in zip(seqs, ids, feats, strict=True)]
    embed, head = target_embed_and_head(default_model_path)
    res = offline_acceptance(model, embed, head, recs, budget=16)
    assert res["tau_ddtree"] > 1.5, res
