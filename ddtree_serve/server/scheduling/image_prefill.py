"""Images at prefill: a request's image embeddings replace its placeholder tokens' embeddings.

An extend forward over a chunk that overlaps an image's placeholder span gets ``ForwardBatch.input_embeds``:
the text embeddings of the chunk's tokens with the overlapping rows overwritten by the image's embeddings
(rows ``a .. a + k`` of the image when the chunk starts ``a`` tokens into it: chunked prefill, or a prefix
cache hit, may split a prompt inside an image). The vision tower runs once per image when the first chunk
that needs it runs; the embeddings stay on the request until its prefill has passed the image (a retracted
request that comes back recomputes them). Every TP rank runs the same replicated tower on the same pixels.
"""

from __future__ import annotations

import torch

from ddtree_serve.server.io_struct import GenerateReq
from ddtree_serve.server.scheduling.request import Req


def check_images(req: GenerateReq, model: torch.nn.Module) -> None:
    """ValueError unless ``req.images`` fit the model and the prompt: a vision tower, spans in order inside
    the prompt, each span made of the model's placeholder token."""
    if not req.images:
        return
    token = getattr(model, "media_placeholder_token_id", None)
    if getattr(model, "vision", None) is None or token is None:
        raise ValueError("this model has no vision tower: image inputs are not accepted")
    prev = 0
    for im in req.images:
        if im.offset < prev or im.end > len(req.input_ids) or im.num_tokens < 1:
            raise ValueError("image spans must be in order, inside the prompt and non-empty")
        if any(t != token for t in req.input_ids[im.offset:im.end]):
            raise ValueError(f"an image's span must hold its placeholder token {token}")
        prev = im.end


@torch.inference_mode()
def prefill_embeds(model: torch.nn.Module, reqs: list[Req], chunk_lens: list[int], ids: torch.Tensor
                   ) -> torch.Tensor | None:
    """``input_embeds`` [T, H] for an extend forward of ``ids`` [T] (``chunk_lens[b]`` new tokens of
    ``reqs[b]`` from its ``num_cached``), or None when no chunk overlaps an image."""
    spans = []  # (row in the batch, request, image index, first image row, rows)
    off = 0
    for req, n in zip(reqs, chunk_lens, strict=True):
        start = req.num_cached
        for j, im in enumerate(req.images):
            lo, hi = max(start, im.offset), min(start + n, im.end)
            if lo < hi:
                spans.append((off + lo - start, req, j, lo - im.offset, hi - lo))
        off += n
    if not spans:
        return None
    embeds = model.embed(ids).clone()  # [T, H]
    for row, req, j, first, k in spans:
        image = req.image_embeds.get(j)
        if image is None:
            im = req.images[j]
            image = req.image_embeds[j] = model.embed_images([im.pixel_values], [im.grid])[0]  # [tokens, H]
        embeds[row:row + k] = image[first:first + k].to(embeds.dtype)
    for req, n in zip(reqs, chunk_lens, strict=True):  # drop what the rest of the prefill no longer reads
        for j, im in enumerate(req.images):
            if im.end <= req.num_cached + n:
                req.image_embeds.pop(j, None)
    return embeds
