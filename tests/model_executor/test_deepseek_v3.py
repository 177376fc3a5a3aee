"""DeepSeek-V3 / Kimi K2.6 text model against transformers' DeepseekV3ForCausalLM (fp32, tiny checkpoints).

Tolerance: logits atol 2e-4 / rtol 1e-4 (fp32; the absorbed MLA reassociates the q.k products, the MoE
sums experts in a different order), same argmax everywhere. Absorbed vs expanded MLA: atol 1e-5.
"""

from __future__ import annotations

import logging

import pytest
import torch

from ddtree_serve.model_executor.forward_batch import ForwardMode, build_forward_batch
from ddtree_serve.model_executor.model_config import ModelConfig
from ddtree_serve.model_executor.model_runner import ModelRunner
from tests.model_executor.tiny_deepseek import VOCAB, write_reference, write_tiny_deepseek

ATOL, RTOL = 2e-4, 1e-4


def _runner(path: str) -> ModelRunner:
    return ModelRunner(ModelConfig.load(path, "float32"), max_total_tokens=1024, max_reqs=4,
                       max_context=256)


def _fb(r: ModelRunner, mode: ForwardMode, toks: list[int], positions: list[int], req: int, prefix: int,
        tree_mask: torch.Tensor | None = None):
    n = len(toks)
    slots = r.slots.place(torch.tensor([req]), torch.tensor([prefix]), torch.tensor([n]))
    return build_forward_batch(mode, torch.tensor(toks), torch.tensor(positions), slots, r.slots.table,
                               torch.tensor([req]), torch.tensor([prefix]), torch.tensor([n]), tree_mask=tree_mask)


def _extend(r: ModelRunner, ids: list[int], prefix: int = 0, req: int = 0) -> torch.Tensor:
    fb = _fb(r, ForwardMode.EXTEND if len(ids) - prefix > 1 else ForwardMode.DECODE, ids[prefix:],
             list(range(prefix, len(ids))), req, prefix)
    return r.logits(r.forward(fb).hidden)


