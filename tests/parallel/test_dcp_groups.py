"""DCP groups smaller than the TP world (ddtree_serve/model_executor/parallel_state.py): at TP 4 with
``decode_context_parallel_size=2`` (4 gloo processes) ranks {0, 1} and {2, 3} form the DCP groups; the DCP
all-gather and reduce-scatter stay inside a group and follow DCP-rank order."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.multiprocessing as mp


def _rank(rank: int, addr: str, out) -> None:  # noqa: ANN001
    from ddtree_serve.model_executor.parallel_state import destroy_tp, init_tp

    par = SimpleNamespace(tp_size=4, nnodes=1, node_rank=0, dist_init_addr=addr, expert_parallel=False,
                          startup_timeout_s=120.0, decode_context_parallel_size=2)
    tp = init_tp(par, rank, "cpu")
    gathered = tp.dcp_all_gather(torch.tensor([[float(rank)]]), dim=1)  # [1, 2]
    x = torch.arange(4, dtype=torch.float32)[None] + 10 * rank  # [1, 4]
    mine = tp.dcp_reduce_scatter(x, dim=1)  # [1, 2]
    out.put((rank, tp.dcp_rank, gathered.tolist(), mine.tolist()))
    destroy_tp(tp)


def test_dcp_subgroups_at_tp4() -> None:
    from ddtree_serve.model_executor.parallel_state import free_local_addr

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    addr = free_local_addr()
    procs = [ctx.Process(target=_rank, args=(r, addr, out)) for r in range(4)]
    for p in procs:
        p.start()
    got = sorted(out.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0, 0, 0]
    base = [0.0, 1.0, 2.0, 3.0]
    for rank, dcp_rank, gathered, mine in got:
        g = rank // 2  # the group's first rank is 2g
        assert dcp_rank == rank % 2 and gathered == [[2.0 * g, 2.0 * g + 1]]
        summed = [2 * b + 10 * (2 * g) + 10 * (2 * g + 1) for b in base]  # the group's two ranks
        assert mine == [summed[2 * dcp_rank:2 * dcp_rank + 2]]
