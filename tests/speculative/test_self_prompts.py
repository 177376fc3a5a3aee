"""Prompts written by the target itself (Magpie, arXiv 2406.08464) and the train-drafter data stage that
answers them: the real default model writes user turns, the cache resumes, the shards carry their tag."""

from __future__ import annotations

import json

import torch
from transformers import AutoTokenizer

from ddtree_serve.server.cli.main import main
from ddtree_serve.speculative.train.datagen import make_runner
from ddtree_serve.speculative.train.self_prompts import acceptable, self_written_prompts, user_turn_prefix


def test_acceptable_filters_markup_and_length():
    assert acceptable("How do I bake bread at home?")
    assert not acceptable("Hi there")  # too short
    assert not acceptable("What is <|im_start|> for?")
    assert not acceptable("word " * 81)
    assert not acceptable("bad \x07 bell character here")


def test_user_turn_prefix_ends_where_the_user_speaks(default_model_path):
    tok = AutoTokenizer.from_pretrained(default_model_path)
    prefix = user_turn_prefix(tok)
    full = tok.apply_chat_template([{"role": "user", "content": "Hello there"}], tokenize=False)
    assert full.startswith(tok.decode(prefix)) and tok.decode(prefix).endswith("user\n")


def test_data_stage_writes_self_prompted_shards_and_resumes(default_model_path, tmp_path):
    data = tmp_path / "data"
    rc = main(["train-drafter", "--stage", "data", "--model-path", default_model_path, "--data-dir", str(data),
               "--out", str(tmp_path / "out"), "--num-prompts", "0", "--self-prompts", "4", "--num-eval", "2",
               "--max-new-tokens", "6", "--shard-size", "4", "--device", "cpu"])
    assert rc == 0
    cached = [json.loads(line)["prompt"] for line in (data / "self_prompts.jsonl").read_text().splitlines()]
    assert len(cached) == 6 and len({c.lower() for c in cached}) == 6 and all(acceptable(c) for c in cached)
    assert sorted(p.name for p in (data / "feat").glob("*.pt")) == ["eval_self_00000.pt", "train_self_00000.pt"]
    tok = AutoTokenizer.from_pretrained(default_model_path)
    recs = torch.load(data / "feat" / "eval_self_00000.pt") + torch.load(data / "feat" / "train_self_00000.pt")
    assert len(recs) == 6
    for rec, text in zip(recs, cached, strict=True):  # held-out first, then training, in cache order
        want = list(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True)["input_ids"])
        assert rec["tokens"][:rec["prompt_len"]].tolist() == want
        assert 0 < rec["tokens"].numel() - rec["prompt_len"] <= 6
    # the cache answers a rerun without generating; an excluded prompt is never returned
    runner = make_runner(default_model_path, 48 * 160)
    again = self_written_prompts(runner, tok, 6, data / "self_prompts.jsonl", max_rounds=0)
    assert [c[0]["content"] for c in again] == cached
    # same seed as the data stage: its first round redraws the cached turns, which must be skipped
    fresh = self_written_prompts(runner, tok, 3, tmp_path / "fresh.jsonl", exclude=cached, max_rounds=1)
    assert len(fresh) == 3 and {c[0]["content"].lower() for c in fresh}.isdisjoint({c.lower() for c in cached})
