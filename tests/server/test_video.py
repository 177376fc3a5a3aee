"""Video input (ddtree_serve/server/multimodal/video.py, frontend.py, http/chat_images.py) against references computed
here independently: the sampled frame indices from the documented rule (and the decoded frames are those
frames), the timestamps, the chunk grids and token counts, the limits' 400 messages, and the prompt text: the
checkpoint's chat template rendered by transformers directly, the video placeholder replaced by the chunk
prompts written out here, tokenized, must equal the server's prompt ids."""

from __future__ import annotations

import asyncio
import json
import math
from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

from ddtree_serve.server.http.chat_images import ChatImages, chat_images, media_refs
from ddtree_serve.server.http.errors import APIError
from ddtree_serve.server.http.protocol import ChatCompletionRequest
from ddtree_serve.server.http.serving_chat import _messages
from ddtree_serve.server.multimodal.frontend import ImageLimits, MediaRef, VisionFrontend
from ddtree_serve.server.multimodal.image_processor import ImageError, ImageProcessorConfig
from ddtree_serve.server.multimodal.video import (
    VideoLimits,
    VideoProcessorConfig,
    decode_frames,
    prepare_video,
    probe,
    sample_frame_indices,
    timestamp_text,
)
from ddtree_serve.server.tokenizer_manager import TokenizerManager
from tests.server.image_files import data_url, random_image
from tests.server.kimi_tokenizer_files import special_token_ids, write_kimi_tokenizer
from tests.server.video_files import (
    KIMI_MEDIA_TEMPLATE,
    MEDIA_PROC_CFG,
    declare_video,
    frame_level,
    level,
    video_bytes,
    video_data_url,
)

VOCAB = 512
LIMITS = VideoLimits(max_bytes=10**7, max_seconds=60, max_frames=64, max_pixels=10**6)
CFG = VideoProcessorConfig()  # the published fields: 2 frames per second, chunks of 4


def expected_indices(num_frames: int, fps: float, sample_fps: float) -> list[int]:
    """The rule written out: n = max(round(N * min(s, fps) / fps), 1) frames, evenly from 0 to N - 1, rounded
    half to even."""
    n = max(round(num_frames * min(sample_fps, fps) / fps), 1)
    return [0] if n == 1 else [round(i * (num_frames - 1) / (n - 1)) for i in range(n)]


@pytest.mark.parametrize(("frames", "fps", "sample"), [(8, 4, 2.0), (10, 4, 2.0), (3, 4, 2.0), (30, 25, 2.0),
                                                       (7, 1, 2.0), (1, 4, 2.0), (100, 30, 1.0), (9, 2, 0.5)])
def test_frame_indices_follow_the_rule(frames, fps, sample):
    got = sample_frame_indices(frames, fps, VideoProcessorConfig(sample_fps=sample))
    assert got == expected_indices(frames, fps, sample)


def test_timestamps():
    assert timestamp_text(0.0) == "00:00:00.000"
    assert timestamp_text(2.75) == "00:00:02.750"
    assert timestamp_text(3661.5) == "01:01:01.500"
    assert timestamp_text(0.5 / 3) == "00:00:00.166"  # truncated, not rounded
    assert timestamp_text(75.25, "mm:ss.fff") == "01:15.250" and timestamp_text(75.25, "mm:ss") == "01:15"


def test_decoded_frames_are_the_sampled_ones_and_chunks_are_laid_out():
    data = video_bytes(14, fps=4, size=(56, 42))
    meta = probe(data, LIMITS)
    assert (meta.num_frames, meta.fps, meta.width, meta.height) == (14, 4.0, 56, 42)
    idx = expected_indices(14, 4, 2.0)  # 7 frames: 0, 2, 4, 6|, 9?, ...
    frames = decode_frames(data, idx)
    assert all(abs(frame_level(f) - level(k)) < 4 for f, k in zip(frames, idx, strict=True))
    chunks = prepare_video(data, ImageProcessorConfig(), CFG, LIMITS)
    assert [c.frame_indices for c in chunks] == [tuple(idx[:4]), tuple(idx[4:])]
    # 56 x 42 pixels: 4 x 3 patches, padded to 4 x 4 (a multiple of the 2 x 2 merge): 2 x 2 = 4 tokens
    assert [c.grid for c in chunks] == [(4, 4, 4), (3, 4, 4)] and [c.num_tokens for c in chunks] == [4, 4]
    assert chunks[0].pixel_values.shape == (4 * 16, 3, 14, 14)
    assert [c.prompt for c in chunks] == [
        f"{timestamp_text(idx[0] / 4)}<|media_begin|>video<|media_content|><|media_pad|><|media_end|>",
        f"{timestamp_text(idx[4] / 4)}<|media_begin|>video<|media_content|><|media_pad|><|media_end|>"]


