"""The sampling defaults of a request that leaves a sampling field out (``--sampling-defaults``).

``model`` (the default, as SGLang's ``--sampling-defaults model`` and vLLM's ``--generation-config auto``):
``temperature``, ``top_p``, ``top_k``, ``min_p`` and ``repetition_penalty`` come from the checkpoint's
``generation_config.json`` where it sets them (its other keys, ``do_sample`` included, are not read: a request
without ``temperature`` samples at the checkpoint's temperature, as in SGLang and vLLM); a field it does not set,
or a file that is missing, falls back to OpenAI's default. ``openai``: OpenAI's defaults always (temperature 1,
top_p 1, no top_k / min_p / repetition penalty). A value the server would refuse in a request (out of range, not
a number) is left out and logged. A request's own value, null aside, always wins.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def _valid(name: str, value: Any) -> int | float | None:
    """``value`` as a request's ``name`` (HF's top_k 0 = off is -1 here); None where a request could not send it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    if name == "top_k":
        if value != int(value):
            return None
        k = int(value)
        return -1 if k == 0 else k if k >= 1 or k == -1 else None
    ok = {"temperature": value >= 0, "top_p": 0 < value <= 1, "min_p": 0 <= value <= 1,
          "repetition_penalty": 0 < value <= 2}[name]
    return float(value) if ok else None


def model_sampling_defaults(model_dir: str | None) -> dict[str, int | float]:
    """The sampling fields ``model_dir``'s generation_config.json sets (none: ``{}``)."""
    path = Path(model_dir or "") / "generation_config.json"
    try:
        loaded = json.loads(path.read_text()) if model_dir else {}
    except (OSError, ValueError):
        return {}
    out: dict[str, int | float] = {}
    for name in SAMPLING_FIELDS:
        if isinstance(loaded, dict) and loaded.get(name) is not None:
            value = _valid(name, loaded[name])
            if value is None:
                logger.warning("generation_config.json: %s %r is not a value a request may send; not used",
                               name, loaded[name])
            else:
                out[name] = value
    return out


def sampling_defaults(mode: str, model_dir: str | None) -> dict[str, int | float]:
    """The defaults in force for ``--sampling-defaults mode`` (``{}``: OpenAI's)."""
    return model_sampling_defaults(model_dir) if mode == "model" else {}


def describe(mode: str, defaults: dict[str, int | float]) -> str:
    """One line for the start-up log."""
    if mode == "openai":
        return "sampling defaults: OpenAI's (--sampling-defaults openai)"
    if not defaults:
        return "sampling defaults: OpenAI's (generation_config.json sets no sampling field)"
    return "sampling defaults from generation_config.json: " + ", ".join(f"{k}={v}" for k, v in defaults.items())
