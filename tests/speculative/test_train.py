"""Drafter training (DFlash, arXiv 2602.06036): block mask by brute force, batch labels/weights, data
generation with feature capture (== transformers' hidden_states[l + 1]), training on a tiny random target
lowers the loss, checkpoints reload, warm start from an exported drafter (--init-drafter) and its refusals."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from ddtree_serve.model_executor.model_config import ModelConfig
from ddtree_serve.model_executor.models.dflash import DFlashDraftModel
from ddtree_serve.model_executor.weight_loader import iter_weights
from ddtree_serve.speculative.train.datagen import capture_features, generate_batch, make_runner, write_meta
from ddtree_serve.speculative.train.objective import block_attention_mask, make_block_batch
from ddtree_serve.speculative.train.trainer import (
    TrainConfig,
    auto_batch_size,
    build_drafter,
    target_embed_and_head,
    train,
)
from tests.conftest import write_tiny_llama_family


def test_block_mask_brute_force():
    g = torch.Generator().manual_seed(0)
    b, n, s, bs = 3, 4, 11, 3
    anchors = torch.randint(1, s - 1, (b, n), generator=g)
    valid = torch.rand(b, n, generator=g) > 0.3
    mask = block_attention_mask(anchors, valid, s, bs)
    assert mask.shape == (b, n * bs, s + n * bs)
    for bi in range(b):
        for qi in range(n * bs):
            blk = qi // bs
            for kj in range(s + n * bs):
                if kj < s:  # context: strictly before this block's anchor, only for a real block
                    want = bool(valid[bi, blk]) and kj < int(anchors[bi, blk])
                else:  # draft keys: the own block only (bidirectional)
                    want = (kj - s) // bs == blk
                assert bool(mask[bi, qi, kj]) == want, (bi, qi, kj)


def test_block_batch_labels_and_weights():
    tokens = torch.arange(100, 112, dtype=torch.int32)  # S = 12, prompt 5
    rec = {"tokens": tokens, "prompt_len": 5, "feats": torch.zeros(12, 6)}
    batch = make_block_batch([rec], n_anchors=3, block_size=4, mask_token_id=7, gamma=2.0,
                             gen=torch.Generator().manual_seed(0))
    ids, pos = batch.block_ids[0].view(3, 4), batch.block_positions[0].view(3, 4)
    anchors = pos[:, 0]
    assert bool((anchors >= 5).all()) and bool((anchors <= 10).all()) and anchors.unique().numel() == 3
    assert ids[:, 0].tolist() == [100 + int(a) for a in anchors] and bool((ids[:, 1:] == 7).all())
    lab, w = batch.labels[0].view(3, 4), batch.weights[0].view(3, 4)
    for blk, a in enumerate(anchors.tolist()):
        for k in range(4):
            if k == 0 or a + k >= 12:
                assert w[blk, k] == 0
            else:
                assert lab[blk, k] == 100 + a + k
                assert math.isclose(float(w[blk, k]), math.exp(-(k - 1) / 2.0), rel_tol=1e-6)


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    """A tiny random Llama target, its greedy/sampled responses with captured features."""
    root = tmp_path_factory.mktemp("dflash-train")
    target = write_tiny_llama_family(root / "target", "llama", vocab=64, num_hidden_layers=4, eos_token_id=63)
    runner = make_runner(target, 4096)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 60, (int(n),), generator=g).tolist() for n in torch.randint(4, 9, (14,), generator=g)]
    layers = (0, 2)
    data = root / "data"
    write_meta(str(data), target, layers, "bfloat16")
    (data / "feat").mkdir()
    seqs, feats = generate_batch(runner, prompts, [0.0] * 10 + [1.0] * 4, 24, {63}, layers, g)
    recs = [{"tokens": torch.tensor(s, dtype=torch.int32), "prompt_len": len(p), "temperature": t,
             "feats": f.bfloat16()} for s, p, t, f in zip(seqs, prompts, [0.0] * 10 + [1.0] * 4, feats, strict=True)]
    torch.save(recs[3:], data / "feat" / "train_00000.pt")
    torch.save(recs[:3], data / "feat" / "eval_00000.pt")  # greedy: offline acceptance needs them
    return target, data, runner, seqs, feats, layers


def test_generation_features_equal_plain_prefill(tiny_data):
    _, _, runner, seqs, feats, layers = tiny_data
    ref = capture_features(runner, [s[:-1] for s in seqs[:3]], layers)
    for f, r in zip(feats[:3], ref, strict=True):
        torch.testing.assert_close(f[:-1], r, atol=1e-4, rtol=1e-4)


def test_training_lowers_loss_and_checkpoint_reloads(tiny_data, tmp_path):
    target, data, *_ = tiny_data
    cfg = TrainConfig(data_dir=str(data), out_dir=str(tmp_path / "drafter"), target_path=target, num_layers=1,
                      block_size=4, mask_token_id=62, steps=30, batch_size=4, anchors_per_seq=6, lr=3e-3, warmup=5,
                      gamma=4.0, save_every=15, eval_budget=4, device="cpu",
                      out_norm_scale=1.0)  # tiny random embeddings (row norm ~0.6) need the full logit range
    torch.manual_seed(0)
    res = train(cfg)
    assert res["steps"] == 30 and res["loss_ema"] < 0.8 * res["loss_first"], res
    assert 0.0 < res["tau_chain"] <= 3.0 and 0.0 < res["tau_ddtree"] <= 3.0
    out = tmp_path / "drafter"
    assert json.loads((out / "config.json").read_text())["dflash_config"]["target_layer_ids"] == [0, 2]
    # the exported bf16 checkpoint == the trained float32 weights rounded to bf16, and a rerun resumes (no steps)
    mcfg = ModelConfig.load(str(out), "float32")
    loaded = DFlashDraftModel(mcfg)
    loaded.load_weights(iter_weights(str(out)))
    st = torch.load(out / "trainer_state.pt", weights_only=False)
    ref = build_drafter(json.loads((out / "config.json").read_text()), torch.device("cpu"), 0)
    ref.load_state_dict({k: v.bfloat16().float() for k, v in st["model"].items()})
    embed, head = target_embed_and_head(target)
    rec = torch.load(data / "feat" / "eval_00000.pt")[0]
    from ddtree_serve.speculative.train.evaluate import draft_hidden_all_anchors

    torch.testing.assert_close(draft_hidden_all_anchors(loaded, embed, rec) @ head.T,
                               draft_hidden_all_anchors(ref, embed, rec) @ head.T)
    again = train(cfg)
    assert again["steps"] == 30
    # extending a finished run with a time budget: the schedule is shortened on the resumed run's own steps
    longer = train(dataclasses.replace(cfg, steps=10_000, time_budget_s=0.5, batch_size=0))  # 0: by free memory
    assert 30 < longer["steps"] <= 1000, longer["steps"]  # bounds loose: the step time is measured on a busy CPU


def test_auto_batch_size_scales_with_memory():
    kw = dict(seq_len=300, anchors=48, block=8, hidden=576, n_feats=5, heads=9, num_layers=1, vocab=49152)
    small, big = auto_batch_size(2 * 2**30, **kw), auto_batch_size(80 * 2**30, **kw)
    assert 1 <= small < big <= 64
    assert auto_batch_size(1, **kw) == 1 and auto_batch_size(2**50, **kw) == 64


def test_cli_registers_train_drafter():
    from ddtree_serve.server.cli.main import build_parser

    parser, commands = build_parser()
    assert "train-drafter" in commands
    args = parser.parse_args(["train-drafter", "--out", "o", "--data-dir", "d", "--block-size", "16",
                              "--target-layer-ids", "1,5,9", "--init-drafter", "default"])
    assert args.block_size == 16 and args.target_layer_ids == "1,5,9" and args.loss_vocab == "full"
    assert args.init_drafter == "default"
    from ddtree_serve.server.cli.train import _layer_ids

    args.target_layer_ids = None  # data for a warm start: captured at the starting drafter's layers
    assert _layer_ids(args, "no-target-read") == [1, 8, 14, 20, 27]


def test_captured_features_are_hf_hidden_states_of_layer_plus_one(tiny_data):
    """Target layer id l means the output of decoder layer l: transformers' ``hidden_states[l + 1]`` (z-lab's
    ``extract_context_feature`` offset; an off-by-one here costs ~1 token of acceptance, FACTS.md)."""
    from transformers import AutoModelForCausalLM

    target, _, _, seqs, feats, layers = tiny_data
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    for s, f in zip(seqs[:3], feats[:3], strict=True):
        with torch.no_grad():
            hs = hf(torch.tensor([s[:-1]]), output_hidden_states=True).hidden_states  # [N + 1] x [1, S-1, H]
        want = torch.cat([hs[layer + 1][0] for layer in layers], dim=-1)  # [S-1, n*H]
        torch.testing.assert_close(f[:-1], want, atol=1e-4, rtol=1e-4)
        assert not torch.allclose(f[:-1], torch.cat([hs[layer][0] for layer in layers], -1), atol=1e-2)


def _tiny_cfg(data, target, out, **kw) -> TrainConfig:
    base = dict(data_dir=str(data), out_dir=str(out), target_path=target, num_layers=1, block_size=4,
                mask_token_id=62, steps=20, batch_size=4, anchors_per_seq=6, lr=3e-3, warmup=5, gamma=4.0,
                save_every=10, eval_budget=4, device="cpu", out_norm_scale=1.0)
    return TrainConfig(**{**base, **kw})


def test_init_drafter_warm_starts_a_fresh_run(tiny_data, tmp_path):
    from ddtree_serve.speculative.train.export import zlab_state_dict
    from ddtree_serve.speculative.train.warm_start import load_init_drafter

    target, data, *_ = tiny_data
    torch.manual_seed(0)
    first = train(_tiny_cfg(data, target, tmp_path / "a"))
    src = str((tmp_path / "a").resolve())
    # the loaded weights are exactly the exported (bf16) ones
    dcfg = json.loads((tmp_path / "a" / "config.json").read_text())
    model = build_drafter(dcfg, torch.device("cpu"), seed=1)
    load_init_drafter(model, dcfg, src)
    exported = dict(iter_weights(src))
    for name, t in zlab_state_dict(model).items():
        torch.testing.assert_close(t, exported[name].float(), atol=0, rtol=0)
    # a fresh run from those weights: new schedule (its own step count), starting near the first run's end loss
    warm = train(_tiny_cfg(data, target, tmp_path / "b", steps=2, lr=1e-6, warmup=1, init_drafter=src))
    assert warm["steps"] == 2 and warm["loss_first"] < 0.85 * first["loss_first"], (warm, first)
    assert torch.load(tmp_path / "b" / "trainer_state.pt", weights_only=False)["init_drafter"] == src
    # rerunning the same command resumes (the flag is ignored); --init-drafter on another run's state is refused
    again = train(_tiny_cfg(data, target, tmp_path / "b", steps=2, lr=1e-6, warmup=1, init_drafter=src))
    assert again["steps"] == 2
    with pytest.raises(ValueError, match="resuming wins"):
        train(_tiny_cfg(data, target, tmp_path / "a", init_drafter=src))
    # a resumed run refuses flags that would make it another drafter
    with pytest.raises(ValueError, match="being resumed.*block_size"):
        train(_tiny_cfg(data, target, tmp_path / "a", block_size=8))


@pytest.mark.parametrize("src_layers,change,field", [(1, {"block_size": 8}, "block_size"),
                                                     (2, {"num_layers": 1}, "num_layers"),
                                                     (1, {"mask_token_id": 61}, "mask_token_id")])
def test_init_drafter_refuses_a_mismatched_drafter(tiny_data, tmp_path, src_layers, change, field):
    from ddtree_serve.model_executor.default_drafter import default_drafter_path
    from ddtree_serve.speculative.train.export import drafter_config, save_drafter

    target, data, *_ = tiny_data
    dcfg = drafter_config(ModelConfig.load(target).hf, src_layers, 4, [0, 2], 62)
    src = save_drafter(build_drafter(dcfg, torch.device("cpu"), 0), dcfg, tmp_path / "src")
    with pytest.raises(ValueError, match=f"--init-drafter .*{field}: drafter"):
        train(_tiny_cfg(data, target, tmp_path / "out", init_drafter=str(src), **change))
    assert not (tmp_path / "out" / "trainer_state.pt").exists()
    with pytest.raises(ValueError, match="hidden_size: drafter 576, requested 64"):  # the shipped one: SmolLM2 shapes
        train(_tiny_cfg(data, target, tmp_path / "out", init_drafter="default"))
    assert default_drafter_path().endswith("smollm2-135m-dflash-v2")


def test_init_drafter_grows_a_drafter_in_depth(tiny_data, tmp_path):
    """A 1-layer drafter seeds a 2-layer one: the added layer starts with zero output projections, so the grown
    drafter computes exactly the seed's outputs; training then opens the new layer."""
    from ddtree_serve.speculative.train.export import drafter_config, save_drafter
    from ddtree_serve.speculative.train.objective import block_attention_mask
    from ddtree_serve.speculative.train.warm_start import load_init_drafter

    target, data, *_ = tiny_data
    hf = ModelConfig.load(target).hf
    one, two = drafter_config(hf, 1, 4, [0, 2], 62), drafter_config(hf, 2, 4, [0, 2], 62)
    seed = build_drafter(one, torch.device("cpu"), 0)
    with torch.no_grad():  # a seed whose final norm is not the default ones, as a trained drafter's is not
        seed.norm.weight.mul_(0.5)
    src = save_drafter(seed, one, tmp_path / "src")
    seed = build_drafter(one, torch.device("cpu"), 1)
    load_init_drafter(seed, one, str(src))  # the bf16 export, as the grown drafter sees it
    grown = build_drafter(two, torch.device("cpu"), 2)
    assert load_init_drafter(grown, two, str(src)) == 1
    g = torch.Generator().manual_seed(0)
    b, s, q, h = 2, 5, 4, hf["hidden_size"]
    feats = torch.randn(b, s, 2 * h, generator=g)
    ctx_pos = torch.arange(s).expand(b, s)
    embeds = torch.randn(b, q, h, generator=g)
    blk_pos = torch.tensor([[3, 4, 5, 6], [2, 3, 4, 5]])
    mask = block_attention_mask(torch.tensor([[3], [2]]), torch.ones(b, 1, dtype=torch.bool), s, q)
    with torch.no_grad():
        want = seed.forward_train(feats, ctx_pos, embeds, blk_pos, mask)
        got = grown.forward_train(feats, ctx_pos, embeds, blk_pos, mask)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert float(grown.layers[1].self_attn.qkv_proj.weight.detach().abs().sum()) > 0  # only the outputs start at zero
    # training through the trainer opens the new layer's output projections
    train(_tiny_cfg(data, target, tmp_path / "out", num_layers=2, steps=3, warmup=1, init_drafter=str(src)))
    trained = build_drafter(two, torch.device("cpu"), 3)
    load_init_drafter(trained, two, str(tmp_path / "out"))
    assert float(trained.layers[1].self_attn.o_proj.weight.detach().abs().sum()) > 0
    assert float(trained.layers[1].down_proj.weight.detach().abs().sum()) > 0


