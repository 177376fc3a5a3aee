"""Test images: seeded random RGB images and their ``data:`` URLs (PNG, JPEG, WebP)."""

from __future__ import annotations

import base64
import io

import numpy as np


def random_image(seed: int, size: tuple[int, int] = (64, 48)):
    """A seeded random RGB ``PIL.Image`` of ``size`` (width, height)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8), "RGB")


def image_bytes(img, fmt: str = "PNG", **save: object) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **save)
    return buf.getvalue()


def data_url(img, fmt: str = "PNG", **save: object) -> str:
    mime = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp", "GIF": "image/gif"}[fmt]
    return f"data:{mime};base64,{base64.b64encode(image_bytes(img, fmt, **save)).decode()}"
