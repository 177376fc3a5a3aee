"""Iterate checkpoint tensors from safetensors files, with a progress bar."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm


def safetensors_files(path: str) -> list[Path]:
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"model_path {path!r} holds no *.safetensors files")
    return files


def iter_weights(path: str, desc: str = "Loading weights", skip_prefixes: tuple[str, ...] = ()) -> Iterator[
        tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor under ``path``; names starting with a skip prefix are skipped."""
    files = safetensors_files(path)
    handles = [safe_open(str(f), framework="pt") for f in files]
    names = [(h, k) for h in handles for k in h.keys()]
    for h, k in tqdm(names, desc=desc, unit="tensor", leave=False, mininterval=1.0):
        if skip_prefixes and k.startswith(skip_prefixes):
            continue
        yield k, h.get_tensor(k)