def _hf(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


@pytest.fixture(scope="module")
def bf16_ckpt(tmp_path_factory):
    return write_tiny_deepseek(tmp_path_factory.mktemp("ds-bf16"))


@pytest.fixture(scope="module")
def kimi_int4_ckpt(tmp_path_factory):
    tiny = write_tiny_deepseek(tmp_path_factory.mktemp("kimi-int4"), int4=True, kimi=True, seed=1)
    return tiny, write_reference(tiny, tmp_path_factory.mktemp("kimi-int4-ref"))


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_bf16_extend_chunked_decode_match_transformers(bf16_ckpt):
    """The BF16 checkpoint as transformers itself reads it: one extend, then chunked extend + decode."""
    ref_model = _hf(bf16_ckpt.path)
    ids = _ids(24, 0)
    ref = _hf_logits(ref_model, ids)
    torch.testing.assert_close(_extend(_runner(bf16_ckpt.path), ids), ref, atol=ATOL, rtol=RTOL)
    r = _runner(bf16_ckpt.path)
    outs = [_extend(r, ids[:9]), _extend(r, ids[:20], prefix=9)]
    outs += [_extend(r, ids[:p + 1], prefix=p) for p in range(20, 24)]
    got = torch.cat(outs)
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=RTOL)
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_kimi_int4_logits_and_tree_verify_match_dequantized_reference(kimi_int4_ckpt, caplog):
    """Kimi wrapper + INT4 experts vs transformers on the dequantized weights; a verify tree's nodes equal
    causal forwards of their root-to-node paths."""
    tiny, ref_path = kimi_int4_ckpt
    ref_model = _hf(ref_path)
    with caplog.at_level(logging.INFO, logger="ddtree_serve.model_executor.models.kimi_k25"):
        r = _runner(tiny.path)
    assert any("text model only" in m for m in caplog.messages)
    prompt = _ids(16, 3)
    torch.testing.assert_close(_extend(r, prompt), _hf_logits(ref_model, prompt), atol=ATOL, rtol=RTOL)
    toks, parents, depth = [7, 12, 13, 14, 15], [-1, 0, 0, 1, 3], [0, 1, 1, 2, 3]
    mask = torch.zeros(1, 5, 5, dtype=torch.bool)
    for i in range(5):
        j = i
        while j >= 0:
            mask[0, i, j], j = True, parents[j]
    fb = _fb(r, ForwardMode.TARGET_VERIFY, toks, [16 + d for d in depth], 0, 16, tree_mask=mask)
    tree = r.logits(r.forward(fb).hidden)
    for node, seq in [(0, [7]), (2, [7, 13]), (4, [7, 12, 14, 15])]:
        torch.testing.assert_close(tree[node], _hf_logits(ref_model, prompt + seq)[-1], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("interleave", [True, False])
def test_absorbed_mla_equals_expanded(tmp_path, interleave):
    """Every layer: the absorbed latent attention equals expanding K/V from the cached latent, in decode
    (one token after a cached prefix) and in a multi-token extend over a prefix, with a 2-request batch."""
    tiny = write_tiny_deepseek(tmp_path, rope_interleave=interleave, num_hidden_layers=2, seed=4)
    r = _runner(tiny.path)
    model = r.model
    _extend(r, _ids(11, 5), req=0)
    _extend(r, _ids(6, 6), req=1)
    for n_new in (1, 4):  # the decode step's token stays cached: the extend step sees it as prefix
        pre = [11, 6] if n_new == 1 else [12, 7]
        slots = r.slots.place(torch.tensor([0, 1]), torch.tensor(pre), torch.tensor([n_new, n_new]))
        mode = ForwardMode.DECODE if n_new == 1 else ForwardMode.EXTEND
        positions = torch.cat([torch.arange(p, p + n_new) for p in pre])
        fb = build_forward_batch(mode, torch.tensor(_ids(2 * n_new, 7 + n_new)), positions, slots,
                                 r.slots.table, torch.tensor([0, 1]), torch.tensor(pre),
                                 torch.tensor([n_new, n_new]))
        h = torch.randn(2 * n_new, tiny.text_config["hidden_size"], generator=torch.Generator().manual_seed(n_new))
        for i, layer in enumerate(model.layers):
            attn = layer.self_attn
            cos_sin = attn.rotary.cos_sin(fb.positions)
            with torch.no_grad():
                a = attn(h, fb, r.kv.k[i], cos_sin)
                b = attn.forward_expanded(h, fb, r.kv.k[i], cos_sin)
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_greedy_generation_matches_transformers_generate(kimi_int4_ckpt):
    from ddtree_serve.server.engine import Engine, SamplingParams

    tiny, ref_path = kimi_int4_ckpt
    ref_model = _hf(ref_path)
    prompts = [_ids(9, 11), _ids(5, 12)]
    expected = []
    for p in prompts:
        with torch.no_grad():
            out = ref_model.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                                     pad_token_id=0)
        expected.append(out[0, len(p):].tolist())
    engine = Engine(model_path=tiny.path, dtype="float32", max_total_tokens=1024)
    try:
        outs = engine.generate(input_ids=prompts, sampling_params=SamplingParams(temperature=0, max_tokens=8,
                                                                                 ignore_eos=True))
    finally:
        engine.shutdown()
    assert [o.token_ids for o in outs] == expected


def test_router_matches_transformers_grouped_topk():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    from ddtree_serve.model_executor.layers.moe import grouped_topk

    cfg = DeepseekV3Config(hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                           routed_scaling_factor=2.5, norm_topk_prob=True)
    router = DeepseekV3TopkRouter(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.normal_(generator=g)
        router.e_score_correction_bias.normal_(generator=g)
    x = torch.randn(64, 32, generator=g)
    logits, ref_w, ref_ids = router(x)
    w, ids = grouped_topk(logits, router.e_score_correction_bias, 4, 4, 2, True, 2.5)
    ref_sorted, order = ref_ids.sort(-1)
    got_sorted, gorder = ids.sort(-1)
    assert torch.equal(got_sorted, ref_sorted)
    torch.testing.assert_close(w.gather(1, gorder), ref_w.gather(1, order))


def test_kv_layout_is_latent_only(bf16_ckpt):
    from ddtree_serve.model_executor.models.deepseek_v3 import DeepseekV3ForCausalLM

    m = DeepseekV3ForCausalLM(ModelConfig.load(bf16_ckpt.path, "bfloat16"))
    layout = m.kv_cache_layout()
    assert (layout.num_layers, layout.kv_heads, layout.k_dim, layout.v_dim) == (3, 1, 32 + 8, 0)
    assert layout.bytes_per_token(torch.bfloat16) == 3 * 40 * 2