def test_webm_and_the_per_frame_patch_limits():
    data = video_bytes(4, fps=2, size=(280, 140), codec="libvpx", fmt="webm")
    small = VideoProcessorConfig(in_patch_limit_each_frame=64)  # 20 x 10 patches -> scaled to fit 64
    chunks = prepare_video(data, ImageProcessorConfig(), small, LIMITS)
    (t, h, w), = [c.grid for c in chunks]
    scale = min(1.0, math.sqrt(64 / (20 * 10)))
    assert t == 4 and (h, w) == (2 * math.ceil(int(140 * scale) / 28), 2 * math.ceil(int(280 * scale) / 28))
    total = VideoProcessorConfig(in_patch_limit_each_frame=4096, in_patch_limit_video=64)  # 64 / 4 frames
    (t, h, w), = [c.grid for c in prepare_video(data, ImageProcessorConfig(), total, LIMITS)]
    assert h * w <= 16 + 2 * 4 + 1


@pytest.mark.parametrize(("limits", "words"), [
    (VideoLimits(10**7, 2.0, 64, 10**6), "lasts 3.5 s, more than the limit of 2 s"),
    (VideoLimits(10**7, 60, 5, 10**6), "gives 7 frames .* more than the limit of 5"),
    (VideoLimits(10**7, 60, 64, 1000), "56 x 42 = 2352 pixels, more than the limit of 1000"),
    (VideoLimits(1000, 60, 64, 10**6), "more than the limit of 1000"),
])
def test_limits_are_clear_errors(limits, words):
    with pytest.raises(ImageError, match=words):
        prepare_video(video_bytes(14, fps=4), ImageProcessorConfig(), CFG, limits)


def test_not_a_video():
    with pytest.raises(ImageError, match="cannot be decoded|no video stream"):
        prepare_video(b"\0" * 1000, ImageProcessorConfig(), CFG, LIMITS)


def _tokenizer(tmp_path):
    write_kimi_tokenizer(tmp_path, VOCAB, media=True)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = KIMI_MEDIA_TEMPLATE
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return AutoTokenizer.from_pretrained(str(tmp_path), trust_remote_code=True)


def _frontend(max_videos: int = 1) -> VisionFrontend:
    pad = special_token_ids(VOCAB, media=True)["<|media_pad|>"]
    return VisionFrontend(ImageProcessorConfig(), pad, ImageLimits(2, 10**6, 10**6), CFG, LIMITS,
                          max_videos=max_videos)


def test_the_prompt_is_the_templates_text_with_the_chunk_prompts(tmp_path):
    tok = _tokenizer(tmp_path)
    video = video_bytes(14, fps=4)
    body = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "First "}, {"type": "image_url", "image_url": {"url": data_url(random_image(1))}},
        {"type": "video_url", "video_url": {"url": video_data_url(video)}},
        {"type": "text", "text": "what happens?"}]}]}
    req = ChatCompletionRequest.model_validate(body)
    tm = SimpleNamespace(tokenizer=tok, vision=_frontend())
    images = asyncio.run(chat_images(tm, media_refs(req.messages)))

    def encode(image_parts, marker, video_marker="", splice=None):
        return TokenizerManager.encode_chat(tm, _messages(req, marker, image_parts, video_marker), None,
                                            {"thinking": False}, splice=splice)

    ids = images.render(encode)
    text = tok.apply_chat_template([{"role": "user", "content": [
        {"type": "text", "text": "First "}, {"type": "image"}, {"type": "video"},
        {"type": "text", "text": "what happens?"}]}], add_generation_prompt=True, tokenize=False, thinking=False)
    idx = expected_indices(14, 4, 2.0)
    chunks = "".join(f"00:00:{int(idx[c] / 4):02d}.{int(idx[c] / 4 % 1 * 1000):03d}"
                     "<|media_begin|>video<|media_content|><|media_pad|><|media_end|>" for c in (0, 4))
    assert text.count("<|kimi_k25_video_placeholder|>") == 1
    assert chunks.startswith("00:00:00.000") and "00:00:02.250<|media_begin|>video" in chunks  # frame 9 / 4 fps
    assert ids == tok.encode(text.replace("<|kimi_k25_video_placeholder|>", chunks), add_special_tokens=False)
    expanded, inputs = images.expand(ids)
    assert [im.grid for im in inputs] == [(1, 4, 6), (4, 4, 4), (3, 4, 4)]  # the image, then the two chunks
    assert len(expanded) == len(ids) + (6 - 1) + 2 * (4 - 1)