def test_init_drafter_widens_the_kv_heads(tiny_data, tmp_path):
    """A drafter with the target's 2 KV heads seeds one with 4 (--num-kv-heads): each new KV head repeats the seed
    head its query heads read, so the widened drafter computes exactly the seed's outputs; a seed with more KV
    heads than asked, or a count that does not divide the query heads, is refused."""
    from ddtree_serve.speculative.train.export import drafter_config, save_drafter
    from ddtree_serve.speculative.train.objective import block_attention_mask
    from ddtree_serve.speculative.train.warm_start import load_init_drafter

    target, *_ = tiny_data
    hf = ModelConfig.load(target).hf
    narrow, wide = drafter_config(hf, 1, 4, [0, 2], 62), drafter_config(hf, 1, 4, [0, 2], 62, num_kv_heads=4)
    assert (narrow["num_key_value_heads"], wide["num_key_value_heads"]) == (2, 4)
    src = save_drafter(build_drafter(narrow, torch.device("cpu"), 0), narrow, tmp_path / "src")
    seed, widened = build_drafter(narrow, torch.device("cpu"), 1), build_drafter(wide, torch.device("cpu"), 2)
    load_init_drafter(seed, narrow, str(src))
    assert load_init_drafter(widened, wide, str(src)) == 0
    g = torch.Generator().manual_seed(0)
    b, s, q, h = 2, 5, 4, hf["hidden_size"]
    feats, embeds = torch.randn(b, s, 2 * h, generator=g), torch.randn(b, q, h, generator=g)
    ctx_pos, blk_pos = torch.arange(s).expand(b, s), torch.tensor([[3, 4, 5, 6], [2, 3, 4, 5]])
    mask = block_attention_mask(torch.tensor([[3], [2]]), torch.ones(b, 1, dtype=torch.bool), s, q)
    with torch.no_grad():
        want = seed.forward_train(feats, ctx_pos, embeds, blk_pos, mask)
        got = widened.forward_train(feats, ctx_pos, embeds, blk_pos, mask)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    wide_src = save_drafter(widened, wide, tmp_path / "wide")
    with pytest.raises(ValueError, match="num_key_value_heads: drafter 4, requested 2"):
        load_init_drafter(build_drafter(narrow, torch.device("cpu"), 3), narrow, str(wide_src))
    with pytest.raises(ValueError, match="--num-kv-heads 3 does not divide the 4 attention heads"):
        drafter_config(hf, 1, 4, [0, 2], 62, num_kv_heads=3)


