"""Weight quantization formats. Today: compressed-tensors ``pack-quantized`` INT4 (Kimi K2.x experts).

``Int4Config.from_model_dir`` reads ``quantization_config`` (top level of config.json, or inside
``text_config``) without needing the compressed-tensors package. ``PackedWeightAssembler`` gathers the
three tensors of each quantized linear while weights stream in (in any order) and hands back the dense
weight once all three arrived: the CPU path dequantizes at load. See ``int4_pack`` for the bit layout and
the CUDA path choice.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ddtree_serve.model_executor.quantization.int4_pack import dequantize_int4, pack_quantized, packed_nbytes

__all__ = ["Int4Config", "PackedWeightAssembler", "dequantize_int4", "pack_quantized", "packed_nbytes",
           "PACKED_SUFFIXES"]

PACKED_SUFFIXES = ("weight_packed", "weight_scale", "weight_shape")


@dataclass(frozen=True)
class Int4Config:
    """A compressed-tensors pack-quantized INT4 scheme: which modules are quantized and how."""

    group_size: int = 32
    num_bits: int = 4
    symmetric: bool = True
    targets: tuple[str, ...] = ("Linear",)
    ignore: tuple[str, ...] = field(default_factory=tuple)  # module names or "re:<regex>"

    @classmethod
    def from_hf(cls, qc: dict[str, Any] | None) -> Int4Config | None:
        """Parse a ``quantization_config`` dict; None when absent. Raises on a scheme we cannot serve."""
        if not qc:
            return None
        if qc.get("quant_method") != "compressed-tensors" or qc.get("format") != "pack-quantized":
            raise ValueError(f"unsupported quantization_config: method={qc.get('quant_method')!r} "
                             f"format={qc.get('format')!r} (only compressed-tensors pack-quantized INT4)")
        groups = list((qc.get("config_groups") or {}).values())
        if len(groups) != 1:
            raise ValueError(f"expected one compressed-tensors config group, got {len(groups)}")
        w = groups[0].get("weights") or {}
        cfg = cls(group_size=int(w.get("group_size") or 32), num_bits=int(w.get("num_bits", 4)),
                  symmetric=bool(w.get("symmetric", True)), targets=tuple(groups[0].get("targets") or ("Linear",)),
                  ignore=tuple(qc.get("ignore") or ()))
        if cfg.num_bits != 4 or not cfg.symmetric or w.get("type", "int") != "int" or w.get("strategy") not in (
                None, "group"):
            raise ValueError(f"unsupported INT4 weight scheme {w}")
        if groups[0].get("input_activations"):
            raise ValueError("activation quantization is not supported (W4A16 only)")
        return cfg

    @classmethod
    def from_model_dir(cls, path: str | Path) -> Int4Config | None:
        full = json.loads((Path(path) / "config.json").read_text())
        return cls.from_hf(full.get("quantization_config") or (full.get("text_config") or {}).get(
            "quantization_config"))

    def is_quantized(self, module_name: str) -> bool:
        """Whether a Linear named ``module_name`` (checkpoint naming) is quantized under this scheme."""
        for pat in self.ignore:
            if pat.startswith("re:"):
                if re.match(pat[3:], module_name):
                    return False
            elif module_name == pat:
                return False
        return True


class PackedWeightAssembler:
    """Collects ``<module>.weight_packed/weight_scale/weight_shape`` and returns ``<module>.weight`` dense.

    Invariant: every module handed to ``feed`` eventually completes; ``finish`` raises on leftovers so a
    truncated checkpoint is an error, never a silently random expert.
    """

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self._pending: dict[str, dict[str, torch.Tensor]] = {}

    @staticmethod
    def is_packed(name: str) -> bool:
        return name.rsplit(".", 1)[-1] in PACKED_SUFFIXES

    def feed(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        """Add one packed tensor; returns (``<module>.weight``, dense) when its module is complete."""
        module, suffix = name.rsplit(".", 1)
        parts = self._pending.setdefault(module, {})
        parts[suffix] = tensor
        if len(parts) < len(PACKED_SUFFIXES):
            return None
        del self._pending[module]
        if not all(isinstance(t, torch.Tensor) for t in parts.values()):  # lazy slices: dequantize on narrow
            from ddtree_serve.model_executor.quantization.lazy_int4 import LazyPackedInt4
            from ddtree_serve.model_executor.weight_loader import materialize

            shape = tuple(int(x) for x in materialize(parts["weight_shape"]).tolist())
            return f"{module}.weight", LazyPackedInt4(parts["weight_packed"], parts["weight_scale"], shape,
                                                      self.dtype)
        dense = dequantize_int4(parts["weight_packed"], parts["weight_scale"], parts["weight_shape"], self.dtype)
        return f"{module}.weight", dense

    def finish(self) -> None:
        if self._pending:
            some = sorted(self._pending)[:4]
            raise ValueError(f"incomplete pack-quantized weights (missing parts) for {some}")
