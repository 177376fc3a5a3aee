"""INT4-resident routed experts (layers/moe_int4.py) against the dequantize-at-load path on tiny Kimi
checkpoints: the same logits (the same dequantization, done per forward instead of once), a quarter of the
expert bytes of BF16, and per TP / EP rank the same local experts as the dense path's (whose slices
tests/parallel/test_sharded_loading.py checks against the full tensors)."""

from __future__ import annotations

import pytest
import torch

from ddtree_serve.model_executor.layers.moe_experts import FusedExperts
from ddtree_serve.model_executor.layers.moe_int4 import Int4Experts
from ddtree_serve.model_executor.model_config import ModelConfig
from ddtree_serve.model_executor.model_registry import get_model_class
from ddtree_serve.model_executor.parallel_state import TPGroup
from ddtree_serve.model_executor.weight_loader import iter_weights
from tests.model_executor.test_deepseek_v3 import _extend, _ids
from tests.model_executor.tiny_deepseek import write_tiny_deepseek


def _model(path: str, mode: str, tp: TPGroup = TPGroup()) -> torch.nn.Module:
    cfg = ModelConfig.load(path, "float32", "cpu", int4_experts=mode)
    model = get_model_class(cfg.architecture)(cfg, tp)
    model.load_weights(iter_weights(path, skip_prefixes=getattr(model, "skip_weight_prefixes", ()),
                                    lazy=tp.size > 1))
    return model.eval()


def _experts(model: torch.nn.Module) -> list[FusedExperts]:
    return [m for m in model.modules() if isinstance(m, FusedExperts)]


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    # moe_intermediate 64: each TP-2 rank's slice of down's input columns is whole 32-wide groups
    return str(write_tiny_deepseek(tmp_path_factory.mktemp("kimi"), int4=True, kimi=True, seed=2,
                                   moe_intermediate_size=64).path)


def test_auto_mode_by_device(kimi):
    assert ModelConfig.load(kimi, "float32", "cpu").int4_experts == "dequant"
    assert ModelConfig.load(kimi, "float32", "cuda").int4_experts == "packed"
    with pytest.raises(ValueError, match="int4_experts"):
        ModelConfig.load(kimi, "float32", "cpu", int4_experts="int3")


def test_packed_logits_equal_dequantized(kimi):
    from ddtree_serve.model_executor.model_runner import ModelRunner

    def runner(mode: str) -> ModelRunner:
        cfg = ModelConfig.load(kimi, "float32", "cpu", int4_experts=mode)
        return ModelRunner(cfg, max_total_tokens=256, max_reqs=2, max_context=128)

    packed, dense = runner("packed"), runner("dequant")
    assert all(isinstance(e, Int4Experts) for e in _experts(packed.model))
    assert not any(isinstance(e, Int4Experts) for e in _experts(dense.model))
    prompt = _ids(12, 5)
    torch.testing.assert_close(_extend(packed, prompt), _extend(dense, prompt), atol=1e-5, rtol=1e-5)
    # resident expert bytes: int32 words (8 values each) + one scale per 32 values, vs 4-byte dense weights
    n_packed = sum(p.numel() * p.element_size() for e in _experts(packed.model) for p in e.parameters())
    n_dense = sum(p.numel() * p.element_size() for e in _experts(dense.model) for p in e.parameters())
    assert n_packed * 32 == n_dense * 5  # fp32 dense: 32 bits/weight; packed: 4 + 32/32 (fp32 scales) = 5


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_rank_local_experts_equal_dense_path(kimi, expert_parallel):
    for rank in range(2):
        tp = TPGroup(rank, 2, expert_parallel=expert_parallel)
        packed, dense = _experts(_model(kimi, "packed", tp)), _experts(_model(kimi, "dequant", tp))
        for p, d in zip(packed, dense, strict=True):
            assert (p.expert_start, p.num_local, p.inter) == (d.expert_start, d.num_local, d.inter)
            for e in range(p.num_local):
                w13, w2 = p.expert_weights(e, torch.float32)
                torch.testing.assert_close(w13, d.w13[e], atol=0, rtol=0)
                torch.testing.assert_close(w2, d.w2[e], atol=0, rtol=0)


def test_misaligned_tp_slice_is_a_clear_error(tmp_path):
    path = str(write_tiny_deepseek(tmp_path / "k", int4=True, kimi=True).path)  # moe_intermediate 32
    with pytest.raises(ValueError, match="multiples of the group size"):
        _model(path, "packed", TPGroup(0, 2))
    assert _experts(_model(path, "packed", TPGroup(0, 2, expert_parallel=True)))  # whole experts: fine


def test_engine_ddtree_on_packed_experts_equals_dequantized(kimi, tmp_path):
    """Through the Engine: greedy DDTree over INT4-resident experts emits the dequantized path's tokens."""
    from ddtree_serve.model_executor.sampling_params import SamplingParams
    from ddtree_serve.server.engine import Engine
    from tests.model_executor.tiny_deepseek import VOCAB
    from tests.speculative.drafter_utils import write_random_drafter
    from tests.speculative.scripted_drafts import greedy_script, install

    drafter = write_random_drafter(kimi, tmp_path / "d", num_layers=1, block_size=4)
    prompts = [[3, 17, 42, 99, 7], [11, 200, 300, 12]]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs, log = [], None
    for mode, spec in (("dequant", {}), ("packed", dict(speculative_algorithm="ddtree", draft_model_path=drafter,
                                                       ddtree_budget=8))):
        eng = Engine(kimi, device="cpu", dtype="float32", max_total_tokens=256, int4_experts=mode, **spec)
        if spec:  # the scripted draft source: trees around the dequantized path's greedy tokens
            log = install(eng, greedy_script({tuple(p): t for p, t in zip(prompts, outs[0], strict=True)}, VOCAB))
        try:
            outs.append([o.token_ids for o in eng.generate(input_ids=prompts, sampling_params=sp)])
        finally:
            eng.shutdown()
    assert outs[0] == outs[1] and all(len(t) == 8 for t in outs[0])
    log.assert_accepted()