def test_shipped_drafter_can_seed_training_for_the_default_target(tmp_path):
    """The shipped drafter matches what train-drafter asks for on SmolLM2-135M with its recorded flags, loads
    into a trainable drafter, and is refused for target layer ids other than its own."""
    from importlib.resources import files

    from ddtree_serve.speculative.train.export import drafter_config, zlab_state_dict
    from ddtree_serve.speculative.train.warm_start import (
        check_init_drafter,
        init_drafter_config,
        load_init_drafter,
        resolve_init_drafter,
    )

    smollm2 = json.loads(files("ddtree_serve.model_executor").joinpath("default_model_config/config.json").read_text())
    path = resolve_init_drafter("default")
    want = drafter_config(smollm2, 1, 8, [1, 8, 14, 20, 27], 0)
    model = build_drafter(want, torch.device("cpu"), 0)
    load_init_drafter(model, want, path)
    shipped = dict(iter_weights(path))
    for name, t in zlab_state_dict(model).items():  # every tensor is the shipped one, and trainable
        assert t.requires_grad and torch.equal(t.detach(), shipped[name].float()), name
    with pytest.raises(ValueError, match=r"target_layer_ids: drafter \[1, 8, 14, 20, 27\], requested \[2, 9"):
        check_init_drafter(init_drafter_config(path), drafter_config(smollm2, 1, 8, [2, 9, 15, 21, 27], 0), path)


def test_init_drafter_keeps_the_seeds_layer_kinds(tiny_data, tmp_path):
    """A windowed seed (models/dflash_window.py) trains and exports as the windowed drafter it is; growing it
    in depth is refused."""
    target, data, *_ = tiny_data
    train(_tiny_cfg(data, target, tmp_path / "a", steps=2, warmup=1))
    cfg_path = tmp_path / "a" / "config.json"
    kinds = {"layer_types": ["sliding_attention"], "use_sliding_window": True, "sliding_window": 3, "is_causal": False}
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), **kinds}))
    train(_tiny_cfg(data, target, tmp_path / "b", steps=2, warmup=1, init_drafter=str(tmp_path / "a")))
    out = json.loads((tmp_path / "b" / "config.json").read_text())
    assert {k: out[k] for k in kinds} == kinds
    with pytest.raises(ValueError, match="growing it to 2 layers"):
        train(_tiny_cfg(data, target, tmp_path / "c", num_layers=2, init_drafter=str(tmp_path / "a")))
