"""The scheduler process: a ZMQ loop around ``Scheduler``.

While there is work it polls its input without blocking, runs one scheduler step and sends the step's
outputs to the detokenizer; when idle it blocks on the input (briefly, to notice shutdown). A bad request
becomes a TokenOut with ``error`` (or a RequestError for failures inside the server); it never stops the
loop. A step that raises fails only its batch's requests (HTTP 500 to their clients, their KV freed:
ddtree_serve/server/scheduling/step_recovery.py) and the loop goes on, on one process and under tensor parallelism (every rank
fails the same step: ddtree_serve/server/tp/protocol.py); only a sticky device error, a broken TP world (a dead rank,
a failed collective, ranks that diverged or disagree on a step's outcome) or a failure of the recovery
itself ends the process, and with it the server. Scheduler stats go out at most every ``STATS_INTERVAL`` seconds while busy and once on going idle.
"""

from __future__ import annotations

import logging
import os
import time
import traceback

import zmq

from ddtree_serve.server.config import ServerConfig
from ddtree_serve.server.io_struct import (
    AbortReq,
    BatchTokenOut,
    IpcEndpoints,
    ProcessFailed,
    RequestError,
    SchedulerReady,
    TokenizedGenerateReq,
    TokenOut,
)
from ddtree_serve.server.process_utils import ChildGuard
from ddtree_serve.server.scheduling.request import rejection_param
from ddtree_serve.server.scheduling.scheduler_factory import SchedulerLike

logger = logging.getLogger(__name__)

STATS_INTERVAL = 0.25
IDLE_POLL_MS = 200


class SchedulerLoop:
    """Receives requests, steps the scheduler, sends its outputs. With ``overlap`` (the default; SGLang's overlap
    scheduling, ``--disable-overlap-schedule`` turns it off) the host work that needs no result of the running
    step runs while the device runs its forward (``Scheduler.set_host_window``): sending the previous step's
    outputs (so they stream one step later) and, in a single process, taking in new requests (aborts wait for
    the step's end: they change the running batch)."""

    def __init__(self, scheduler: SchedulerLike, recv: zmq.Socket, send: zmq.Socket, guard: ChildGuard,
                 overlap: bool = True) -> None:
        self.scheduler = scheduler
        self.recv = recv
        self.send = send
        self.guard = guard
        self.inflight: set[str] = set()
        self._last_stats = None
        self._last_stats_time = 0.0
        self._pending: list[TokenOut] = []  # the last step's outputs, sent in the next step's window
        self._in_step = False
        self._deferred_aborts: list[str] = []  # aborts received inside a step, applied after it
        self._intake_in_window = scheduler.takes_requests_mid_step
        if overlap:
            scheduler.set_host_window(self._window)

    def run(self) -> None:
        while not self.guard.should_stop():
            busy = self.scheduler.has_work()
            if self.recv.poll(0 if busy else IDLE_POLL_MS):
                self._drain()
            if self.scheduler.has_work():
                self._step()
            if not self.scheduler.has_work():
                self._flush()  # no step will open a window soon
            self._maybe_send_stats()

    def _window(self) -> None:
        """The overlap window: runs inside a step while the device works."""
        self._flush()
        if self._intake_in_window and self.recv.poll(0):
            self._drain()

    def _flush(self) -> None:
        if self._pending:
            outs, self._pending = self._pending, []
            self.send.send_pyobj(BatchTokenOut(outs))

    def _drain(self) -> None:
        while True:
            try:
                msg = self.recv.recv_pyobj(zmq.NOBLOCK)
            except zmq.Again:
                return
            if isinstance(msg, TokenizedGenerateReq):
                self._add(msg)
            elif isinstance(msg, AbortReq):
                if self._in_step:
                    self._deferred_aborts.append(msg.rid)
                else:
                    self._abort(msg.rid)
            else:
                logger.warning("unexpected message %s", type(msg).__name__)

    def _add(self, msg: TokenizedGenerateReq) -> None:
        rid = msg.req.rid
        self.send.send_pyobj(msg.detokenize)  # always ahead of the request's first output
        try:
            msg.req.params.validate()
            self.scheduler.add_request(msg.req)
        except ValueError as e:  # a refusal: a 400 naming the field (ddtree_serve/server/scheduling/request.py)
            self.send.send_pyobj(BatchTokenOut([TokenOut(rid, [], finished=True, error=str(e),
                                                         prompt_tokens=len(msg.req.input_ids),
                                                         error_param=rejection_param(e, msg.req.params))]))
            return
        except Exception as e:  # noqa: BLE001
            logger.exception("add_request(%s) failed", rid)
            self.send.send_pyobj(RequestError(rid, f"internal error: {type(e).__name__}", 500))
            return
        self.inflight.add(rid)

    def _abort(self, rid: str) -> None:
        if rid not in self.inflight:
            return
        try:
            self.scheduler.abort_request(rid)
        except Exception:  # noqa: BLE001
            logger.exception("abort_request(%s) failed", rid)

    def _step(self) -> None:
        from ddtree_serve.server.scheduling.step_recovery import is_fatal

        self._in_step = True
        try:
            outs = self.scheduler.step()
        except Exception as e:  # noqa: BLE001
            if is_fatal(e):
                raise  # the device or the TP world cannot be trusted any more: the server answers 503 and exits
            logger.error("scheduler step failed:\n%s", traceback.format_exc())
            self._flush()  # the previous step's outputs go ahead of this step's errors
            self._fail_step(e)
            return
        finally:
            self._in_step = False
            aborts, self._deferred_aborts = self._deferred_aborts, []
            for rid in aborts:
                self._abort(rid)
        self._flush()  # a step that opened no window (no forward): its predecessor's outputs go now
        if outs:
            for o in outs:
                if o.finished:
                    self.inflight.discard(o.rid)
            self._pending = outs

    def _fail_step(self, error: Exception) -> None:
        """Fail the requests of the step's batch (their KV freed; ddtree_serve/server/scheduling/step_recovery.py); every other
        request keeps running. Outputs the step produced for other requests go out with the next step."""
        from ddtree_serve.server.scheduling.step_recovery import orphaned_rids

        failed = self.scheduler.fail_step()
        failed += [rid for rid in orphaned_rids(self.scheduler, self.inflight) if rid not in failed]
        where = f"on TP rank(s) {', '.join(map(str, error.ranks))} " if getattr(error, "ranks", ()) else ""
        message = f"internal error: the scheduler step running this request failed {where}({type(error).__name__})"
        for rid in failed:
            self.send.send_pyobj(RequestError(rid, message, 500))
            self.inflight.discard(rid)
        logger.error("failed %d request(s) of the failed step: %s", len(failed), ", ".join(failed))

    def _maybe_send_stats(self) -> None:
        now = time.monotonic()
        busy = self.scheduler.has_work()
        if busy and now - self._last_stats_time < STATS_INTERVAL:
            return
        stats = self.scheduler.stats()
        if not busy and stats == self._last_stats:
            return
        self.send.send_pyobj(stats)
        self._last_stats, self._last_stats_time = stats, now


