"""This node's follower processes as objects: tie a follower's life to its parent, name its rank, reap them.
The lowest TP file (protocol.py and spawn.py import it; it imports neither)."""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import signal
import sys

FOLLOWER_STOP_TIMEOUT = 10.0


def die_with_parent() -> None:
    """Linux: this process gets SIGKILL when its parent dies (PR_SET_PDEATHSIG)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def stop_followers(procs: list[mp.process.BaseProcess], timeout: float = FOLLOWER_STOP_TIMEOUT) -> None:
    """Wait up to ``timeout`` for each follower to exit, then kill and reap the stragglers."""
    for p in procs:
        p.join(timeout)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(2.0)


def rank_of(p: mp.process.BaseProcess) -> str:
    """The global rank of a follower process (from its name)."""
    return p.name.removeprefix("tp-rank-")
