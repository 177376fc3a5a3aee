"""Image inputs on the HTTP side: which models take them, the image URLs a request may send, the limits,
and the prompt's placeholder expansion. Nothing here reaches the scheduler before every image decoded.

A model takes images when its checkpoint is Kimi K2.5 / K2.6 with a complete ``vision_config`` and a
``media_placeholder_token_id`` that the tokenizer spells ``<|media_pad|>``. A chat message's image part is
rendered by the checkpoint's chat template (ddtree_serve/server/http/chat_images.py; ``IMAGE_MARKER``, Kimi's
marker, is written into the text only for a template that renders no image parts); after tokenization each
image's one placeholder token is expanded to the image's ``num_tokens`` tokens
(image_processor.py), and the request carries the preprocessed pixels (``ddtree_serve.server.io_struct.ImageInput``).

URLs: ``data:image/png|jpeg|webp;base64,...`` only. http(s) URLs are refused with a 400: this server does not
fetch media (deployments here have no outbound network).
"""

from __future__ import annotations

import base64
import binascii
import logging
from dataclasses import dataclass
from typing import Any

from ddtree_serve.model_executor.models.moonvit import read_vision_config
from ddtree_serve.server.io_struct import ImageInput
from ddtree_serve.server.multimodal.image_processor import (
    ImageError,
    ImageProcessorConfig,
    content_hash,
    decode_image,
    preprocess,
)

logger = logging.getLogger(__name__)

IMAGE_MARKER = "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>"
PLACEHOLDER_TOKEN = "<|media_pad|>"
DATA_URL_TYPES = ("image/png", "image/jpeg", "image/jpg", "image/webp")


@dataclass(frozen=True)
class ImageLimits:
    max_images: int  # per request
    max_bytes: int  # per image, decoded from base64
    max_pixels: int  # per image, width x height


@dataclass(frozen=True)
class PreparedImage:
    pixel_values: Any  # torch.Tensor [h * w, 3, p, p]
    grid: tuple[int, int, int]
    num_tokens: int
    content_hash: int


def image_bytes(url: str, max_bytes: int) -> bytes:
    """The image bytes of a ``data:`` URL; ImageError for another scheme, a bad URL or too many bytes."""
    if url.startswith(("http://", "https://")):
        raise ImageError("image URLs are not fetched by this server (it has no network access for media): send "
                         "the image inline as a data: URL, data:image/png;base64,... (PNG, JPEG or WebP)")
    if not url.startswith("data:"):
        raise ImageError("an image URL must be a data: URL, data:image/png;base64,... (PNG, JPEG or WebP)")
    header, sep, payload = url.partition(",")
    params = header[5:].split(";")
    if not sep or params[-1] != "base64":
        raise ImageError("an image data: URL must be base64-encoded (data:image/png;base64,...)")
    if params[0].lower() not in DATA_URL_TYPES:
        raise ImageError(f"image type {params[0]!r} is not supported; send image/png, image/jpeg or image/webp")
    if len(payload) > 4 * (max_bytes // 3 + 1) + 4:
        raise ImageError(f"the image is larger than the limit of {max_bytes} bytes (--max-image-bytes)")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("the image data: URL is not valid base64") from None
    if len(data) > max_bytes:
        raise ImageError(f"the image has {len(data)} bytes, more than the limit of {max_bytes} (--max-image-bytes)")
    return data


class VisionFrontend:
    """One served model's image inputs (None of it for a model without a vision tower)."""

    def __init__(self, processor: ImageProcessorConfig, placeholder_id: int, limits: ImageLimits) -> None:
        self.processor, self.placeholder_id, self.limits = processor, placeholder_id, limits
        self.marker = IMAGE_MARKER

    @classmethod
    def for_model(cls, model_dir: str, tokenizer: Any, limits: ImageLimits) -> VisionFrontend | None:
        """The frontend of the checkpoint at ``model_dir``, or None when it takes no images."""
        try:
            vision, token = read_vision_config(model_dir)
        except (ValueError, KeyError, TypeError, OSError) as e:
            logger.warning("image inputs off: the vision config cannot be read: %s", e)
            return None
        if vision is None or token is None:
            return None
        spelled = tokenizer.convert_tokens_to_ids(PLACEHOLDER_TOKEN) if tokenizer is not None else None
        if spelled != token:
            logger.warning("image inputs off: the tokenizer's %s is %s, not the model's media_placeholder_token_id %d",
                           PLACEHOLDER_TOKEN, spelled, token)
            return None
        proc = ImageProcessorConfig.from_model_dir(model_dir, vision.patch_size, vision.merge_kernel[0])
        return cls(proc, token, limits)

    def load(self, urls: list[str]) -> list[PreparedImage]:
        """Decode and preprocess every image (ImageError at the first one that fails, naming it)."""
        if len(urls) > self.limits.max_images:
            raise ImageError(f"the request has {len(urls)} images, more than the limit of {self.limits.max_images} "
                             "(--max-images-per-request)")
        out = []
        for i, url in enumerate(urls):
            try:
                img = decode_image(image_bytes(url, self.limits.max_bytes), self.limits.max_pixels)
            except ImageError as e:
                raise ImageError(f"image {i}: {e}") from None
            pixels, grid, n = preprocess(img, self.processor)
            out.append(PreparedImage(pixels, grid, n, content_hash(pixels, grid)))
        return out

    def expand(self, ids: list[int], images: list[PreparedImage]) -> tuple[list[int], tuple[ImageInput, ...]]:
        """Expand the i-th placeholder token of ``ids`` to image i's tokens; ImageError when the prompt holds
        another number of placeholders than images (the text itself spelled the placeholder)."""
        where = [i for i, t in enumerate(ids) if t == self.placeholder_id]
        if len(where) != len(images):
            raise ImageError(f"the prompt holds {len(where)} image placeholders for {len(images)} images: message "
                             f"text must not contain {PLACEHOLDER_TOKEN}")
        out: list[int] = []
        inputs = []
        prev = 0
        for pos, im in zip(where, images, strict=True):
            out.extend(ids[prev:pos])
            inputs.append(ImageInput(len(out), im.num_tokens, im.grid, im.pixel_values, im.content_hash))
            out.extend([self.placeholder_id] * im.num_tokens)
            prev = pos + 1
        out.extend(ids[prev:])
        return out, tuple(inputs)
