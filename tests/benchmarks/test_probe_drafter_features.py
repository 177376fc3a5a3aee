"""benchmarks/probe_drafter_features.py: the probe reads the features at a - shift beside the anchor and
predicts the token after it, and a short run on a tiny target's data learns a copy rule the features hold."""

from __future__ import annotations

import json
import sys

import torch
from safetensors.torch import load_file

from benchmarks.probe_drafter_features import load_positions, main
from tests.conftest import write_tiny_llama_family


def _record(n: int, prompt_len: int, hidden: int, layers: int) -> dict:
    pos = torch.arange(n, dtype=torch.float32)[:, None]  # [S, 1]
    feats = torch.cat([pos + 100 * k for k in range(layers)], 1).repeat_interleave(hidden, 1)  # [S, layers * H]
    return {"tokens": torch.arange(10, 10 + n, dtype=torch.int32), "prompt_len": prompt_len, "feats": feats}


def test_positions_pair_the_features_before_the_anchor_with_the_next_token(tmp_path) -> None:
    torch.save([_record(7, 3, 2, 2), _record(4, 3, 2, 2)], tmp_path / "train_00000.pt")  # the second: no label
    extra = tmp_path / "extra"
    extra.mkdir()
    torch.save([torch.full((7, 2), -1.0), torch.full((4, 2), -1.0)], extra / "train_00000.pt")
    x, anchor, nxt = load_positions(tmp_path / "train_00000.pt", [1, 2], 2, 1, extra)
    assert anchor.tolist() == [13, 14, 15] and nxt.tolist() == [14, 15, 16]  # anchors 3..5 of the first record
    assert x[:, 0].tolist() == [102.0, 103.0, 104.0] and x[:, 2].tolist() == [-1.0] * 3  # layer 1 at a-1; extra
    x0, _, _ = load_positions(tmp_path / "train_00000.pt", [0], 2, 0, None)
    assert x0[:, 0].tolist() == [3.0, 4.0, 5.0]  # shift 0: the state after the anchor


def test_probe_learns_from_features_that_hold_the_next_token(tmp_path, monkeypatch, capsys) -> None:
    """Features that are the next token's embedding make depth 1 learnable; the embedding alone of a random
    sequence does not: the probe's accuracy tells the two apart."""
    target = write_tiny_llama_family(tmp_path / "target", "llama", vocab=64, num_hidden_layers=2)
    embed = load_file(f"{target}/model.safetensors")["model.embed_tokens.weight"].float()  # [64, H]
    g = torch.Generator().manual_seed(0)
    data = tmp_path / "data"
    (data / "feat").mkdir(parents=True)
    (data / "meta.json").write_text(json.dumps({"target_layer_ids": [0], "feat_dtype": "float32"}))
    for name, n in (("train_00000.pt", 24), ("eval_00000.pt", 6)):
        recs = []
        for _ in range(n):
            tok = torch.randint(0, 64, (20,), generator=g)
            feats = torch.zeros(20, embed.shape[1])
            feats[:-2] = embed[tok[2:]]  # features at a - 1 hold the token at a + 1
            recs.append({"tokens": tok.to(torch.int32), "prompt_len": 2, "feats": feats.bfloat16()})
        torch.save(recs, data / "feat" / name)
    accs = {}
    for layers in ("all", "none"):
        monkeypatch.setattr(sys, "argv", ["probe", "--data-dir", str(data), "--model-path", target, "--layers",
                                          layers, "--steps", "300", "--batch", "64", "--lr", "3e-3"])
        main()
        accs[layers] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["top1_heldout"]
    assert accs["all"] > 0.8 and accs["none"] < 0.3
