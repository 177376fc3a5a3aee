"""Small helpers shared by the child processes: signal handling, parent-death guard, tokenizer loading."""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import sys
from pathlib import Path
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


def remote_tokenizer_class(model_path: str) -> str | None:
    """The tokenizer class a local model directory ships as its own code (``auto_map.AutoTokenizer`` in
    tokenizer_config.json, e.g. Kimi's ``TikTokenTokenizer``), or None."""
    cfg_path = Path(model_path) / "tokenizer_config.json"
    if not cfg_path.is_file():
        return None
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError):
        return None  # transformers reports a broken file itself
    ref = (cfg.get("auto_map") or {}).get("AutoTokenizer") if isinstance(cfg, dict) else None
    if isinstance(ref, (list, tuple)):
        ref = next((r for r in ref if r), None)
    return ref if isinstance(ref, str) and ref else None


def check_trust_remote_code(model_path: str, trust_remote_code: bool) -> None:
    """Refuse a tokenizer that exists only as the model's own code when remote code is not trusted.

    Without this, transformers may silently build a generic tokenizer from the vocabulary file instead
    (for a ``tiktoken.model`` it does), with other special-token ids and no chat-template tokens."""
    ref = remote_tokenizer_class(model_path)
    if ref is not None and not trust_remote_code:
        raise ValueError(f"the tokenizer of {model_path} is the model's own code ({ref}): it needs "
                         "trust_remote_code, which is on by default (drop --no-trust-remote-code or "
                         "trust_remote_code=False)")


def load_tokenizer(model_path: str, trust_remote_code: bool = True) -> Any:
    """``AutoTokenizer`` for a local model directory, after ``check_trust_remote_code``."""
    from transformers import AutoTokenizer

    check_trust_remote_code(model_path, trust_remote_code)
    return AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
