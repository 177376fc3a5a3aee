"""The routed experts of a DeepSeek-V3 MoE layer as two stacked dense weights (the bf16 path; INT4 experts
subclass it in moe_int4.py). The router and the layer that calls them: moe.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ddtree_serve.kernels.batch_invariant import invariant_linear
from ddtree_serve.model_executor.layers.activation import silu_and_mul
from ddtree_serve.model_executor.parallel_state import TPGroup


class FusedExperts(nn.Module):
    """The routed experts of one layer as two stacked weights ``w13 [E_r, 2 * I_r, H]`` = [gate; up] and
    ``w2 [E_r, H, I_r]``. Tensor parallel (default): every expert, this rank's slice of the intermediate dim
    (``E_r = E``, ``I_r = I / tp``). Expert parallel (``tp.expert_parallel``): this rank's block of whole
    experts ``[expert_start, expert_start + E_r)`` (``I_r = I``). Either way the output is a partial sum
    over ranks: the caller all-reduces it (``reduce=True`` does it here). ``row_invariant``
    (``--enable-deterministic-inference``, set by ``use_invariant_linears``): ``forward_invariant`` on the torch
    backend, the kernel's invariant mode on triton."""

    row_invariant = False

    def __init__(self, num_experts: int, hidden: int, intermediate: int, tp: TPGroup, dtype: torch.dtype,
                 backend: str = "torch"):
        """``backend``: "torch" (the per-expert loop below, every device) or "triton" (the grouped GEMM of
        ddtree_serve/kernels/triton_moe.py over the same parameters; CUDA, or CPU under ``TRITON_INTERPRET=1``)."""
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
        if self.backend == "triton":  # row-invariant: the kernel's invariant mode (slot-ordered combine)
            out = self.forward_triton(x, weights, ids, invariant=self.row_invariant)
            return self.tp.all_reduce(out) if reduce else out
        if self.row_invariant:
            out = self.forward_invariant(x, weights, ids)
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

    def forward_invariant(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum, row-invariant: a token's output depends on its own hidden state and routing
        only, not on which tokens share its experts. Each expert's GEMMs see whole ``ROW_BLOCK``s of rows
        (``invariant_linear``), so a row's expert output does not depend on how many tokens the expert got;
        each token's top-k outputs are weighted in float32 and summed in ascending expert id, one slot after
        the other, then cast (the default path's ``index_add_`` over expert-sorted rows sums in the order of
        the batch's grouping). Sources: Thinking Machines, "Defeating Nondeterminism in LLM Inference";
        SGLang's deterministic inference (fixed-order MoE combine). x [T, H], weights [T, k], ids [T, k] -> [T, H]."""
        t, k = ids.shape
        order = torch.argsort(ids, dim=1, stable=True)  # [T, k] each token's slots by expert id
        local = (ids.gather(1, order) - self.expert_start).reshape(-1)  # [T*k] local expert of each sorted slot
        w = weights.gather(1, order).float()  # [T, k]
        outs = x.new_zeros(t * k, x.shape[-1])  # [T*k, H] expert output per (token, sorted slot); 0: another rank's
        held = local[(local >= 0) & (local < self.num_local)]
        for e in torch.unique(held).tolist():
            rows = torch.nonzero(local == e, as_tuple=True)[0]  # [c] (token, slot) rows of expert e
            w13, w2 = self.expert_weights(e, x.dtype)
            h = silu_and_mul(invariant_linear(x[rows // k], w13))  # [c, I_r]
            outs[rows] = invariant_linear(h, w2)  # [c, H]
        weighted = outs.view(t, k, -1).float() * w[..., None]  # [T, k, H] float32
        acc = weighted[:, 0]  # [T, H]
        for j in range(1, k):  # fixed order: ascending expert id
            acc = acc + weighted[:, j]
        return acc.to(x.dtype)

    def forward_triton(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, invariant: bool = False
                       ) -> torch.Tensor:
        """This rank's partial sum through ddtree_serve/kernels/triton_moe.py (dense stacked weights);
        ``invariant``: its batch-invariant mode."""
        from ddtree_serve.kernels.triton_moe import fused_moe

        return fused_moe(x, weights, ids, self.w13, self.w2, self.expert_start, invariant=invariant)
