"""The images and videos of a chat request (ddtree_serve/server/multimodal/frontend.py), for the chat handler: a 400
naming ``messages`` (and the part, ``messages[i].content[j]``) for a model without a vision tower or a bad or
unreachable medium, before anything reaches the scheduler."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ddtree_serve.server.http.errors import APIError
from ddtree_serve.server.io_struct import ImageInput
from ddtree_serve.server.multimodal.frontend import MediaRef, PreparedImage, PreparedVideo, VisionFrontend
from ddtree_serve.server.multimodal.image_processor import ImageError
from ddtree_serve.server.multimodal.media_fetch import MediaFetchError
from ddtree_serve.server.tokenizer_manager import InputError, TokenizerManager

# encode(image_parts, image marker, video marker, splice) -> prompt ids
Encode = Callable[[bool, str, str, "Callable[[str], str] | None"], list[int]]


def media_refs(messages: Sequence[Any]) -> list[MediaRef]:
    """The media parts of chat messages, in order, each with where the request holds it."""
    field_of = {"image": "image_url", "video": "video_url"}
    return [MediaRef(kind, url, f"messages[{i}].content[{j}].{field_of[kind]}.url")
            for i, m in enumerate(messages) for kind, url, j in m.media()]


@dataclass
class ChatImages:
    """``marker``: the text an image part renders as (empty without images); ``images``: each image and each
    video chunk, in prompt order; ``video_prompts``: each video's chunk prompts, which replace its placeholder;
    ``expand``: the prompt ids with each placeholder token expanded, and the images for the ``GenerateReq``."""

    vision: VisionFrontend | None = None
    images: list[PreparedImage] = field(default_factory=list)
    video_prompts: list[str] = field(default_factory=list)

    @property
    def marker(self) -> str:
        return self.vision.marker if self.vision is not None else ""

    @property
    def video_marker(self) -> str:
        return self.vision.video_marker if self.vision is not None and self.video_prompts else ""

    def splice(self, text: str) -> str:
        """``text`` with the i-th video placeholder replaced by video i's chunk prompts; InputError when the text
        holds another number of them than videos (none: a template that renders no video parts, left as is)."""
        mark = self.video_marker
        n = text.count(mark) if mark else 0
        if n == 0:
            return text
        if n != len(self.video_prompts):
            raise InputError(f"the prompt holds {n} video placeholders for {len(self.video_prompts)} videos: message "
                             f"text must not contain {mark}")
        pieces = text.split(mark)
        return "".join(p + (self.video_prompts[i] if i < len(self.video_prompts) else "")
                       for i, p in enumerate(pieces))

    def render(self, encode: Encode) -> list[int]:
        """The prompt ids of the chat, its media rendered by the checkpoint's own template. ``encode(image_parts,
        marker, video_marker, splice)``: with ``image_parts`` the template gets text, image and video parts,
        else one string per message with the markers where each medium stands; ``splice`` replaces the video
        placeholders in the rendered text. A template that renders media parts adds placeholders to what the
        text alone holds (``encode(False, "", "", None)``): its rendering is used; one that ignores them gets
        the markers written into the text (``expand`` then checks one placeholder per image and chunk)."""
        splice = self.splice if self.video_prompts else None
        ids = encode(True, self.marker, self.video_marker, splice)
        if self.vision is None or not self.images:
            return ids
        pad = self.vision.placeholder_id
        if ids.count(pad) > encode(False, "", "", None).count(pad):  # the template rendered the media parts
            return ids
        return encode(False, self.marker, self.video_marker, splice)

    def expand(self, ids: list[int]) -> tuple[list[int], tuple[ImageInput, ...]]:
        """InputError (a 400 of ``messages``) when the placeholders do not match the images and chunks."""
        if self.vision is None or not self.images:
            return ids, ()
        try:
            return self.vision.expand(ids, self.images)
        except ImageError as e:
            raise InputError(str(e)) from None


async def chat_images(tm: TokenizerManager, refs: list[MediaRef]) -> ChatImages:
    """Fetch, decode and preprocess ``refs`` (decoding in worker threads: PIL / PyAV work stays off the event
    loop)."""
    if not refs:
        return ChatImages()
    vision = getattr(tm, "vision", None)
    if vision is None:
        kinds = "video" if all(r.kind == "video" for r in refs) else "image"
        raise APIError(400, f"{kinds} inputs are not supported by this model (it has no vision tower, or the server "
                            "runs with --max-images-per-request 0); send text parts",
                       param="messages", code="unsupported_content")
    try:
        prepared = await vision.prepare(refs)
    except MediaFetchError as e:
        raise APIError(400, str(e), param=e.where or "messages", code="media_fetch_failed") from None
    except ImageError as e:
        raise APIError(400, str(e), param="messages", code="invalid_image") from None
    images: list[PreparedImage] = []
    prompts: list[str] = []
    for p in prepared:
        if isinstance(p, PreparedVideo):
            images.extend(p.chunks)
            prompts.append(p.prompt)
        else:
            images.append(p)
    return ChatImages(vision, images, prompts)
