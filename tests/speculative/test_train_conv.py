"""Drafter training with DFlash2's grouped dynamic convolution (--conv-kernel-size): a fresh conv drafter is the
plain drafter of its seed with identity convolutions; a tiny run lowers the loss and moves the convolutions off
the identity; --init-drafter from a plain drafter starts at that drafter's loss; seeds with another convolution
are refused; the CLI flags reach TrainConfig."""

from __future__ import annotations

import json

import pytest
import torch

from ddtree_serve.model_executor.model_config import ModelConfig
from ddtree_serve.speculative.train.export import drafter_config, save_drafter
from ddtree_serve.speculative.train.trainer import build_drafter, train
from ddtree_serve.speculative.train.warm_start import check_init_drafter, load_init_drafter
from tests.speculative.test_train import _tiny_cfg, tiny_data  # noqa: F401  (tiny_data: the module's fixture)


def _is_identity(model) -> bool:
    for layer in model.layers:
        for conv in (layer.attention_conv, layer.mlp_conv):
            want = torch.zeros_like(conv.base_kernel)
            want[:, 0] = 1.0
            if not torch.equal(conv.base_kernel, want) or bool(conv.kernel_projection.weight.any()):
                return False
    return True


def test_fresh_conv_drafter_is_the_plain_drafter_with_identity_convs(tiny_data):  # noqa: F811
    target = tiny_data[0]
    hf = ModelConfig.load(target).hf
    plain = build_drafter(drafter_config(hf, 2, 4, [0, 2], 62), torch.device("cpu"), 5)
    conv = build_drafter(drafter_config(hf, 2, 4, [0, 2], 62, conv_kernel_size=2), torch.device("cpu"), 5)
    assert _is_identity(conv) and all(p.requires_grad for p in conv.parameters())
    conv_params = dict(conv.named_parameters())
    for name, p in plain.named_parameters():
        assert torch.equal(conv_params.pop(name), p), name
    assert len(conv_params) == 2 * 4 and all("_conv." in n for n in conv_params)


def test_conv_training_lowers_loss_and_opens_the_convs(tiny_data, tmp_path):  # noqa: F811
    target, data, *_ = tiny_data
    torch.manual_seed(0)
    res = train(_tiny_cfg(data, target, tmp_path / "conv", steps=30, save_every=15, conv_kernel_size=2,
                          conv_group_size=16))
    assert res["steps"] == 30 and res["loss_ema"] < 0.8 * res["loss_first"], res
    out = tmp_path / "conv"
    dcfg = json.loads((out / "config.json").read_text())
    assert dcfg["dflash_config"]["conv_kernel_size"] == 2 and dcfg["dflash_config"]["conv_group_size"] == 16
    model = build_drafter(dcfg, torch.device("cpu"), 1)
    load_init_drafter(model, dcfg, str(out))  # the export carries the conv tensors (every weight is required)
    assert not _is_identity(model)
    for layer in model.layers:
        assert float(layer.attention_conv.base_kernel.detach()[:, 1].abs().sum()) > 0
        assert float(layer.mlp_conv.kernel_projection.weight.detach().abs().sum()) > 0
    # resuming under another convolution is refused (the trainer state holds these parameters)
    with pytest.raises(ValueError, match="being resumed.*conv_kernel_size"):
        train(_tiny_cfg(data, target, out, steps=30))


def test_init_drafter_from_a_plain_drafter_starts_at_its_loss(tiny_data, tmp_path):  # noqa: F811
    target, data, *_ = tiny_data
    torch.manual_seed(0)
    train(_tiny_cfg(data, target, tmp_path / "plain", steps=10))
    src = str((tmp_path / "plain").resolve())
    plain = train(_tiny_cfg(data, target, tmp_path / "p2", steps=1, lr=1e-9, warmup=1, init_drafter=src))
    conv = train(_tiny_cfg(data, target, tmp_path / "c2", steps=1, lr=1e-9, warmup=1, init_drafter=src,
                           conv_kernel_size=2))
    assert conv["loss_first"] == pytest.approx(plain["loss_first"], rel=1e-6, abs=1e-6), (conv, plain)
    # its convolutions start at the identity; the rest is the seed's
    dcfg = json.loads((tmp_path / "c2" / "config.json").read_text())
    model = build_drafter(dcfg, torch.device("cpu"), 3)
    load_init_drafter(model, dcfg, src)
    assert _is_identity(model)


def test_init_drafter_refuses_another_convolution(tiny_data, tmp_path):  # noqa: F811
    target, data, *_ = tiny_data
    hf = ModelConfig.load(target).hf
    plain, k2 = drafter_config(hf, 1, 4, [0, 2], 62), drafter_config(hf, 1, 4, [0, 2], 62, conv_kernel_size=2)
    k3 = drafter_config(hf, 1, 4, [0, 2], 62, conv_kernel_size=3)
    g8 = drafter_config(hf, 1, 4, [0, 2], 62, conv_kernel_size=2, conv_group_size=8)
    check_init_drafter(plain, k2, "seed", grow=True)  # a plain seed: the convolutions are added at the identity
    check_init_drafter(k2, k2, "seed", grow=True)
    for seed_cfg, want, field in ((k3, k2, "conv_kernel_size"), (g8, k2, "conv_group_size"),
                                  (k2, plain, "conv_kernel_size"), (plain, k2, "conv_kernel_size")):
        grow = seed_cfg is not plain  # a plain seed is refused only where nothing may be added (a resume)
        with pytest.raises(ValueError, match=f"{field}: drafter"):
            check_init_drafter(seed_cfg, want, "seed", grow=grow)
    src = save_drafter(build_drafter(k3, torch.device("cpu"), 0), k3, tmp_path / "k3")
    with pytest.raises(ValueError, match="--init-drafter .*conv_kernel_size: drafter 3, requested 2"):
        train(_tiny_cfg(data, target, tmp_path / "out", init_drafter=str(src), conv_kernel_size=2))


def test_cli_train_flags_reach_train_config(monkeypatch):
    import ddtree_serve.server.startup as startup
    import ddtree_serve.speculative.train.trainer as trainer
    from ddtree_serve.server.cli.main import build_parser
    from ddtree_serve.server.cli.train import run

    parser, _ = build_parser()
    base = ["train-drafter", "--out", "o", "--data-dir", "d", "--stage", "train", "--device", "cpu"]
    assert parser.parse_args(base).conv_kernel_size == 0 and parser.parse_args(base).conv_group_size == 16
    seen = []
    monkeypatch.setattr(trainer, "train", lambda cfg: seen.append(cfg) or {})
    monkeypatch.setattr(startup, "resolve_model_path", lambda p: p)
    run(parser.parse_args(base + ["--conv-kernel-size", "2", "--conv-group-size", "8"]))
    assert (seen[0].conv_kernel_size, seen[0].conv_group_size) == (2, 8)
    assert seen[0].hard_labels == "token"  # the default; --hard-labels reaches the config too
    run(parser.parse_args(base + ["--hard-labels", "greedy"]))
    assert seen[1].hard_labels == "greedy"
    assert seen[0].num_kv_heads == 0  # the target's; --num-kv-heads reaches the config
    run(parser.parse_args(base + ["--num-kv-heads", "9"]))
    assert seen[2].num_kv_heads == 9
