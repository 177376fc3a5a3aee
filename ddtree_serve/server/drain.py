"""Drain on SIGTERM: stop admitting, let the requests in flight finish, end the rest cleanly, then exit.

Kubernetes sends SIGTERM to the server's main process on every rollout. On that signal the server
- stops admitting: every new request is a 503 with ``Retry-After`` and ``/health`` fails (503), so the
  load balancer takes the replica out;
- lets the requests in flight run on for up to ``--shutdown-timeout`` seconds;
- ends those still running then as the server's own abort (finish reason ``abort``): each stream gets its
  API's final event (chat and completions a chunk with ``finish_reason: "abort"`` and ``data: [DONE]``;
  Messages ``stop_reason: "max_tokens"`` and ``message_stop``; Responses ``response.incomplete``);
- then stops uvicorn, whose graceful shutdown lets those final events reach the clients, and the processes.

A second SIGTERM, or SIGINT, stops at once (uvicorn's own handling). ``DrainingServer`` is a
``uvicorn.Server`` whose SIGTERM handler starts the drain instead of exiting.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from types import FrameType

import uvicorn

from ddtree_serve.server.tokenizer_manager import TokenizerManager

logger = logging.getLogger(__name__)

POLL_S = 0.05


async def drain_requests(tm: TokenizerManager, timeout: float) -> int:
    """Stop admitting, wait up to ``timeout`` seconds for the requests in flight, then abort the rest (their
    consumers get a final ``abort`` output); the number aborted."""
    tm.draining = True
    start = time.monotonic()
    logger.info("SIGTERM: draining %d request(s) in flight for up to %.1f s; new requests get 503",
                len(tm.states), timeout)
    while tm.states and time.monotonic() - start < timeout:
        await asyncio.sleep(POLL_S)
    left = list(tm.states)
    for rid in left:
        tm.abort(rid)
    if left:
        logger.warning("shutdown timeout (%.1f s): ended %d request(s) still running", timeout, len(left))
    else:
        logger.info("drained in %.1f s", time.monotonic() - start)
    return len(left)


class DrainingServer(uvicorn.Server):
    """uvicorn's server with SIGTERM draining ``tm`` first (``drain_requests``) and exiting after."""

    def __init__(self, config: uvicorn.Config, tm: TokenizerManager, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.tm, self.shutdown_timeout = tm, shutdown_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task | None = None
        self._drain_asked = False

    async def serve(self, sockets: list | None = None) -> None:  # type: ignore[override]
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """SIGTERM: start the drain (once); anything else, or a second SIGTERM, is uvicorn's exit."""
        loop = self._loop
        if sig == signal.SIGTERM and not self._drain_asked and not self.should_exit and loop is not None \
                and self.tm.ready and self.tm.dead is None:
            self._captured_signals.append(sig)  # re-raised after the server stops: the launcher's exit path
            self._drain_asked = True
            loop.call_soon_threadsafe(self._start_drain)
            return
        super().handle_exit(sig, frame)

    def _start_drain(self) -> None:
        self._drain = asyncio.ensure_future(self._run_drain())

    async def _run_drain(self) -> None:
        try:
            await drain_requests(self.tm, self.shutdown_timeout)
        finally:
            self.should_exit = True
