"""Iterate checkpoint tensors from safetensors files, with a progress bar; optionally lazily.

Sharded-loading protocol: with ``lazy=True`` the iterator yields ``LazyWeight`` objects instead of
tensors. A ``LazyWeight`` has ``shape``, ``ndim`` and ``narrow(dim, start, length) -> torch.Tensor`` (like
``torch.Tensor.narrow``, but it reads only that slice from the file, through safetensors' ``get_slice``)
and ``full()``. Every parameter ``weight_loader(param, loaded, shard_id)`` (layers/linear.py, embedding.py,
moe.py) is written against ``shape`` and ``narrow`` only, so it accepts a tensor or a ``LazyWeight``
alike, and a TP rank reads just its own slice. Parameters without a weight_loader are replicated and use
``default_weight_loader``, which reads the whole tensor (``materialize``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from safetensors import safe_open
from tqdm import tqdm


@runtime_checkable
class LazyWeight(Protocol):
    @property
    def shape(self) -> tuple[int, ...]: ...

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor: ...

    def full(self) -> torch.Tensor: ...


class SafetensorsSlice:
    """One checkpoint tensor, read on demand (only the requested slice)."""

    def __init__(self, handle: Any, name: str):
        self._handle, self.name = handle, name
        self._slice = handle.get_slice(name)
        self.shape: tuple[int, ...] = tuple(int(x) for x in self._slice.get_shape())

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        dim = dim % self.ndim
        if start < 0 or length < 0 or start + length > self.shape[dim]:
            raise IndexError(f"{self.name}: slice [{start}, {start + length}) out of range on dim {dim} "
                             f"of {self.shape}")
        index = (slice(None),) * dim + (slice(start, start + length),)
        return self._slice[index]

    def full(self) -> torch.Tensor:
        return self._handle.get_tensor(self.name)

    def __repr__(self) -> str:
        return f"SafetensorsSlice({self.name!r}, shape={self.shape})"


def materialize(t: torch.Tensor | LazyWeight) -> torch.Tensor:
    """The whole tensor (a replicated parameter needs all of it)."""
    return t if isinstance(t, torch.Tensor) else t.full()


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor | LazyWeight) -> None:
    param.data.copy_(materialize(loaded))


def safetensors_files(path: str) -> list[Path]:
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"model_path {path!r} holds no *.safetensors files")
    return files


def iter_weights(path: str, desc: str = "Loading weights", skip_prefixes: tuple[str, ...] = (),
                 lazy: bool = False) -> Iterator[tuple[str, Any]]:
    """Yield (name, tensor) for every tensor under ``path``; names starting with a skip prefix are skipped.
    ``lazy=True`` yields ``SafetensorsSlice`` objects (see the module docstring) instead of tensors."""
    files = safetensors_files(path)
    handles = [safe_open(str(f), framework="pt") for f in files]
    names = [(h, k) for h in handles for k in h.keys()]
    for h, k in tqdm(names, desc=desc, unit="tensor", leave=False, mininterval=1.0):
        if skip_prefixes and k.startswith(skip_prefixes):
            continue
        yield k, (SafetensorsSlice(h, k) if lazy else h.get_tensor(k))


def load_param(params: dict[str, torch.nn.Parameter], target: str, tensor, shard: object, what: str) -> None:
    """Copy one checkpoint tensor (or lazy slice) into ``params[target]`` through its ``weight_loader``
    (sharded parameters) or ``default_weight_loader``; ValueError when ``target`` is not a parameter."""
    if target not in params:
        raise ValueError(f"unexpected weight {target!r} in {what}")
    p = params[target]
    loader = getattr(p, "weight_loader", None)
    if loader is not None:
        loader(p, tensor, shard)
    else:
        default_weight_loader(p, tensor)


def load_named_weights(params: dict[str, torch.nn.Parameter], weights, stacked: tuple, what: str = "checkpoint",
                       skip_prefixes: tuple[str, ...] = (), tied: dict[str, str] | None = None) -> None:
    """Copy checkpoint tensors into ``params`` (names without the ``model.`` prefix). ``stacked`` maps
    checkpoint sub-names onto merged parameters: ``(src, dst, shard_id)``, e.g. ``("q_proj", "qkv_proj",
    "q")``. ``tied`` names parameters that receive a copy of another (``{"embed_tokens.weight":
    "lm_head.weight"}``). Raises ValueError on an unexpected or a missing weight."""
    loaded: set[str] = set()
    tied = tied or {}
    for name, tensor in weights:
        name = name.removeprefix("model.")
        if "rotary_emb" in name or (skip_prefixes and name.startswith(skip_prefixes)):
            continue
        shard = None
        for src, dst, sid in stacked:
            if f".{src}." in name:
                name, shard = name.replace(f".{src}.", f".{dst}."), sid
                break
        targets = [name] + ([tied[name]] if name in tied else [])
        for target in targets:
            load_param(params, target, tensor, shard, what)
            loaded.add(target)
    missing = set(params) - loaded
    if missing:
        raise ValueError(f"{what} is missing weights: {sorted(missing)[:8]}")
