"""Image and video inputs on the HTTP side: which models take them, the URLs a request may send, the limits,
and the prompt's placeholder expansion. Nothing here reaches the scheduler before every medium decoded.

A model takes images when its checkpoint is Kimi K2.5 / K2.6 with a complete ``vision_config`` and a
``media_placeholder_token_id`` that the tokenizer spells ``<|media_pad|>``; it takes video as well when its
tower declares temporal positions for a whole chunk (``init_pos_emb_time`` >= the preprocessor's
``temporal_merge_kernel_size``; video.py). A chat message's image part is rendered by the checkpoint's chat
template (ddtree_serve/server/http/chat_images.py; ``IMAGE_MARKER``, Kimi's marker, is written into the text
only for a template that renders no image parts); a video part renders as the checkpoint's video placeholder
(``video_placeholder`` of config.json), which the video's chunk prompts replace before tokenization. After
tokenization each image's and each video chunk's one placeholder token is expanded to its ``num_tokens``
tokens (image_processor.py, video.py), and the request carries the preprocessed pixels
(``ddtree_serve.server.io_struct.ImageInput``; a video chunk is one with ``t`` > 1 frames).

URLs: ``data:`` URLs (``image/png|jpeg|webp``; ``video/mp4|webm|...``), and http(s) URLs fetched by
media_fetch.py from hosts ``--allowed-media-domains`` lists (none by default: refused with a 400).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
from dataclasses import dataclass
from pathlib import Path
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
from ddtree_serve.server.multimodal.media_fetch import MediaFetcher
from ddtree_serve.server.multimodal.video import (
    VIDEO_DATA_TYPES,
    VideoLimits,
    VideoProcessorConfig,
    prepare_video,
)

logger = logging.getLogger(__name__)

IMAGE_MARKER = "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>"
PLACEHOLDER_TOKEN = "<|media_pad|>"
DATA_URL_TYPES = ("image/png", "image/jpeg", "image/jpg", "image/webp")
VIDEO_PLACEHOLDER = "<|kimi_k25_video_placeholder|>"  # Kimi K2.5's config.json default


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


@dataclass(frozen=True)
class MediaRef:
    """One media part of a request: ``kind`` "image" or "video", its URL, and where the request holds it
    (``messages[0].content[1]``), which a 400 names."""

    kind: str
    url: str
    where: str = ""


@dataclass(frozen=True)
class PreparedVideo:
    chunks: tuple[PreparedImage, ...]  # in order; each a t-frame chunk for MoonViT
    prompt: str  # the chunks' prompts, concatenated: what replaces the video placeholder


def image_bytes(url: str, max_bytes: int, kind: str = "image") -> bytes:
    """The bytes of a ``data:`` URL of ``kind`` ("image" or "video"); ImageError for an http(s) URL (this
    function fetches none), another scheme, a bad URL or too many bytes."""
    types, flag = (DATA_URL_TYPES, "--max-image-bytes") if kind == "image" else (VIDEO_DATA_TYPES, "--max-video-bytes")
    example = "data:image/png;base64,... (PNG, JPEG or WebP)" if kind == "image" else "data:video/mp4;base64,..."
    if url.startswith(("http://", "https://")):
        raise ImageError(f"{kind} URLs are not fetched by this server unless the operator allows their hosts with "
                         f"--allowed-media-domains: send the {kind} inline as a data: URL, {example}")
    if not url.startswith("data:"):
        raise ImageError(f"an {kind} URL must be a data: URL, {example}, or an allowed http(s) URL")
    header, sep, payload = url.partition(",")
    params = header[5:].split(";")
    if not sep or params[-1] != "base64":
        raise ImageError(f"an {kind} data: URL must be base64-encoded ({example})")
    if params[0].lower() not in types:
        raise ImageError(f"{kind} type {params[0]!r} is not supported; send {', '.join(types)}")
    if len(payload) > 4 * (max_bytes // 3 + 1) + 4:
        raise ImageError(f"the {kind} is larger than the limit of {max_bytes} bytes ({flag})")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError(f"the {kind} data: URL is not valid base64") from None
    if len(data) > max_bytes:
        raise ImageError(f"the {kind} has {len(data)} bytes, more than the limit of {max_bytes} ({flag})")
    return data


def video_placeholder(model_dir: str) -> str:
    """The chat template's video placeholder: config.json's ``video_placeholder`` (Kimi's default)."""
    f = Path(model_dir) / "config.json"
    return str(json.loads(f.read_text()).get("video_placeholder") or VIDEO_PLACEHOLDER) if f.exists() \
        else VIDEO_PLACEHOLDER


class VisionFrontend:
    """One served model's image and video inputs (None of it for a model without a vision tower)."""

    def __init__(self, processor: ImageProcessorConfig, placeholder_id: int, limits: ImageLimits,
                 video: VideoProcessorConfig | None = None, video_limits: VideoLimits | None = None,
                 fetcher: MediaFetcher | None = None, video_marker: str = VIDEO_PLACEHOLDER,
                 max_videos: int = 1) -> None:
        """``video`` None: the model takes no video; ``fetcher`` None: http(s) URLs are refused."""
        self.processor, self.placeholder_id, self.limits = processor, placeholder_id, limits
        self.video, self.video_limits, self.fetcher = video, video_limits, fetcher
        self.marker, self.video_marker, self.max_videos = IMAGE_MARKER, video_marker, max_videos

    @classmethod
    def for_model(cls, model_dir: str, tokenizer: Any, limits: ImageLimits, video_limits: VideoLimits | None = None,
                  fetcher: MediaFetcher | None = None, max_videos: int = 0) -> VisionFrontend | None:
        """The frontend of the checkpoint at ``model_dir``, or None when it takes no images; video when
        ``max_videos`` > 0 and the tower declares enough temporal positions for the preprocessor's chunks."""
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
        video = None
        if max_videos > 0 and video_limits is not None:
            try:
                video = VideoProcessorConfig.from_model_dir(model_dir)
            except (ValueError, TypeError) as e:
                logger.warning("video inputs off: %s", e)
            if video is not None and video.temporal_merge_kernel_size > vision.pos_emb_time:
                logger.warning("video inputs off: chunks of %d frames, but the tower has %d temporal positions",
                               video.temporal_merge_kernel_size, vision.pos_emb_time)
                video = None
        return cls(proc, token, limits, video, video_limits, fetcher, video_placeholder(model_dir), max_videos)

    def load(self, urls: list[str]) -> list[PreparedImage]:
        """Decode and preprocess every image of ``data:`` URLs, synchronously (ImageError at the first one that
        fails, naming it); the server's path is ``prepare``."""
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

    async def prepare(self, refs: list[MediaRef]) -> list[PreparedImage | PreparedVideo]:
        """Fetch (http(s) URLs), decode and preprocess every medium, concurrently, decoding in worker threads;
        ImageError naming the first that fails, in request order, and where the request holds it."""
        images = sum(r.kind == "image" for r in refs)
        videos = len(refs) - images
        if images > self.limits.max_images:
            raise ImageError(f"the request has {images} images, more than the limit of {self.limits.max_images} "
                             "(--max-images-per-request)")
        if videos and self.video is None:
            raise ImageError("video inputs are not supported by this model (its vision tower takes no video "
                             "chunks, or the server runs with --max-videos-per-request 0)")
        if videos > self.max_videos:
            raise ImageError(f"the request has {videos} videos, more than the limit of {self.max_videos} "
                             "(--max-videos-per-request)")
        counts = {"image": 0, "video": 0}
        named = []
        for r in refs:
            named.append(f"{r.kind} {counts[r.kind]}" + (f" ({r.where})" if r.where else ""))
            counts[r.kind] += 1
        done = await asyncio.gather(*(self._prepare_one(r) for r in refs), return_exceptions=True)
        for ref, name, got in zip(refs, named, done, strict=True):
            if isinstance(got, ImageError):
                err = type(got)(f"{name}: {got}")
                err.where = ref.where
                raise err from None
            if isinstance(got, BaseException):
                raise got
        return list(done)  # type: ignore[arg-type]

    async def _prepare_one(self, ref: MediaRef) -> PreparedImage | PreparedVideo:
        video = ref.kind == "video"
        cap = self.video_limits.max_bytes if video and self.video_limits else self.limits.max_bytes
        if ref.url.startswith(("http://", "https://")) and self.fetcher is not None:
            types = VIDEO_DATA_TYPES if video else DATA_URL_TYPES
            data = (await self.fetcher.fetch(ref.url, cap, types, ref.kind)).data
        else:
            data = image_bytes(ref.url, cap, ref.kind)
        return await asyncio.to_thread(self._video if video else self._image, data)

    def _image(self, data: bytes) -> PreparedImage:
        pixels, grid, n = preprocess(decode_image(data, self.limits.max_pixels), self.processor)
        return PreparedImage(pixels, grid, n, content_hash(pixels, grid))

    def _video(self, data: bytes) -> PreparedVideo:
        assert self.video is not None and self.video_limits is not None
        chunks = prepare_video(data, self.processor, self.video, self.video_limits)
        return PreparedVideo(tuple(PreparedImage(c.pixel_values, c.grid, c.num_tokens,
                                                 content_hash(c.pixel_values, c.grid)) for c in chunks),
                             "".join(c.prompt for c in chunks))

    def expand(self, ids: list[int], images: list[PreparedImage]) -> tuple[list[int], tuple[ImageInput, ...]]:
        """Expand the i-th placeholder token of ``ids`` to image i's tokens; ImageError when the prompt holds
        another number of placeholders than images (the text itself spelled the placeholder)."""
        where = [i for i, t in enumerate(ids) if t == self.placeholder_id]
        if len(where) != len(images):
            raise ImageError(f"the prompt holds {len(where)} media placeholders for {len(images)} images and video "
                             f"chunks: message text must not contain {PLACEHOLDER_TOKEN}")
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
