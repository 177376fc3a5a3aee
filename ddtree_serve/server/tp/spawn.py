"""Tensor parallelism for the scheduler, the processes: spawning this node's follower ranks, reaping them,
and the entry point of a follower process (docs/PARALLEL.md; the protocol is in ddtree_serve/server/tp/protocol.py, reaping in processes.py).

Followers die with their parent (PR_SET_PDEATHSIG), ignore SIGINT (rank 0 orchestrates shutdown) and exit
with status 1 when their loop fails.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal

from ddtree_serve.model_executor.parallel_state import destroy_tp, end_startup, init_tp, ranks_per_node
from ddtree_serve.server.config import ServerConfig
from ddtree_serve.server.tp.processes import die_with_parent

logger = logging.getLogger(__name__)

def run_follower(config: ServerConfig, rank: int, init_addr: str, parent_pid: int | None) -> None:
    """Entry point of a follower rank's process; ``config`` is resolved (ddtree_serve/server/startup.py)."""
    logging.basicConfig(level=config.server.log_level.upper(),
                        format=f"[%(asctime)s tp-rank-{rank}] %(levelname)s %(message)s")
    if parent_pid is not None:
        die_with_parent()
        if os.getppid() != parent_pid:
            os._exit(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 orchestrates shutdown
    from ddtree_serve.server.scheduling.fault_injection import install_test_faults
    from ddtree_serve.server.scheduling.scheduler import Scheduler
    from ddtree_serve.server.tp.protocol import follower_loop
    from ddtree_serve.server.tp.step_agreement import StepAgreement
    from ddtree_serve.server.warmup import warm_up

    tp = init_tp(config.parallel, rank, config.model.device, init_addr)  # start-up timeouts until end_startup
    try:
        scheduler = Scheduler(config, tp=tp)
        warm_up(scheduler)  # as rank 0 does (ddtree_serve/server/warmup.py)
        end_startup(tp)
        agreement = StepAgreement.create(tp, config.parallel.startup_timeout_s)  # as rank 0 (start_agreement)
        agreement.install(scheduler)  # after the warm-up, before the fault hook
        follower_loop(install_test_faults(scheduler), tp, agreement)  # the hook: tests only
    except Exception:
        logger.exception("TP rank %d failed", rank)
        os._exit(1)
    destroy_tp(tp)


def start_followers(config: ServerConfig, init_addr: str) -> list[mp.process.BaseProcess]:
    """Spawn this node's follower ranks (all local ranks except global rank 0)."""
    per_node = ranks_per_node(config.parallel)
    first = config.parallel.node_rank * per_node
    ctx = mp.get_context("spawn")
    procs = []
    for rank in range(max(first, 1), first + per_node):
        p = ctx.Process(target=run_follower, args=(config, rank, init_addr, os.getpid()), name=f"tp-rank-{rank}",
                        daemon=True)
        p.start()
        procs.append(p)
    return procs


def run_node_followers(config: ServerConfig) -> int:
    """Multi-node: on a node with node_rank > 0, run this node's ranks until rank 0 shuts them down."""
    if not config.parallel.dist_init_addr:
        raise ValueError("multi-node tensor parallelism needs --dist-init-addr host:port of node 0")
    procs = start_followers(config, config.parallel.dist_init_addr)
    for p in procs:
        p.join()
    return max((abs(p.exitcode or 0) for p in procs), default=0) and 1
