"""Image preprocessing and the HTTP side's image checks (ddtree_serve/server/multimodal/): the resize / pad / token formula
against values computed here from the published rule, patch order and normalisation, decoding limits and
errors, data: URLs, the content hash, and the placeholder expansion."""

from __future__ import annotations

import base64
import math

import numpy as np
import pytest
import torch

from ddtree_serve.server.multimodal.frontend import ImageLimits, VisionFrontend, image_bytes
from ddtree_serve.server.multimodal.image_processor import (
    ImageError,
    ImageProcessorConfig,
    content_hash,
    decode_image,
    plan_resize,
    preprocess,
)
from tests.server.image_files import data_url, random_image
from tests.server.image_files import image_bytes as encode

CFG = ImageProcessorConfig()


def _expected(width: int, height: int) -> tuple[int, int, int]:
    """(rows, cols, tokens) by the published rule, written out: patch 14, merge 2, 16384 patches, 512 a side."""
    scale = min(1.0, math.sqrt(16384 / (max(1, width // 14) * max(1, height // 14))), 7168 / width, 7168 / height)
    w, h = min(max(1, int(width * scale)), 7168), min(max(1, int(height * scale)), 7168)
    rows, cols = 2 * math.ceil(h / 28), 2 * math.ceil(w / 28)
    return rows, cols, (rows // 2) * (cols // 2)


@pytest.mark.parametrize("size", [(100, 80), (28, 28), (1, 1), (27, 29), (4000, 3000), (20000, 10), (10, 9000),
                                  (1792, 1792), (1793, 1792)])
def test_grid_and_token_count_follow_the_formula(size):
    plan = plan_resize(*size, CFG)
    rows, cols, tokens = _expected(*size)
    assert plan.grid == (rows, cols) and plan.num_tokens == tokens
    assert (plan.width + plan.pad_width, plan.height + plan.pad_height) == (cols * 14, rows * 14)
    assert rows <= 512 + 1 and cols <= 512 + 1  # a side stays within the limit (before the last merge pad)


def test_small_images_are_not_scaled_and_large_ones_stay_near_the_patch_limit():
    assert plan_resize(100, 80, CFG).num_tokens == 4 * 3  # ceil(100 / 28) x ceil(80 / 28)
    big = plan_resize(4000, 3000, CFG)
    assert big.width < 4000 and big.grid[0] * big.grid[1] <= 16384 * 1.05


def test_patches_are_row_major_normalised_and_padded_black():
    from PIL import Image

    img = Image.new("RGB", (40, 30), (255, 0, 0))
    img.paste((0, 0, 255), (28, 0, 40, 14))  # blue: top row, right half of patch column 2
    pixels, grid, n = preprocess(img, CFG)
    assert grid == (1, 4, 4) and n == 4 and pixels.shape == (16, 3, 14, 14) and pixels.dtype == torch.float32
    grid_px = pixels.reshape(4, 4, 3, 14, 14)  # [row, col, channel, y, x]
    assert torch.equal(grid_px[0, 0, 0], torch.ones(14, 14)) and torch.equal(grid_px[0, 0, 2], -torch.ones(14, 14))
    assert torch.equal(grid_px[0, 2, 2, :, :12], torch.ones(14, 12))  # blue where it was pasted
    assert torch.equal(grid_px[0, 2, 2, :, 12:], -torch.ones(14, 2))  # padding (x >= 40) is black: -1
    assert torch.equal(grid_px[3], -torch.ones(4, 3, 14, 14))  # rows 42..55 lie below the image: padding
    assert torch.equal(grid_px[2, 0, 0, :2], torch.ones(2, 14))  # y 28, 29 are the image's last rows


def test_preprocess_matches_resize_normalise_patchify_written_out():
    img = random_image(3, (300, 200))
    pixels, (_, rows, cols), _ = preprocess(img, CFG)
    plan = plan_resize(300, 200, CFG)
    from PIL import Image

    arr = np.zeros((rows * 14, cols * 14, 3), dtype=np.uint8)
    arr[:plan.height, :plan.width] = np.asarray(img.resize((plan.width, plan.height), Image.Resampling.BICUBIC))
    norm = (arr.astype(np.float32) / np.float32(255.0) - np.float32(0.5)) * np.float32(2.0)
    for r, c in [(0, 0), (rows - 1, cols - 1), (3, 7)]:
        want = norm[r * 14:(r + 1) * 14, c * 14:(c + 1) * 14].transpose(2, 0, 1)
        np.testing.assert_allclose(pixels[r * cols + c].numpy(), want, atol=1e-6)


def test_decoding_formats_and_errors():
    img = random_image(1, (30, 20))
    for fmt, kw in [("PNG", {}), ("JPEG", {"quality": 95}), ("WEBP", {"lossless": True})]:
        assert decode_image(encode(img, fmt, **kw), 10**6).size == (30, 20)
    with pytest.raises(ImageError, match="cannot be decoded"):
        decode_image(b"not an image at all", 10**6)
    with pytest.raises(ImageError, match="not supported"):
        decode_image(encode(img, "GIF"), 10**6)
    with pytest.raises(ImageError, match="pixels"):
        decode_image(encode(img, "PNG"), 599)
    png = encode(img, "PNG")
    with pytest.raises(ImageError):
        decode_image(png[: len(png) // 2], 10**6)  # truncated


def test_data_urls():
    png = encode(random_image(2), "PNG")
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    assert image_bytes(url, 10**6) == png
    for bad, words in [("https://example.com/cat.png", "not fetched"), ("file:///etc/passwd", "data: URL"),
                       ("data:image/png," + "abc", "base64"), ("data:image/png;base64,@@@", "not valid base64"),
                       ("data:image/gif;base64,R0lG", "not supported"), (url, "limit")]:
        with pytest.raises(ImageError, match=words):
            image_bytes(bad, 10**6 if words != "limit" else len(png) - 1)


def test_content_hash_follows_the_pixels_not_the_encoding():
    img = random_image(5, (50, 40))
    a = preprocess(decode_image(encode(img, "PNG"), 10**6), CFG)
    b = preprocess(decode_image(encode(img, "WEBP", lossless=True), 10**6), CFG)
    c = preprocess(random_image(6, (50, 40)), CFG)
    assert content_hash(a[0], a[1]) == content_hash(b[0], b[1]) != content_hash(c[0], c[1])
    assert 0 <= content_hash(a[0], a[1]) < 2**63


def test_frontend_limits_and_placeholder_expansion():
    front = VisionFrontend(CFG, placeholder_id=9, limits=ImageLimits(max_images=2, max_bytes=10**6,
                                                                     max_pixels=10**6))
    urls = [data_url(random_image(1, (56, 56))), data_url(random_image(2, (30, 100)))]
    images = front.load(urls)
    assert [im.num_tokens for im in images] == [4, 2 * 4]
    ids, inputs = front.expand([1, 9, 2, 3, 9, 4], images)
    assert ids == [1] + [9] * 4 + [2, 3] + [9] * 8 + [4]
    assert [(im.offset, im.num_tokens) for im in inputs] == [(1, 4), (7, 8)]
    assert inputs[0].content_hash == images[0].content_hash and inputs[1].grid == (1, 8, 4)
    with pytest.raises(ImageError, match="placeholders"):
        front.expand([1, 9, 9, 9], images)
    with pytest.raises(ImageError, match="more than the limit of 2"):
        front.load(urls * 2)
    with pytest.raises(ImageError, match="image 1: .*not fetched"):
        front.load([urls[0], "http://x/y.png"])
