"""Test videos made with PyAV itself (no binary fixtures), and the video fields a tiny Kimi checkpoint declares.

``video_bytes`` encodes ``n`` frames in memory; frame k is a solid grey of level ``level(k)`` with a seeded
random pattern in its top-left quarter, so a decoded frame says which frame it was (its mean grey in the
bottom half) and frames differ in content. ``declare_video`` writes the published Kimi K2.5 ``media_proc_cfg``
video fields (K2.6's own preprocessor config is not published apart from them; docs/DESIGN.md, "Video") with
a small ``sample_fps`` into a checkpoint, the ``video_placeholder`` into its config.json, and a chat template
that renders image and video parts as Kimi's ``render_content`` does.
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Any

import numpy as np

from tests.server.kimi_tokenizer_files import CHAT_TEMPLATE

PLACEHOLDER = "<|kimi_k25_video_placeholder|>"
IMAGE_PART = "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>"
# Kimi's render_content: an image part then a newline; a video part as the video placeholder then a newline
KIMI_MEDIA_TEMPLATE = CHAT_TEMPLATE.replace(
    "{%- for p in m.content if p.type == 'text' -%}{{ p.text }}{%- endfor -%}",
    "{%- for p in m.content -%}{%- if p.type == 'image' or p.type == 'image_url' -%}" + IMAGE_PART + "{{ '\\n' }}"
    "{%- elif p.type == 'video' or p.type == 'video_url' -%}" + PLACEHOLDER + "{{ '\\n' }}"
    "{%- else -%}{{ p.text }}{%- endif -%}{%- endfor -%}")
MEDIA_PROC_CFG: dict[str, Any] = {
    "in_patch_limit": 16384, "patch_size": 14, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "merge_kernel_size": 2, "fixed_output_tokens": None, "patch_limit_on_one_side": 512,
    "in_patch_limit_each_frame": 4096, "in_patch_limit_video": None, "sample_fps": 2.0,
    "max_num_frames_each_video": None, "temporal_merge_kernel_size": 4, "timestamp_mode": "hh:mm:ss.fff"}


def level(k: int) -> int:
    return (20 + 23 * k) % 236


def video_bytes(n: int, fps: int = 4, size: tuple[int, int] = (56, 42), codec: str = "mpeg4",
                fmt: str = "mp4", seed: int = 0) -> bytes:
    """``n`` frames of ``size`` (width, height) at ``fps``, encoded in memory."""
    import av

    w, h = size
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as c:
        s = c.add_stream(codec, rate=fps)
        s.width, s.height, s.pix_fmt = w, h, "yuv420p"
        for k in range(n):
            arr = np.full((h, w, 3), level(k), np.uint8)
            arr[: h // 2, : w // 2] = rng.integers(0, 256, (h // 2, w // 2, 3), dtype=np.uint8)
            for p in s.encode(av.VideoFrame.from_ndarray(arr, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return buf.getvalue()


def video_data_url(data: bytes, mime: str = "video/mp4") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def frame_level(img) -> float:
    """The mean grey of a decoded frame's bottom half (the solid part)."""
    a = np.asarray(img, dtype=np.float64)
    return float(a[a.shape[0] // 2 + 2:].mean())


def declare_video(path: str | Path, **cfg: Any) -> None:
    """Give the checkpoint at ``path`` the video fields (``cfg`` overrides ``MEDIA_PROC_CFG``), Kimi's video
    placeholder and a chat template that renders media parts."""
    path = Path(path)
    (path / "preprocessor_config.json").write_text(json.dumps({"media_proc_cfg": {**MEDIA_PROC_CFG, **cfg}}))
    full = json.loads((path / "config.json").read_text())
    full["video_placeholder"] = PLACEHOLDER
    (path / "config.json").write_text(json.dumps(full, indent=2))
    tok = json.loads((path / "tokenizer_config.json").read_text())
    tok["chat_template"] = KIMI_MEDIA_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(tok, indent=2))
