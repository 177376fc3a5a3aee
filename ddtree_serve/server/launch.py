"""Start the server: scheduler and detokenizer processes, HTTP (FastAPI + uvicorn) in this process.

Processes talk over ZMQ ``ipc://`` sockets in a private temporary directory. /health answers 503 until the
scheduler has loaded the model, then 200. SIGTERM drains first (ddtree_serve/server/drain.py: no new requests,
those in flight finish for up to --shutdown-timeout seconds, the rest end with their API's final event);
SIGINT, or a second SIGTERM, stops uvicorn at once; then the children stop (SIGTERM, then SIGKILL after a
grace period); children also die with the parent (PR_SET_PDEATHSIG). If a child dies, the
server answers 503 for a moment, then exits with status 1.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
import signal
import tempfile
import threading
from multiprocessing.connection import wait as wait_sentinels

from ddtree_serve.server.config import ServerConfig
from ddtree_serve.server.io_struct import IpcEndpoints

logger = logging.getLogger(__name__)

CHILD_STOP_TIMEOUT = 5.0
DEAD_CHILD_GRACE = 1.0


class _Terminated(Exception):
    pass


def _raise_terminated(signum: int, frame: object) -> None:
    raise _Terminated()


def launch_server(config: ServerConfig) -> int:
    """Run until stopped; return the process exit status (0 after a signal, 1 if a child died)."""
    import uvicorn

    from ddtree_serve.server.detokenizer import run_detokenizer_process
    from ddtree_serve.server.drain import DrainingServer
    from ddtree_serve.server.http.api import create_app
    from ddtree_serve.server.http.metrics import ServerMetrics
    from ddtree_serve.server.process_utils import load_tokenizer
    from ddtree_serve.server.scheduling.scheduler_process import run_scheduler_process
    from ddtree_serve.server.startup import check_kimi_tokenizer, resolve_config
    from ddtree_serve.server.tokenizer_manager import TokenizerManager

    logging.basicConfig(level=config.server.log_level.upper(), format="[%(asctime)s http] %(levelname)s %(message)s")
    served = config.model.served_model_name or config.model.model_path
    config = resolve_config(config)  # paths and device, once, before any process starts (ddtree_serve/server/startup.py)
    if config.parallel.node_rank > 0:  # multi-node TP: this node only runs its ranks (docs/PARALLEL.md)
        from ddtree_serve.server.tp.spawn import run_node_followers

        return run_node_followers(config)
    config = config.replace("model", served_model_name=served)
    resolved = config.model.model_path
    tokenizer = load_tokenizer(resolved, config.model.trust_remote_code)
    check_kimi_tokenizer(config, tokenizer)  # the Kimi parsers' special tokens, before any process starts
    tmpdir = tempfile.mkdtemp(prefix="ddtree-serve-")
    endpoints = IpcEndpoints.in_dir(tmpdir)
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=run_scheduler_process, args=(config, endpoints, os.getpid()), name="scheduler"),
        ctx.Process(target=run_detokenizer_process,
                    args=(resolved, config.model.trust_remote_code, endpoints, os.getpid()), name="detokenizer"),
    ]
    exit_code = 0
    previous_term = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        for p in procs:
            p.start()
        tm = TokenizerManager(config, endpoints, tokenizer, ServerMetrics(served))
        app = create_app(config, tm)
        server = DrainingServer(uvicorn.Config(app, host=config.server.host, port=config.server.port,
                                               log_level=config.server.log_level, loop="asyncio",
                                               timeout_graceful_shutdown=3), tm, config.server.shutdown_timeout)
        stop_watch = threading.Event()
        died: list[str] = []

        def watch() -> None:
            sentinels = {p.sentinel: p for p in procs}
            while not stop_watch.is_set():
                ready = wait_sentinels(list(sentinels), timeout=0.5)
                if ready and not stop_watch.is_set():
                    p = sentinels[ready[0]]
                    died.append(f"{p.name} process exited with status {p.exitcode}")
                    tm.mark_dead_threadsafe(f"the {died[0]}; the server is shutting down")
                    stop_watch.wait(DEAD_CHILD_GRACE)
                    server.should_exit = True
                    return

        watcher = threading.Thread(target=watch, name="child-watch", daemon=True)
        watcher.start()
        logger.info("serving %s on http://%s:%d (model loading ...)", served, config.server.host, config.server.port)
        try:
            server.run()
        except (KeyboardInterrupt, _Terminated):
            pass
        stop_watch.set()
        if died:
            logger.error("%s", died[0])
            exit_code = 1
    except (KeyboardInterrupt, _Terminated):
        pass
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second signal must not interrupt the cleanup
        stop_processes(procs)
        shutil.rmtree(tmpdir, ignore_errors=True)
        signal.signal(signal.SIGTERM, previous_term)
    return exit_code


def stop_processes(procs: list[mp.Process], timeout: float = CHILD_STOP_TIMEOUT) -> None:
    """SIGTERM each live child, wait, then SIGKILL what is left; reap all."""
    for p in procs:
        if p.pid is not None and p.is_alive():
            p.terminate()
    for p in procs:
        if p.pid is not None:
            p.join(timeout)
            if p.is_alive():
                p.kill()
                p.join(2.0)
