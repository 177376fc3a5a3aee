"""Row-invariant DeepSeek MoE (layers/moe.py router, layers/moe_experts.py ``forward_invariant``, INT4-resident
experts of layers/moe_int4.py): with ``use_invariant_linears`` a token's MoE output (router, routed experts,
shared expert) is bit-identical alone and inside batches of other tokens, whatever the experts' token counts,
in bfloat16 (the served dtype) and float32. The tiny Kimi checkpoint (8 experts, top-2, 1 shared expert)."""

from __future__ import annotations

import pytest
import torch

from ddtree_serve.model_executor.layers.linear import use_invariant_linears
from ddtree_serve.model_executor.layers.moe import DeepseekMoE
from ddtree_serve.model_executor.layers.moe_int4 import Int4Experts
from ddtree_serve.model_executor.model_config import ModelConfig
from ddtree_serve.model_executor.model_registry import get_model_class
from ddtree_serve.model_executor.weight_loader import iter_weights
from tests.model_executor.tiny_deepseek import write_tiny_deepseek


@pytest.fixture(scope="module")
def kimi(tmp_path_factory) -> str:
    return str(write_tiny_deepseek(tmp_path_factory.mktemp("kimi-moe"), int4=True, kimi=True, seed=3).path)


def _moe(path: str, dtype: str, int4: str) -> DeepseekMoE:
    cfg = ModelConfig.load(path, dtype, "cpu", int4_experts=int4, deterministic_inference=True)
    model = get_model_class(cfg.architecture)(cfg)
    model.load_weights(iter_weights(path, skip_prefixes=getattr(model, "skip_weight_prefixes", ())))
    use_invariant_linears(model)
    moe = model.layers[1].mlp
    assert isinstance(moe, DeepseekMoE) and isinstance(moe.experts, Int4Experts) is (int4 == "packed")
    return moe.eval()


@pytest.mark.parametrize(("dtype", "int4"), [("bfloat16", "dequant"), ("bfloat16", "packed"), ("float32", "dequant")])
def test_moe_token_alone_equals_token_in_batches(kimi, dtype, int4):
    """Token 7 alone vs inside batches of 1 to 300 tokens at offsets 0, 3, 7 (the experts' token counts
    and the batch's expert grouping change with every batch); and the same token repeated in one batch."""
    moe = _moe(kimi, dtype, int4)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(310, 64, generator=g).to(getattr(torch, dtype))
    with torch.no_grad():
        alone = moe(x[7:8])[0]
        checked = 0
        for m in (1, 2, 3, 4, 5, 7, 8, 9, 13, 16, 17, 31, 40, 67, 300):
            for off in (0, 3, 7):
                if off <= 7 < off + m:
                    assert torch.equal(moe(x[off : off + m])[7 - off], alone), (m, off)
                    checked += 1
        assert checked > 30
        same = moe(x[7:8].expand(13, -1).contiguous())
        assert torch.equal(same, alone.expand(13, -1))
        moe.experts.row_invariant = False  # the default path computes the same MoE up to rounding
        ref = moe(x[:67])
    tol = 3e-2 if dtype == "bfloat16" else 1e-5
    torch.testing.assert_close(moe.experts.forward_invariant(x[:67], *_routing(moe, x[:67])).float() +
                               moe.shared_experts(x[:67]).float(), ref.float(), atol=tol, rtol=tol)


def _routing(moe: DeepseekMoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from ddtree_serve.model_executor.layers.moe import grouped_topk

    return grouped_topk(moe.gate(x), moe.gate.e_score_correction_bias, moe.top_k, moe.n_group, moe.topk_group,
                        moe.norm_topk_prob, moe.scaling)
