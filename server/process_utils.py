"""Small helpers shared by the child processes: signal handling, parent-death guard, tokenizer loading."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
from typing import Any

_PR_SET_PDEATHSIG = 1


class ChildGuard:
    """Installs a child's signal policy: SIGINT is ignored (the parent orchestrates shutdown), SIGTERM asks
    the loop to stop, and the kernel kills the child if the parent dies (Linux ``PR_SET_PDEATHSIG``)."""

    def __init__(self, name: str, parent_pid: int, log_level: str = "info") -> None:
        self.name = name
        self.parent_pid = parent_pid
        self._stop = False
        logging.basicConfig(level=log_level.upper(), format=f"[%(asctime)s {name}] %(levelname)s %(message)s")
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, self._on_term)
        if sys.platform.startswith("linux"):
            try:
                ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
            except OSError:
                pass
        if os.getppid() != parent_pid:  # the parent died before the guard was armed
            os._exit(1)

    def _on_term(self, signum: int, frame: object) -> None:
        self._stop = True

    def should_stop(self) -> bool:
        return self._stop or os.getppid() != self.parent_pid


def load_tokenizer(model_path: str, trust_remote_code: bool = True) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
