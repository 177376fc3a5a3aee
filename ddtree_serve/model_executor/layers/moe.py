"""DeepSeek-V3 mixture of experts: sigmoid router with noaux_tc correction bias and group-limited top-k,
routed experts (TP: each expert's intermediate dim sharded; EP: whole experts per rank), shared experts.

Routing follows transformers' DeepseekV3TopkRouter exactly: scores = sigmoid(x W_g^T) in float32; the
choice uses scores + e_score_correction_bias; a group's score is the sum of its two best choice scores;
only the ``topk_group`` best of ``n_group`` groups stay eligible; the weights are the *uncorrected* scores
of the chosen experts, renormalised when ``norm_topk_prob`` (sum + 1e-20) and multiplied by
``routed_scaling_factor``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ddtree_serve.kernels.batch_invariant import invariant_linear
from ddtree_serve.model_executor.layers.activation import silu_and_mul
from ddtree_serve.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
from ddtree_serve.model_executor.layers.moe_experts import FusedExperts
from ddtree_serve.model_executor.layers.moe_int4 import Int4Experts
from ddtree_serve.model_executor.parallel_state import TPGroup


def grouped_topk(router_logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, n_group: int,
                 topk_group: int, norm_topk_prob: bool, routed_scaling_factor: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits float32 [T, E] -> (weights float32 [T, k], expert ids int64 [T, k])."""
    t, e = router_logits.shape
    scores = router_logits.sigmoid()  # [T, E]
    choice = scores + bias if bias is not None else scores  # [T, E]
    if n_group > 1 and topk_group < n_group:
        group_scores = choice.view(t, n_group, e // n_group).topk(2, dim=-1)[0].sum(-1)  # [T, G]
        group_idx = group_scores.topk(topk_group, dim=-1)[1]  # [T, topk_group]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)  # [T, G]
        keep = group_mask[:, :, None].expand(t, n_group, e // n_group).reshape(t, e).bool()  # [T, E]
        choice = choice.masked_fill(~keep, float("-inf"))
    ids = choice.topk(top_k, dim=-1)[1]  # [T, k]
    weights = scores.gather(1, ids)  # [T, k]
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids


class DenseMLP(nn.Module):
    """SwiGLU MLP (dense layers and shared experts), TP column/row split; checkpoint names gate/up/down_proj."""

    def __init__(self, hidden: int, inter: int, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(hidden, [inter, inter], False, tp, dtype)
        self.down_proj = RowParallelLinear(inter, hidden, False, tp, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class MoEGate(nn.Module):
    """Router weights kept in float32 (as transformers does): ``weight [E, H]``, ``e_score_correction_bias [E]``.
    ``row_invariant`` (``use_invariant_linears``): the float32 product through ``invariant_linear`` (float32 GEMM
    rows differ between M = 1..3 and M >= 4 on the CPU this was written on: docs/DESIGN.md 4.18); the top-k
    routing after it is row-wise."""

    row_invariant = False

    def __init__(self, num_experts: int, hidden: int, noaux_tc: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=torch.float32), requires_grad=False)
        self.e_score_correction_bias = (nn.Parameter(torch.zeros(num_experts, dtype=torch.float32),
                                                     requires_grad=False) if noaux_tc else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.row_invariant:
            return invariant_linear(x.float(), self.weight)  # [T, E] float32
        return F.linear(x.float(), self.weight)  # [T, E] float32


class DeepseekMoE(nn.Module):
    """Routed experts + shared experts of one DeepSeek-V3 layer; ``cfg`` is the HF text config dict."""

    def __init__(self, cfg: dict, tp: TPGroup, dtype: torch.dtype, int4_group: int | None = None,
                 backend: str = "torch"):
        """``int4_group``: keep the routed experts pack-quantized INT4 with this group size (``Int4Experts``);
        None: dense experts (BF16 checkpoints, or INT4 dequantized at load). ``backend``: the routed
        experts' kernels, "torch" | "triton" (``FusedExperts``)."""
        super().__init__()
        hidden, inter = cfg["hidden_size"], cfg["moe_intermediate_size"]
        scoring = cfg.get("scoring_func", "sigmoid")
        if scoring != "sigmoid":
            raise ValueError(f"unsupported MoE scoring_func {scoring!r} (DeepSeek-V3 uses sigmoid)")
        self.top_k = cfg["num_experts_per_tok"]
        self.n_group = cfg.get("n_group") or 1
        self.topk_group = cfg.get("topk_group") or 1
        self.norm_topk_prob = bool(cfg.get("norm_topk_prob", True))
        self.scaling = float(cfg.get("routed_scaling_factor", 1.0))
        self.gate = MoEGate(cfg["n_routed_experts"], hidden, cfg.get("topk_method", "noaux_tc") == "noaux_tc")
        if int4_group is None:
            self.experts = FusedExperts(cfg["n_routed_experts"], hidden, inter, tp, dtype, backend)
        else:
            self.experts = Int4Experts(cfg["n_routed_experts"], hidden, inter, tp, dtype, int4_group, backend)
        n_shared = cfg.get("n_shared_experts") or 0
        self.shared_experts = DenseMLP(hidden, inter * n_shared, tp, dtype) if n_shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H] (all-reduced across TP ranks)."""
        weights, ids = grouped_topk(self.gate(x), self.gate.e_score_correction_bias, self.top_k, self.n_group,
                                    self.topk_group, self.norm_topk_prob, self.scaling)
        out = self.experts(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
