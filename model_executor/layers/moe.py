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

from model_executor.layers.activation import silu_and_mul
from model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
from model_executor.parallel_state import TPGroup


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


class FusedExperts(nn.Module):
    """The routed experts of one layer as two stacked weights ``w13 [E_r, 2 * I_r, H]`` = [gate; up] and
    ``w2 [E_r, H, I_r]``. Tensor parallel (default): every expert, this rank's slice of the intermediate dim
    (``E_r = E``, ``I_r = I / tp``). Expert parallel (``tp.expert_parallel``): this rank's block of whole
    experts ``[expert_start, expert_start + E_r)`` (``I_r = I``). Either way the output is a partial sum
    over ranks: the caller all-reduces it (``reduce=True`` does it here)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, tp: TPGroup, dtype: torch.dtype,
                 backend: str = "torch"):
        """``backend``: "torch" (the per-expert loop below, every device) or "triton" (the grouped GEMM of
        ddtree_kernels/triton_moe.py over the same parameters; CUDA, or CPU under ``TRITON_INTERPRET=1``)."""
        super().__init__()
        self.tp, self.num_experts, self.backend = tp, num_experts, backend
        if tp.expert_parallel:
            self.expert_start, self.num_local = tp.partition(num_experts, "routed experts")
            self.inter, self.inter_start = intermediate, 0
        else:
            self.expert_start, self.num_local = 0, num_experts
            self.inter = tp.shard(intermediate, "moe intermediate size")
            self.inter_start = tp.rank * self.inter
        self._make_weights(hidden, dtype)

    def _make_weights(self, hidden: int, dtype: torch.dtype) -> None:
        self.w13 = nn.Parameter(torch.empty(self.num_local, 2 * self.inter, hidden, dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(self.num_local, hidden, self.inter, dtype=dtype), requires_grad=False)
        self.w13.weight_loader = self._load  # type: ignore[attr-defined]
        self.w2.weight_loader = self._load  # type: ignore[attr-defined]

    def _load(self, param: torch.Tensor, loaded, shard_id: tuple[int | None, str]) -> None:
        """shard_id = (global expert id, or None for a stacked [E, ...] tensor; "gate" | "up" | "gate_up" |
        "down"). ``loaded`` is a tensor or a lazy slice (only ``shape``/``narrow`` used): a rank reads its
        own slice only, and under expert parallelism never touches another rank's experts."""
        expert, kind = shard_id
        s, n = self.inter_start, self.inter
        if expert is None:
            dst = param.data
            if self.num_local != self.num_experts:
                loaded = loaded.narrow(0, self.expert_start, self.num_local)
        else:
            local = expert - self.expert_start
            if not 0 <= local < self.num_local:
                return  # another rank's expert
            dst = param.data[local]
        if kind == "down":  # [.., H, I] -> this rank's input columns
            dst.copy_(loaded.narrow(-1, s, n))
        elif kind == "gate_up":  # [.., 2I, H] already merged
            full = tuple(loaded.shape)[-2] // 2
            dst[..., :n, :].copy_(loaded.narrow(-2, s, n))
            dst[..., n:, :].copy_(loaded.narrow(-2, full + s, n))
        else:
            off = 0 if kind == "gate" else n
            dst[..., off:off + n, :].copy_(loaded.narrow(-2, s, n))

    def expert_weights(self, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Local expert ``e``'s dense ``w13 [2 * I_r, H]`` and ``w2 [H, I_r]``."""
        return self.w13[e], self.w2[e]

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """x [T, H], weights [T, k], ids [T, k] (global expert ids) -> [T, H]. The (token, expert) pairs this
        rank holds are sorted by expert and each expert runs one dense GEMM over its contiguous slice (a
        loop over the local experts that received tokens; "triton": one grouped GEMM launch per projection)."""
        if self.backend == "triton":
            out = self.forward_triton(x, weights, ids)
            return self.tp.all_reduce(out) if reduce else out
        t, k = ids.shape
        flat = ids.reshape(-1) - self.expert_start  # [T*k] local expert id; out of range = another rank's
        if self.num_local == self.num_experts:
            rows = torch.arange(t * k, device=ids.device)  # [R = T*k]
        else:
            rows = torch.nonzero((flat >= 0) & (flat < self.num_local), as_tuple=True)[0]  # [R]
        order = rows[torch.argsort(flat[rows], stable=True)]  # [R] flat (token, slot) rows by local expert
        token_of = order // k  # [R] source token of each sorted row
        counts = torch.bincount(flat[order], minlength=self.num_local).tolist()  # E_r python ints
        xs = x[token_of]  # [R, H] gathered in expert order
        out_sorted = x.new_empty(order.numel(), x.shape[-1])  # [R, H]
        start = 0
        for e, c in enumerate(counts):
            if c == 0:
                continue
            w13, w2 = self.expert_weights(e, x.dtype)
            h = silu_and_mul(F.linear(xs[start:start + c], w13))  # [c, I_r]
            out_sorted[start:start + c] = F.linear(h, w2)  # [c, H]
            start += c
        w_sorted = weights.reshape(-1)[order].to(x.dtype)  # [R]
        out = torch.zeros_like(x)  # [T, H]
        out.index_add_(0, token_of, out_sorted * w_sorted[:, None])
        return self.tp.all_reduce(out) if reduce else out


    def forward_triton(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum through ddtree_kernels/triton_moe.py (dense stacked weights)."""
        from ddtree_kernels.triton_moe import fused_moe

        return fused_moe(x, weights, ids, self.w13, self.w2, self.expert_start)


class DenseMLP(nn.Module):
    """SwiGLU MLP (dense layers and shared experts), TP column/row split; checkpoint names gate/up/down_proj."""

    def __init__(self, hidden: int, inter: int, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(hidden, [inter, inter], False, tp, dtype)
        self.down_proj = RowParallelLinear(inter, hidden, False, tp, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class MoEGate(nn.Module):
    """Router weights kept in float32 (as transformers does): ``weight [E, H]``, ``e_score_correction_bias [E]``."""

    def __init__(self, num_experts: int, hidden: int, noaux_tc: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=torch.float32), requires_grad=False)
        self.e_score_correction_bias = (nn.Parameter(torch.zeros(num_experts, dtype=torch.float32),
                                                     requires_grad=False) if noaux_tc else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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
            from model_executor.layers.moe_int4 import Int4Experts

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
