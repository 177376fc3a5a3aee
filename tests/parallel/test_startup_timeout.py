"""Start-up collectives wait longer than steady-state ones (ddtree_serve/model_executor/parallel_state.py).

Two real gloo ranks with small timeouts (steady 1 s, start-up 30 s). At start-up rank 1 arrives 3 s late to
the first control collective (the KV sizing's ``min_int``) and to a device all-reduce: rank 0 waits for it.
After ``end_startup`` the same lateness breaks the collective on rank 0 within the 1 s steady timeout
(a ``CollectiveError``, not a hang).
"""

from __future__ import annotations

import multiprocessing as mp
import time

import torch

LATE_S = 3.0  # 3x the steady timeout (1 s): the start-up waits it out, the steady state does not


def _rank(rank: int, addr: str, out) -> None:
    from ddtree_serve.model_executor.parallel_state import CollectiveError, destroy_tp, end_startup, init_tp
    from ddtree_serve.server.config import ParallelArgs

    tp = init_tp(ParallelArgs(tp_size=2, startup_timeout_s=30.0), rank, "cpu", addr, collective_timeout_s=1.0)
    try:
        if rank == 1:
            time.sleep(LATE_S)
        out.put((rank, "startup min_int", tp.min_int(10 + rank)))
        if rank == 1:
            time.sleep(LATE_S)
        out.put((rank, "startup all_reduce", float(tp.all_reduce(torch.ones(2))[0])))
        end_startup(tp)
        if rank == 1:
            time.sleep(LATE_S)  # past the steady timeout: rank 0 gives up, then rank 1's peer is gone
        try:  # no timing asserted: with the start-up timeout still on, rank 0 would wait and succeed
            tp.all_reduce(torch.ones(2))
            out.put((rank, "steady", "ok"))
        except CollectiveError:
            out.put((rank, "steady", "error"))
    finally:
        if rank == 0:
            destroy_tp(tp)


def test_startup_waits_for_a_late_rank_and_steady_state_does_not() -> None:
    from ddtree_serve.model_executor.parallel_state import free_local_addr

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    addr = free_local_addr()
    procs = [ctx.Process(target=_rank, args=(r, addr, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = {}
        while (0, "steady") not in got:
            rank, what, value = out.get(timeout=120)
            got[(rank, what)] = value
    finally:
        for p in procs:
            p.join(15)
            if p.is_alive():
                p.kill()
    assert got[(0, "startup min_int")] == 10 and got[(0, "startup all_reduce")] == 2.0
    assert got[(0, "steady")] == "error"