def run_scheduler_process(config: ServerConfig, endpoints: IpcEndpoints, parent_pid: int) -> None:
    """Entry point of the scheduler process; ``config`` is resolved (ddtree_serve/server/startup.py)."""
    guard = ChildGuard("scheduler", parent_pid, config.server.log_level)
    ctx = zmq.Context()
    recv = ctx.socket(zmq.PULL)
    recv.bind(endpoints.scheduler_input)
    send = ctx.socket(zmq.PUSH)
    send.connect(endpoints.detokenizer_input)
    try:
        from ddtree_serve.server.scheduling.scheduler_factory import make_scheduler

        scheduler = make_scheduler(config)  # tp_size > 1: rank 0 of the TP world, followers spawned here
        send.send_pyobj(SchedulerReady(int(scheduler.max_context_len), tuple(scheduler.eos_token_ids),
                                       config.model.model_path, int(scheduler.vocab_size)))
    except Exception as e:  # noqa: BLE001
        logger.error("cannot start the scheduler:\n%s", traceback.format_exc())
        send.send_pyobj(ProcessFailed("scheduler", f"cannot start: {type(e).__name__}: {e}"))
        send.close(2000)
        os._exit(1)
    try:
        SchedulerLoop(scheduler, recv, send, guard, overlap=not config.scheduler.disable_overlap_schedule).run()
    except Exception as e:  # noqa: BLE001
        send.send_pyobj(ProcessFailed("scheduler", f"fatal step failure: {type(e).__name__}: {e}"))
        send.close(2000)
        os._exit(1)
    scheduler.close()
    recv.close(0)
    send.close(0)
    ctx.term()
