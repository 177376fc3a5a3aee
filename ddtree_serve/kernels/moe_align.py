"""Sort (token, expert) pairs by local expert and pad each expert's run to a multiple of ``block_m``.

The grouped MoE GEMM (ddtree_serve/kernels/triton_moe.py) launches one program per ``block_m`` rows of the sorted list;
every block holds rows of exactly one expert, so a program loads that expert's weights once. Rows are flat
pair ids ``t * top_k + s`` (token ``t``, routing slot ``s``); padding rows hold the sentinel ``T * top_k``.

Sizes are static upper bounds and every op is sync-free (no ``bincount``, whose output size needs the
host; so the result can be captured in a CUDA graph): the sorted
list has ``T * top_k + E_r * (block_m - 1)`` rows, rounded up to whole blocks; blocks past the last used one
(and every block when no pair is local) carry expert ``-1`` and are skipped by the kernel. Pairs routed to
another rank's experts (expert parallelism) are left out entirely.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AlignedPairs:
    sorted_pairs: torch.Tensor  # [P] int32 flat pair id, or num_pairs (padding)
    block_expert: torch.Tensor  # [P / block_m] int32 local expert of each block, -1 = unused block
    num_pairs: int  # T * top_k (the padding sentinel)
    block_m: int


def align_pairs_by_expert(ids: torch.Tensor, expert_start: int, num_local: int, block_m: int) -> AlignedPairs:
    """ids [T, k] global expert ids -> pairs grouped by local expert ``ids - expert_start`` in
    ``[0, num_local)``, stable within an expert (ascending pair id), each run padded to ``block_m`` rows."""
    num_pairs = ids.numel()
    device = ids.device
    flat = ids.reshape(-1).to(torch.int64) - expert_start  # [N] local expert id
    local = (flat >= 0) & (flat < num_local)  # [N]
    key = torch.where(local, flat, torch.full_like(flat, num_local))  # [N] non-local pairs sort last
    ones = torch.ones_like(key)
    counts = torch.zeros(num_local + 1, dtype=torch.int64, device=device).scatter_add_(0, key, ones)[
        :num_local
    ]  # [E]
    padded = (counts + block_m - 1) // block_m * block_m  # [E]
    run_end = torch.cumsum(padded, 0)  # [E] padded end row of each expert's run
    run_start = run_end - padded  # [E]
    order = torch.argsort(key, stable=True)  # [N] pair ids by expert
    sorted_key = key[order]  # [N]
    first = torch.cumsum(counts, 0) - counts  # [E] first unpadded rank of each expert
    e_of = sorted_key.clamp(max=max(num_local - 1, 0))  # [N]
    dest = run_start[e_of] + torch.arange(num_pairs, device=device) - first[e_of]  # [N] row in the list
    blocks = (num_pairs + num_local * (block_m - 1) + block_m - 1) // block_m
    rows = blocks * block_m
    sorted_pairs = torch.full((rows + 1,), num_pairs, dtype=torch.int64, device=device)  # [P + 1]
    dest = torch.where(sorted_key < num_local, dest, torch.full_like(dest, rows))  # non-local -> scratch row
    sorted_pairs.index_put_((dest,), order)
    block_start = torch.arange(blocks, device=device) * block_m  # [B]
    block_expert = torch.searchsorted(run_end, block_start, right=True)  # [B] first run ending after start
    block_expert = torch.where(block_expert < num_local, block_expert, torch.full_like(block_expert, -1))
    return AlignedPairs(sorted_pairs[:rows].to(torch.int32), block_expert.to(torch.int32), num_pairs, block_m)
