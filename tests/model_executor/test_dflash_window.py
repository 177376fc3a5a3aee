"""DFlash drafter layers as the checkpoint declares them (models/dflash_window.py, docs/DESIGN.md 4.5): the paged
path and the dense training path equal a reference forward written from z-lab's published semantics
(github z-lab/dflash ``dflash/model.py``: keys ``[context ; block]`` in key-index order, queries aligned to the
end, ``_attention_mask``'s causal and sliding-window terms) for every layer kind, contexts longer than the
window, the ``--speculative-dflash-draft-window-size`` cap, and TP 2 (gloo); the config keys resolve as
transformers' Qwen3Config and z-lab's layer do, and unusable ones are refused naming the key."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

from ddtree_serve.kernels.attention import TorchAttentionBackend
from ddtree_serve.model_executor.forward_batch import ForwardMode, build_forward_batch
from ddtree_serve.model_executor.kv_cache import KVCache, TokenSlotAllocator
from ddtree_serve.model_executor.model_config import ModelConfig
from ddtree_serve.model_executor.models.dflash import DFlashDraftModel
from ddtree_serve.model_executor.models.dflash_window import DraftAttention, layer_attention
from ddtree_serve.speculative.train.export import drafter_config

TARGET_HF = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
             "num_hidden_layers": 6, "vocab_size": 97, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
             "max_position_embeddings": 512, "tie_word_embeddings": True}
BLOCK, WINDOW = 4, 5
LENS = (3, 9, 14)  # shorter than the window, and longer
SLIDE_FULL = {"layer_types": ["sliding_attention", "full_attention"], "use_sliding_window": True,
              "sliding_window": WINDOW}
KINDS = {  # name -> config keys (2 layers)
    "k26_style": {**SLIDE_FULL, "is_causal": False},  # the K2.6 / DFlash2 configs: sliding + full, bidirectional
    "zlab_default_causality": SLIDE_FULL,  # no is_causal: sliding layers causal, full layers not
    "derived_types_causal": {"layer_types": None, "use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1,
                             "is_causal": True},  # no layer_types: layer 1 slides (transformers' rule)
    "full_causal": {"is_causal": True},
}


def make_drafter(overrides: dict, seed: int = 0, dtype: torch.dtype = torch.float32) -> tuple[DFlashDraftModel, dict]:
    cfg = {**drafter_config(TARGET_HF, 2, BLOCK, [1, 3, 4], mask_token_id=96), **overrides}
    model = DFlashDraftModel(ModelConfig("", cfg, "DFlashDraftModel", (), dtype))
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        p.data.copy_((1.0 if "norm" in name else 0.0) + (0.3 if "norm" in name else 0.1) * torch.randn(p.shape,
                                                                                                    generator=g))
    return model, cfg


def inputs(seed: int = 1) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return ([torch.randn(n, 3 * 64, generator=g) * 3 for n in LENS], [torch.randn(BLOCK, 64, generator=g)
                                                                      for _ in LENS])


def paged_draft(model: DFlashDraftModel, feats: list[torch.Tensor], embeds: list[torch.Tensor],
                device: str = "cpu", backend=None) -> torch.Tensor:  # noqa: ANN001
    """Write each request's context, then draft all blocks in one TARGET_VERIFY batch -> [bs, B, H] (on
    ``device``, through ``backend``: the torch reference by default; the model must be on ``device``)."""
    kv = KVCache(model.kv_cache_layout(), 256, model.dtype, device)
    alloc = TokenSlotAllocator(256)
    table = torch.zeros(len(feats), 64, dtype=torch.int64)
    for b, f in enumerate(feats):
        slots = alloc.alloc(f.shape[0])
        table[b, : f.shape[0]] = slots
        model.write_context(f.to(device), torch.arange(f.shape[0], device=device), slots.to(device), kv)
    prefix = torch.tensor([f.shape[0] for f in feats])
    blk = alloc.alloc(BLOCK * len(feats))
    for b, p in enumerate(prefix.tolist()):
        table[b, p:p + BLOCK] = blk[b * BLOCK:(b + 1) * BLOCK]
    pos = torch.cat([torch.arange(p, p + BLOCK) for p in prefix.tolist()])
    with torch.inference_mode():
        fb = build_forward_batch(ForwardMode.TARGET_VERIFY, torch.zeros(len(pos), dtype=torch.int64, device=device),
                                 pos.to(device), blk.to(device), table.to(device),
                                 torch.arange(len(feats), device=device), prefix.to(device),
                                 torch.full((len(feats),), BLOCK, device=device),
                                 tree_mask=torch.ones(len(feats), BLOCK, BLOCK, dtype=torch.bool),
                                 input_embeds=torch.cat(embeds).to(device, model.dtype))
        out = model(fb, kv, backend or TorchAttentionBackend())
    return out.view(len(feats), BLOCK, -1)


@torch.no_grad()
def reference(model: DFlashDraftModel, feats: torch.Tensor, embeds: torch.Tensor, kinds: list[DraftAttention],
              cap: int | None = None) -> torch.Tensor:
    """One request written the way z-lab's layer computes it: feats [S, F], embeds [B, H] -> [B, H]. Keys are
    [context ; block] at positions 0..S+B-1 (key index = position); query i sits at index S + i."""
    s, b = feats.shape[0], embeds.shape[0]
    ctx = model.hidden_norm(feats @ model.fc.weight.T)  # [S, H]
    cos, sin = model.rotary.cos_sin(torch.arange(s + b))
    h = embeds
    for layer, kind in zip(model.layers, kinds, strict=True):
        a = layer.self_attn
        wq, wk, wv = a.qkv_proj.weight.split([a.qkv_proj.q_size, a.qkv_proj.kv_size, a.qkv_proj.kv_size])
        x = layer.input_layernorm(h)
        both = torch.cat([ctx, x])  # [S+B, H]
        q = a.q_norm((x @ wq.T).view(b, a.n_heads, -1))  # [B, Hq, d]
        k = a.k_norm((both @ wk.T).view(s + b, a.n_kv, -1))  # [S+B, Hkv, d]
        v = (both @ wv.T).view(s + b, a.n_kv, -1)
        q, k = model.rotary.apply(q, cos[s:], sin[s:]), model.rotary.apply(k, cos, sin)
        qi, kj = s + torch.arange(b)[:, None], torch.arange(s + b)[None, :]  # z-lab's query/key positions
        vis = torch.ones(b, s + b, dtype=torch.bool)
        if kind.causal:
            vis &= kj <= qi
        if kind.window is not None:
            vis &= qi - kj < kind.window
            if not kind.causal:
                vis &= kj - qi < kind.window
        if cap is not None:
            vis &= kj >= s - cap
        rep = a.n_heads // a.n_kv
        scores = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(rep, 1)) * a.scale  # [Hq, B, S+B]
        p = scores.masked_fill(~vis, float("-inf")).softmax(-1)
        o = torch.einsum("hqk,khd->qhd", p, v.repeat_interleave(rep, 1)).reshape(b, -1)  # [B, Hq*d]
        h = h + o @ a.o_proj.weight.T
        h = h + layer.down_proj(F.silu(layer.post_attention_layernorm(h) @ layer.gate_up_proj.weight.chunk(2)[0].T)
                                * (layer.post_attention_layernorm(h) @ layer.gate_up_proj.weight.chunk(2)[1].T))
    return model.norm(h)


@pytest.mark.parametrize("name", list(KINDS))
def test_paged_and_dense_equal_the_published_semantics(name: str):
    model, _ = make_drafter(KINDS[name])
    feats, embeds = inputs()
    paged = paged_draft(model, feats, embeds)  # [3, B, H]
    for r, n in enumerate(LENS):
        ref = reference(model, feats[r], embeds[r], list(model.attention_kinds))
        torch.testing.assert_close(paged[r], ref, atol=1e-4, rtol=1e-4)
        with torch.no_grad():
            dense = model.forward_train(feats[r][None], torch.arange(n)[None], embeds[r][None],
                                        torch.arange(n, n + BLOCK)[None], torch.ones(1, BLOCK, n + BLOCK,
                                                                                     dtype=torch.bool))[0]
        torch.testing.assert_close(dense, ref, atol=1e-4, rtol=1e-4)


def test_windows_change_the_draft_only_beyond_the_window():
    """A sliding drafter equals the same weights run full-context while context and block fit the window (3 + 4
    tokens in a window of 7: the mask hides nothing), and differs once the context is longer."""
    windowed, _ = make_drafter({**KINDS["k26_style"], "sliding_window": 7})
    full, _ = make_drafter({"is_causal": False})
    feats, embeds = inputs()
    a, b = paged_draft(windowed, feats, embeds), paged_draft(full, feats, embeds)
    torch.testing.assert_close(a[0], b[0])
    assert (a[2] - b[2]).abs().max() > 1e-3


@pytest.mark.parametrize("name", ["k26_style", "full_causal"])
def test_draft_window_cap(name: str):
    model, _ = make_drafter(KINDS[name])
    model.draft_window = 2
    feats, embeds = inputs()
    paged = paged_draft(model, feats, embeds)
    for r, n in enumerate(LENS):
        ref = reference(model, feats[r], embeds[r], list(model.attention_kinds), cap=2)
        torch.testing.assert_close(paged[r], ref, atol=1e-4, rtol=1e-4)
        with torch.no_grad():  # the dense path (offline evaluation) applies the same cap
            dense = model.forward_train(feats[r][None], torch.arange(n)[None], embeds[r][None],
                                        torch.arange(n, n + BLOCK)[None], torch.ones(1, BLOCK, n + BLOCK,
                                                                                     dtype=torch.bool))[0]
        torch.testing.assert_close(dense, ref, atol=1e-4, rtol=1e-4)


def test_config_resolution_and_refusals():
    base = drafter_config(TARGET_HF, 2, BLOCK, [1, 3, 4], mask_token_id=96)
    assert layer_attention(base, "d") == (DraftAttention(), DraftAttention())  # a plain DFlash config: unchanged
    assert layer_attention({**base, **KINDS["k26_style"]}, "d") == (DraftAttention(WINDOW, False),
                                                                    DraftAttention(None, False))
    assert layer_attention({**base, **SLIDE_FULL}, "d") == (DraftAttention(WINDOW, True), DraftAttention(None, False))
    # transformers' Qwen3Config: without layer_types, layers >= max_window_layers slide when use_sliding_window
    derived = {**base, "layer_types": None, "sliding_window": 7}
    assert layer_attention({**derived, "use_sliding_window": True, "max_window_layers": 1},
                           "d") == (DraftAttention(), DraftAttention(7, True))
    assert layer_attention({**derived, "use_sliding_window": False, "max_window_layers": 0},
                           "d") == (DraftAttention(), DraftAttention())
    with pytest.raises(ValueError, match="use_sliding_window"):
        layer_attention({**base, "layer_types": ["sliding_attention"] * 2, "sliding_window": 7}, "d")
    with pytest.raises(ValueError, match="layer_types has 1 entries"):
        layer_attention({**base, "layer_types": ["full_attention"]}, "d")
    with pytest.raises(ValueError, match="chunked_attention"):
        layer_attention({**base, "layer_types": ["chunked_attention", "full_attention"]}, "d")


def _tp_rank(rank: int, addr: str, path: str, out) -> None:  # noqa: ANN001
    from ddtree_serve.model_executor.parallel_state import destroy_tp, init_tp
    from ddtree_serve.model_executor.weight_loader import iter_weights

    par = SimpleNamespace(tp_size=2, nnodes=1, node_rank=0, dist_init_addr=addr, expert_parallel=False,
                          startup_timeout_s=120.0, decode_context_parallel_size=1)
    tp = init_tp(par, rank, "cpu")
    model = DFlashDraftModel(ModelConfig.load(path, "float32"), tp)
    model.load_weights(iter_weights(path))
    model.draft_window = 6
    feats, embeds = inputs()
    out.put((rank, paged_draft(model, feats, embeds)))
    destroy_tp(tp)


def test_tp2_windowed_drafter_equals_tp1(tmp_path):
    """The K2.6-style drafter (sliding + full layers, cap 6) sharded over 2 gloo ranks (1 KV head each) drafts
    what it drafts unsharded."""
    from ddtree_serve.model_executor.parallel_state import free_local_addr
    from ddtree_serve.model_executor.weight_loader import iter_weights
    from ddtree_serve.speculative.train.export import save_drafter

    model, cfg = make_drafter(KINDS["k26_style"])
    save_drafter(model, cfg, tmp_path)
    one = DFlashDraftModel(ModelConfig.load(str(tmp_path), "float32"))
    one.load_weights(iter_weights(str(tmp_path)))
    one.draft_window = 6
    feats, embeds = inputs()
    want = paged_draft(one, feats, embeds)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    addr = free_local_addr()
    procs = [ctx.Process(target=_tp_rank, args=(r, addr, str(tmp_path), out)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    for r in range(2):
        torch.testing.assert_close(got[r], want, atol=1e-4, rtol=1e-4)


def test_dense_blocks_with_windows_and_cap_equal_separate_forwards():
    """Training's layout (several blocks in one dense forward, objective.block_attention_mask): each block of a
    windowed, capped drafter equals its own forward over just its prefix (the window and cap follow each
    block's anchor)."""
    from ddtree_serve.speculative.train.objective import block_attention_mask

    model, _ = make_drafter(KINDS["zlab_default_causality"], seed=3)
    model.draft_window = 4
    g = torch.Generator().manual_seed(2)
    feats, emb = torch.randn(1, 14, 192, generator=g), torch.randn(1, 2 * BLOCK, 64, generator=g)
    anchors = torch.tensor([[6, 12]])
    pos = (anchors[:, :, None] + torch.arange(BLOCK)).reshape(1, -1)
    with torch.no_grad():
        both = model.forward_train(feats, torch.arange(14)[None], emb, pos,
                                   block_attention_mask(anchors, torch.ones(1, 2, dtype=torch.bool), 14, BLOCK))
        for i, a in enumerate((6, 12)):
            one = reference(model, feats[0, :a], emb[0, i * BLOCK:(i + 1) * BLOCK], list(model.attention_kinds), 4)
            torch.testing.assert_close(both[0, i * BLOCK:(i + 1) * BLOCK], one, atol=1e-4, rtol=1e-4)
