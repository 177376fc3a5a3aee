"""The images of a chat request (ddtree_serve/server/multimodal/frontend.py), for the chat handler: a 400 naming
``messages`` for a model without a vision tower or a bad image, before anything reaches the scheduler."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from ddtree_serve.server.http.errors import APIError
from ddtree_serve.server.io_struct import ImageInput
from ddtree_serve.server.multimodal.frontend import PreparedImage, VisionFrontend
from ddtree_serve.server.multimodal.image_processor import ImageError
from ddtree_serve.server.tokenizer_manager import InputError, TokenizerManager


@dataclass
class ChatImages:
    """``marker``: the text an image part renders as (empty without images); ``expand``: the prompt ids with
    each image's placeholder expanded, and the images for the ``GenerateReq``."""

    vision: VisionFrontend | None = None
    images: list[PreparedImage] = field(default_factory=list)

    @property
    def marker(self) -> str:
        return self.vision.marker if self.vision is not None else ""

    def render(self, encode: Callable[[bool, str], list[int]]) -> list[int]:
        """The prompt ids of the chat, its images rendered by the checkpoint's own template.
        ``encode(image_parts, marker)``: with ``image_parts`` the template gets text and image parts, else one
        string per message with ``marker`` where each image stands. A template that renders image parts adds
        placeholders to what the text alone holds (``encode(False, "")``): its rendering is used; one that
        ignores them gets the marker written into the text (``expand`` then checks one placeholder per image)."""
        ids = encode(True, self.marker)
        if self.vision is None or not self.images:
            return ids
        pad = self.vision.placeholder_id
        if ids.count(pad) > encode(False, "").count(pad):  # the template rendered the image parts
            return ids
        return encode(False, self.marker)

    def expand(self, ids: list[int]) -> tuple[list[int], tuple[ImageInput, ...]]:
        """InputError (a 400 of ``messages``) when the placeholders do not match the images."""
        if self.vision is None or not self.images:
            return ids, ()
        try:
            return self.vision.expand(ids, self.images)
        except ImageError as e:
            raise InputError(str(e)) from None


async def chat_images(tm: TokenizerManager, urls: list[str]) -> ChatImages:
    """Decode and preprocess ``urls`` (in a worker thread: PIL work stays off the event loop)."""
    if not urls:
        return ChatImages()
    vision = getattr(tm, "vision", None)
    if vision is None:
        raise APIError(400, "image inputs are not supported by this model (it has no vision tower, or the server "
                            "runs with --max-images-per-request 0); send text parts",
                       param="messages", code="unsupported_content")
    try:
        images = await asyncio.to_thread(vision.load, urls)
    except ImageError as e:
        raise APIError(400, str(e), param="messages", code="invalid_image") from None
    return ChatImages(vision, images)
