"""Build the scheduler a server or Engine drives: ``make_scheduler`` returns a ``SchedulerLike``, the
single-process ``Scheduler`` at tp_size 1, else rank 0 of a TP world (``TPScheduler``, ddtree_serve/server/tp/protocol.py)
with this node's follower ranks spawned (ddtree_serve/server/tp/spawn.py).

The configuration arrives resolved (ddtree_serve/server/startup.py ``resolve_config``): every rank reads the same model
directory and device, and nothing below resolves them again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from ddtree_serve.server.config import ServerConfig
from ddtree_serve.server.io_struct import GenerateReq, SchedulerStats, TokenOut
from ddtree_serve.server.startup import is_resolved


@runtime_checkable
class SchedulerLike(Protocol):
    """What the Engine and the scheduler process drive. ``Scheduler`` and ``TPScheduler`` satisfy it.

    ``add_request`` raises ValueError for a request it refuses (nothing is queued then); ``step`` runs one
    scheduler step and returns its outputs; after ``step`` raised an error that is not fatal
    (ddtree_serve/server/scheduling/step_recovery.py ``is_fatal``), ``fail_step`` fails that step's requests (their KV freed, ids
    returned) and the scheduler serves on; ``close`` releases what the scheduler started (TP: the
    follower processes) and is safe to call twice."""

    @property
    def max_context_len(self) -> int: ...

    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...

    @property
    def vocab_size(self) -> int: ...  # the model's: token ids below it

    @property
    def running(self) -> Sequence: ...  # the requests being decoded (ddtree_serve.server.scheduling.request.Req)

    @property
    def waiting(self) -> Sequence: ...  # the requests queued for prefill

    def add_request(self, req: GenerateReq) -> None: ...

    def abort_request(self, rid: str) -> None: ...

    def has_work(self) -> bool: ...

    def step(self) -> list[TokenOut]: ...

    def fail_step(self) -> list[str]: ...  # after ``step`` raised a non-fatal error: fail its requests

    def stats(self) -> SchedulerStats: ...

    def close(self) -> None: ...

    def set_host_window(self, work: Callable[[], None] | None) -> None: ...  # the overlap window's host work

    @property
    def takes_requests_mid_step(self) -> bool: ...  # whether add_request may run inside the overlap window


def make_scheduler(config: ServerConfig) -> SchedulerLike:
    """``Scheduler`` for tp_size 1; otherwise spawn the local followers, join the TP world as rank 0 and
    return a ``TPScheduler``. ``config`` must be resolved; call ``close()`` when done."""
    from ddtree_serve.model_executor.parallel_state import end_startup, free_local_addr, init_tp
    from ddtree_serve.server.scheduling.fault_injection import install_test_faults
    from ddtree_serve.server.scheduling.scheduler import Scheduler
    from ddtree_serve.server.tp.errors import TPRankError
    from ddtree_serve.server.tp.processes import rank_of, stop_followers
    from ddtree_serve.server.tp.protocol import TPScheduler
    from ddtree_serve.server.tp.spawn import start_followers
    from ddtree_serve.server.warmup import warm_up

    if not is_resolved(config):
        raise ValueError("make_scheduler needs a resolved config (ddtree_serve.server.startup.resolve_config)")
    par = config.parallel
    if par.tp_size == 1:
        scheduler = Scheduler(config)
        warm_up(scheduler)  # every path compiled before the server reports ready (ddtree_serve/server/warmup.py)
        return install_test_faults(scheduler)
    if par.node_rank != 0:
        raise ValueError("only node_rank 0 runs the scheduler; other nodes run run_node_followers")
    if str(config.model.device).startswith("cuda"):  # before NCCL's first collective (server/topology.py)
        from ddtree_serve.model_executor.parallel_state import ranks_per_node
        from ddtree_serve.server.topology import log_topology

        log_topology(ranks_per_node(par))
    addr = par.dist_init_addr or free_local_addr()
    followers = start_followers(config, addr)
    try:
        tp = init_tp(par, 0, config.model.device, addr)  # start-up timeouts until end_startup
        scheduler = TPScheduler(Scheduler(config, tp=tp), tp, followers)
        warm_up(scheduler.scheduler)  # as every follower does, before the steady-state timeouts
        end_startup(tp)
        scheduler.start_agreement()  # the TP step agreement (ddtree_serve/server/tp/step_agreement.py)
        return install_test_faults(scheduler)
    except BaseException as e:
        dead = [f"rank {rank_of(p)} exited with status {p.exitcode}" for p in followers if not p.is_alive()]
        for p in followers:
            p.kill()
        stop_followers(followers, 2.0)
        if dead and isinstance(e, Exception):
            raise TPRankError(f"TP startup failed: {'; '.join(dead)} ({type(e).__name__}: {e})") from e
        raise