def test_video_refusals():
    front = _frontend()
    video = video_data_url(video_bytes(6, fps=4))
    with pytest.raises(ImageError, match="more than the limit of 1 .*--max-videos-per-request"):
        asyncio.run(front.prepare([MediaRef("video", video), MediaRef("video", video)]))
    with pytest.raises(ImageError, match=r"video 0 \(messages\[0\].content\[1\]\): .*not fetched"):
        asyncio.run(front.prepare([MediaRef("video", "https://example.com/a.mp4", "messages[0].content[1]")]))
    with pytest.raises(ImageError, match="video type 'video/ogg' is not supported"):
        asyncio.run(front.prepare([MediaRef("video", "data:video/ogg;base64,AAAA")]))
    no_video = VisionFrontend(ImageProcessorConfig(), 1, ImageLimits(2, 10**6, 10**6))
    with pytest.raises(ImageError, match="video inputs are not supported"):
        asyncio.run(no_video.prepare([MediaRef("video", video)]))
    with pytest.raises(APIError, match="video inputs are not supported by this model"):
        asyncio.run(chat_images(SimpleNamespace(vision=None), [MediaRef("video", video)]))


def test_a_spelled_placeholder_is_refused():
    images = ChatImages(_frontend(), [], ["A", "B"])
    assert images.splice("x <|kimi_k25_video_placeholder|> y <|kimi_k25_video_placeholder|>") == "x A y B"
    from ddtree_serve.server.tokenizer_manager import InputError

    with pytest.raises(InputError, match="3 video placeholders for 2 videos"):
        images.splice("<|kimi_k25_video_placeholder|>" * 3)


def test_the_checkpoint_declares_the_fields(tmp_path):
    from tests.server.kimi_tokenizer_files import write_tiny_kimi

    write_tiny_kimi(tmp_path, VOCAB, vision=True)
    declare_video(tmp_path, sample_fps=1.0)
    tok = AutoTokenizer.from_pretrained(str(tmp_path), trust_remote_code=True)
    front = VisionFrontend.for_model(str(tmp_path), tok, ImageLimits(2, 10**6, 10**6), LIMITS, max_videos=1)
    assert front.video == VideoProcessorConfig(sample_fps=1.0) and front.video_marker == "<|kimi_k25_video_placeholder|>"
    assert MEDIA_PROC_CFG["temporal_merge_kernel_size"] == front.video.temporal_merge_kernel_size
    assert VisionFrontend.for_model(str(tmp_path), tok, ImageLimits(2, 10**6, 10**6), LIMITS).video is None


def test_h264_with_reordered_frames_gives_the_sampled_frames():
    """H.264 (libx264 reorders frames: B-frames): the frame count and the sampled frames are still right."""
    data = video_bytes(30, fps=10, codec="libx264")
    meta = probe(data, LIMITS)
    assert (meta.num_frames, meta.fps) == (30, 10.0)
    idx = sample_frame_indices(30, 10.0, CFG)
    assert idx == expected_indices(30, 10, 2.0) == [0, 6, 12, 17, 23, 29]
    assert all(abs(frame_level(f) - level(k)) < 4 for f, k in zip(decode_frames(data, idx), idx, strict=True))
