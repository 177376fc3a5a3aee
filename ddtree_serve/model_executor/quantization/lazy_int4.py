"""A pack-quantized INT4 weight that dequantizes only the slice a TP rank asks for.

``LazyPackedInt4`` follows the lazy-weight protocol of ``ddtree_serve.model_executor.weight_loader`` (``shape``,
``narrow(dim, start, length) -> Tensor``, ``full()``) over the three checkpoint parts (``weight_packed``
int32 ``[out, in / 8]``, ``weight_scale`` ``[out, in / group]``, the dense ``(out, in)``), each itself a
tensor or a lazy slice:
- rows (dim 0, output features): the same rows of ``weight_packed`` and ``weight_scale``;
- columns (dim 1, input features): the whole quantization groups covering ``[start, start + length)``
  (whole int32 words, since a group is a multiple of 8 values), dequantized, then trimmed.
So a rank never reads another rank's expert slice beyond the edges of one group.
"""

from __future__ import annotations

from typing import Any

import torch

from ddtree_serve.model_executor.quantization.int4_pack import PACK_FACTOR, dequantize_int4


def _narrow(t: Any, dim: int, start: int, length: int) -> torch.Tensor:
    return t.narrow(dim, start, length)


def _full(t: Any) -> torch.Tensor:
    return t if isinstance(t, torch.Tensor) else t.full()


class LazyPackedInt4:
    def __init__(self, packed: Any, scale: Any, shape: tuple[int, int], dtype: torch.dtype):
        self.packed, self.scale, self.dtype = packed, scale, dtype
        self.shape: tuple[int, int] = (int(shape[0]), int(shape[1]))
        n_groups = int(tuple(scale.shape)[-1])
        if self.shape[1] % n_groups:
            raise ValueError(f"weight_scale {tuple(scale.shape)} does not tile input dim {self.shape[1]}")
        self.group = self.shape[1] // n_groups

    @property
    def ndim(self) -> int:
        return 2

    def full(self) -> torch.Tensor:
        return dequantize_int4(_full(self.packed), _full(self.scale), self.shape, self.dtype)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        out_f, in_f = self.shape
        dim %= 2
        if dim == 0:
            return dequantize_int4(_narrow(self.packed, 0, start, length), _narrow(self.scale, 0, start, length),
                                   (length, in_f), self.dtype)
        if self.group % PACK_FACTOR:  # groups do not align with int32 words: read everything
            return self.full().narrow(1, start, length)
        g0, g1 = start // self.group, -(-(start + length) // self.group)
        words = self.group // PACK_FACTOR
        dense = dequantize_int4(_narrow(self.packed, 1, g0 * words, (g1 - g0) * words),
                                _narrow(self.scale, 1, g0, g1 - g0), (out_f, (g1 - g0) * self.group), self.dtype)
        return dense.narrow(1, start - g0 * self.group, length)
