"""Resolve the user's model path ("default" = the converted SmolLM2-135M-Instruct)."""

from __future__ import annotations

from pathlib import Path

from model_executor.default_model import ensure_default_model


def resolve_model_path(path: str | None) -> str:
    if path in (None, "", "default"):
        return ensure_default_model()
    if not Path(path).is_dir():
        raise ValueError(f"model_path {path!r} does not exist or is not a directory "
                         "(hub downloads are not supported: pass a local Hugging Face directory)")
    return str(path)
