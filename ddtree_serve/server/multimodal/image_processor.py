"""Kimi K2.5 / K2.6 image preprocessing (MoonViT's NaViT-style input): decode, resize within the patch limits,
pad, normalise, patchify. Pure functions over PIL / numpy; no model needed.

Rules (the checkpoint's ``preprocessor_config.json`` ``media_proc_cfg``; defaults are the published ones):
- scale = min(1, sqrt(in_patch_limit / (max(1, W // p) * max(1, H // p))), side * p / W, side * p / H) with
  p = patch_size (14), side = patch_limit_on_one_side (512), in_patch_limit 16384; the image is resized
  (bicubic) to (max(1, int(W * scale)), max(1, int(H * scale))), each at most side * p;
- then padded with black at the right and bottom up to a multiple of p * merge (28): a grid of
  h x w patches (h = H' / 14, w = W' / 14), and (h / 2) * (w / 2) image tokens after the 2x2 merge;
- pixels are normalised as (x / 255 - mean) * (1 / std) (mean = std = 0.5: [-1, 1]) in float32 and cut into
  patches [h * w, 3, 14, 14], row-major over the grid.
"""

from __future__ import annotations

import hashlib
import io
import math
from dataclasses import dataclass

import numpy as np
import torch

from ddtree_serve.model_executor.models.moonvit import read_media_config

IMAGE_FORMATS = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp"}


class ImageError(ValueError):
    """An image or video the server cannot take (corrupt, unsupported format, too large): a 400. ``where``:
    the part of the request that holds it (``messages[0].content[1].image_url.url``), when known."""

    where: str = ""


@dataclass(frozen=True)
class ImageProcessorConfig:
    patch_size: int = 14
    merge_kernel: int = 2
    in_patch_limit: int = 16384
    patch_limit_on_one_side: int = 512
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)

    @classmethod
    def from_model_dir(cls, path: str, patch_size: int = 14, merge_kernel: int = 2) -> ImageProcessorConfig:
        """``media_proc_cfg`` of ``preprocessor_config.json`` when the checkpoint has one, else the defaults
        (with the tower's patch size and merge kernel)."""
        base = cls(patch_size=patch_size, merge_kernel=merge_kernel)
        cfg = read_media_config(path)
        return cls(patch_size=int(cfg.get("patch_size", base.patch_size)),
                   merge_kernel=int(cfg.get("merge_kernel_size", base.merge_kernel)),
                   in_patch_limit=int(cfg.get("in_patch_limit", base.in_patch_limit)),
                   patch_limit_on_one_side=int(cfg.get("patch_limit_on_one_side", base.patch_limit_on_one_side)),
                   image_mean=tuple(float(x) for x in cfg.get("image_mean", base.image_mean)),
                   image_std=tuple(float(x) for x in cfg.get("image_std", base.image_std)))


@dataclass(frozen=True)
class ResizePlan:
    width: int  # after the resize, before padding
    height: int
    pad_width: int
    pad_height: int
    grid: tuple[int, int]  # patches (rows, cols) of the padded image
    num_tokens: int  # image tokens after the merge


def plan_resize(width: int, height: int, cfg: ImageProcessorConfig) -> ResizePlan:
    """The resize and padding of a ``width`` x ``height`` image (module docstring)."""
    p, side = cfg.patch_size, cfg.patch_limit_on_one_side
    s1 = math.sqrt(cfg.in_patch_limit / (max(1.0, width // p) * max(1.0, height // p)))
    scale = min(1.0, s1, side * p / width, side * p / height)
    w = min(max(1, int(width * scale)), side * p)
    h = min(max(1, int(height * scale)), side * p)
    unit = p * cfg.merge_kernel
    pad_w, pad_h = (unit - w % unit) % unit, (unit - h % unit) % unit
    rows, cols = (h + pad_h) // p, (w + pad_w) // p
    return ResizePlan(w, h, pad_w, pad_h, (rows, cols), (rows // cfg.merge_kernel) * (cols // cfg.merge_kernel))


def decode_image(data: bytes, max_pixels: int):
    """Bytes of a PNG / JPEG / WebP image -> an RGB ``PIL.Image``; ImageError when it is not one, is
    corrupt, or has more than ``max_pixels`` pixels (checked from the header, before decoding)."""
    from PIL import Image

    try:
        img = Image.open(io.BytesIO(data))
    except Exception as e:  # noqa: BLE001 - PIL raises many kinds for bad bytes: all are a bad image
        raise ImageError(f"the image cannot be decoded: {e or type(e).__name__}") from None
    if img.format not in IMAGE_FORMATS:
        raise ImageError(f"image format {img.format!r} is not supported; send PNG, JPEG or WebP")
    w, h = img.size
    if w < 1 or h < 1:
        raise ImageError("the image is empty")
    if w * h > max_pixels:
        raise ImageError(f"the image has {w} x {h} = {w * h} pixels, more than the limit of {max_pixels} "
                         "(--max-image-pixels)")
    try:
        img.load()
        return img.convert("RGB")
    except Exception as e:  # noqa: BLE001 - truncated or corrupt data, in whatever form PIL reports it
        raise ImageError(f"the image is corrupt: {e or type(e).__name__}") from None


def preprocess(img, cfg: ImageProcessorConfig) -> tuple[torch.Tensor, tuple[int, int, int], int]:
    """An RGB image -> (pixel values [h * w, 3, p, p] float32, grid (1, h, w), image tokens)."""
    from PIL import Image

    plan = plan_resize(img.width, img.height, cfg)
    arr = np.asarray(img.resize((plan.width, plan.height), resample=Image.Resampling.BICUBIC))  # [H, W, 3] uint8
    arr = np.pad(arr, ((0, plan.pad_height), (0, plan.pad_width), (0, 0)))
    x = (arr / 255.0).astype(np.float32)
    x -= np.asarray(cfg.image_mean)
    x *= 1.0 / np.asarray(cfg.image_std)
    p = cfg.patch_size
    rows, cols = plan.grid
    patches = x.reshape(rows, p, cols, p, 3).transpose(0, 2, 4, 1, 3).reshape(rows * cols, 3, p, p)
    return torch.from_numpy(np.ascontiguousarray(patches)), (1, rows, cols), plan.num_tokens


def content_hash(pixel_values: torch.Tensor, grid: tuple[int, int, int]) -> int:
    """A 63-bit hash of the preprocessed image (pixels and grid): equal for the same image resent, whatever
    its encoding or URL; the prefix cache keys the image's tokens by it."""
    h = hashlib.blake2b(digest_size=8)
    h.update(np.asarray(grid, dtype=np.int64).tobytes())
    h.update(pixel_values.contiguous().numpy().tobytes())
    return int.from_bytes(h.digest(), "little") >> 1
