"""Kimi K2.5 / K2.6 video input: decode (PyAV), sample frames at the checkpoint's rate, cut them into chunks of
``temporal_merge_kernel_size`` frames, preprocess each chunk for MoonViT's temporal patching, and write each
chunk's timestamped prompt. Pure functions over bytes / PIL / numpy; no model needed.

Rules (Kimi's published media processor, ``media_proc_cfg`` of ``preprocessor_config.json``; docs/DESIGN.md,
"Video", gives the sources):

- sampling: ``fps' = min(sample_fps, fps)``, ``n = max(round(num_frames * fps' / fps), 1)`` frames at indices
  ``round(linspace(0, num_frames - 1, n))`` (numpy's round: half to even), ``num_frames`` and ``fps`` (the
  average rate) from the container;
- chunks: consecutive runs of ``temporal_merge_kernel_size`` (4) sampled frames, the last one shorter when
  ``n`` is not a multiple; chunk ``c`` starts at ``indices[4c] / fps`` seconds, written by ``timestamp_mode``
  (``hh:mm:ss.fff``: hours, minutes, seconds, then the milliseconds truncated);
- each chunk's prompt: ``{timestamp}<|media_begin|>video<|media_content|><|media_pad|><|media_end|>``; a
  video's prompts, concatenated, replace the video placeholder its chat template rendered;
- each frame of a chunk is resized and padded like an image (image_processor.plan_resize, from the chunk's
  first frame size) with the per-frame patch limit ``in_patch_limit_each_frame`` (or ``in_patch_limit``),
  lowered to ``round(in_patch_limit_video / frames in the chunk)`` when that is set; the chunk's pixels are
  its frames' patches in frame order, grid ``(t, h, w)``, and MoonViT pools the ``t`` frames into
  ``(h/2) * (w/2)`` tokens.
"""

from __future__ import annotations

import dataclasses
import io
from dataclasses import dataclass

import numpy as np
import torch

from ddtree_serve.model_executor.models.moonvit import read_media_config
from ddtree_serve.server.multimodal.image_processor import ImageError, ImageProcessorConfig, preprocess

CHUNK_PROMPT = "<|media_begin|>video<|media_content|><|media_pad|><|media_end|>"
TIMESTAMP_MODES = ("hh:mm:ss.fff", "mm:ss.fff", "mm:ss")
VIDEO_DATA_TYPES = ("video/mp4", "video/webm", "video/quicktime", "video/x-matroska", "video/mpeg", "video/x-msvideo")


@dataclass(frozen=True)
class VideoProcessorConfig:
    """The video fields of ``media_proc_cfg`` (defaults: the published Kimi K2.5 processor's)."""

    sample_fps: float = 2.0
    temporal_merge_kernel_size: int = 4
    timestamp_mode: str = "hh:mm:ss.fff"
    in_patch_limit_each_frame: int | None = 4096
    in_patch_limit_video: int | None = None
    max_num_frames_each_video: int | None = None

    @classmethod
    def from_model_dir(cls, path: str) -> VideoProcessorConfig:
        cfg, base = read_media_config(path), cls()

        def opt(key: str) -> int | None:
            v = cfg.get(key, getattr(base, key))
            return None if v is None else int(v)

        out = cls(sample_fps=float(cfg.get("sample_fps", base.sample_fps)),
                  temporal_merge_kernel_size=int(cfg.get("temporal_merge_kernel_size",
                                                         base.temporal_merge_kernel_size)),
                  timestamp_mode=str(cfg.get("timestamp_mode", base.timestamp_mode)),
                  in_patch_limit_each_frame=opt("in_patch_limit_each_frame"),
                  in_patch_limit_video=opt("in_patch_limit_video"),
                  max_num_frames_each_video=opt("max_num_frames_each_video"))
        if out.timestamp_mode not in TIMESTAMP_MODES or out.sample_fps <= 0 or out.temporal_merge_kernel_size < 1:
            raise ValueError(f"unsupported video fields in media_proc_cfg: {out}")
        return out


@dataclass(frozen=True)
class VideoLimits:
    max_bytes: int
    max_seconds: float
    max_frames: int  # sampled frames
    max_pixels: int  # per frame


@dataclass(frozen=True)
class VideoMeta:
    num_frames: int
    fps: float
    width: int
    height: int
    seconds: float


@dataclass(frozen=True)
class VideoChunk:
    pixel_values: torch.Tensor  # [t * h * w, 3, p, p]
    grid: tuple[int, int, int]
    num_tokens: int
    prompt: str
    frame_indices: tuple[int, ...]


def sample_frame_indices(num_frames: int, fps: float, cfg: VideoProcessorConfig) -> list[int]:
    """The sampled frame indices (module docstring); ``max_num_frames_each_video``, when the checkpoint sets
    it, caps their number."""
    rate = min(cfg.sample_fps, fps)
    n = max(round(num_frames * rate / fps), 1)
    if cfg.max_num_frames_each_video is not None:
        n = min(n, cfg.max_num_frames_each_video)
    return np.linspace(0, num_frames - 1, n).round().astype(int).tolist()


def timestamp_text(seconds: float, mode: str = "hh:mm:ss.fff") -> str:
    """``seconds`` as ``mode`` writes it (milliseconds truncated, hours modulo 24 as a clock time)."""
    whole = int(seconds)
    hh, mm, ss = (whole // 3600) % 24, (whole // 60) % 60, whole % 60
    ms = int((seconds % 1) * 1000)
    if mode == "hh:mm:ss.fff":
        return f"{hh:02d}:{mm:02d}:{ss:02d}.{ms:03d}"
    if mode == "mm:ss.fff":
        return f"{mm:02d}:{ss:02d}.{ms:03d}"
    if mode == "mm:ss":
        return f"{mm:02d}:{ss:02d}"
    raise ValueError(f"unknown timestamp mode {mode!r}")


def chunk_plan(indices: list[int], fps: float, cfg: VideoProcessorConfig) -> list[tuple[list[int], str]]:
    """(frame indices, prompt) of each chunk."""
    k = cfg.temporal_merge_kernel_size
    return [(indices[i:i + k], timestamp_text(indices[i] / fps, cfg.timestamp_mode) + CHUNK_PROMPT)
            for i in range(0, len(indices), k)]


def _open(data: bytes):
    import av

    try:
        container = av.open(io.BytesIO(data), mode="r")
    except Exception as e:  # noqa: BLE001 - PyAV raises many kinds for bad bytes: all are a bad video
        raise ImageError(f"the video cannot be decoded: {e or type(e).__name__}") from None
    if not container.streams.video:
        container.close()
        raise ImageError("the video has no video stream")
    return container


def probe(data: bytes, limits: VideoLimits) -> VideoMeta:
    """The video's frame count (its packets, demuxed without decoding), average rate, size and duration;
    ImageError when it is not a video or exceeds ``limits`` (seconds from the header, then from the frames)."""
    container = _open(data)
    try:
        stream = container.streams.video[0]
        rate = stream.average_rate or stream.guessed_rate
        fps = float(rate) if rate else 0.0
        w, h = stream.codec_context.width, stream.codec_context.height
        if fps <= 0 or w < 1 or h < 1:
            raise ImageError("the video has no frame rate or frame size")
        if w * h > limits.max_pixels:
            raise ImageError(f"the video's frames have {w} x {h} = {w * h} pixels, more than the limit of "
                             f"{limits.max_pixels} (--max-image-pixels)")
        seconds = container.duration / 1e6 if container.duration else 0.0
        if seconds > limits.max_seconds:
            raise ImageError(f"the video lasts {seconds:.1f} s, more than the limit of {limits.max_seconds:g} s "
                             "(--max-video-seconds)")
        most = int(limits.max_seconds * fps) + 1
        n = 0
        try:
            for packet in container.demux(stream):
                if packet.size:
                    n += 1
                    if n > most:
                        raise ImageError(f"the video has more than {most} frames: longer than the limit of "
                                         f"{limits.max_seconds:g} s (--max-video-seconds)")
        except ImageError:
            raise
        except Exception as e:  # noqa: BLE001 - a corrupt container, in whatever form PyAV reports it
            raise ImageError(f"the video is corrupt: {e or type(e).__name__}") from None
        if n == 0:
            raise ImageError("the video has no frames")
        return VideoMeta(n, fps, w, h, max(seconds, n / fps))
    finally:
        container.close()


def decode_frames(data: bytes, wanted: list[int]):
    """The RGB ``PIL.Image`` of each frame index in ``wanted`` (ascending, repeats allowed), decoding in order."""
    container = _open(data)
    want = sorted(set(wanted))
    got: dict[int, object] = {}
    try:
        for i, frame in enumerate(container.decode(video=0)):
            if i in want:
                got[i] = frame.to_image().convert("RGB")
            if i >= want[-1]:
                break
    except Exception as e:  # noqa: BLE001 - corrupt data mid-stream
        raise ImageError(f"the video is corrupt: {e or type(e).__name__}") from None
    finally:
        container.close()
    missing = [i for i in want if i not in got]
    if missing:
        raise ImageError(f"the video's frames {missing[:4]} could not be decoded")
    return [got[i] for i in wanted]


def preprocess_chunk(frames: list, image_cfg: ImageProcessorConfig, cfg: VideoProcessorConfig
                     ) -> tuple[torch.Tensor, tuple[int, int, int], int]:
    """One chunk's frames -> (pixel values [t * h * w, 3, p, p], grid (t, h, w), tokens after pooling)."""
    limit = cfg.in_patch_limit_each_frame or image_cfg.in_patch_limit
    if cfg.in_patch_limit_video is not None:
        limit = min(round(cfg.in_patch_limit_video / len(frames)), limit)
    per_frame = dataclasses.replace(image_cfg, in_patch_limit=limit)
    size = frames[0].size
    outs = [preprocess(f if f.size == size else f.resize(size), per_frame) for f in frames]
    _, rows, cols = outs[0][1]
    return torch.cat([o[0] for o in outs]), (len(frames), rows, cols), outs[0][2]


def prepare_video(data: bytes, image_cfg: ImageProcessorConfig, cfg: VideoProcessorConfig,
                  limits: VideoLimits) -> list[VideoChunk]:
    """A video's chunks, ready for MoonViT; ImageError for a bad video or one beyond ``limits``."""
    if len(data) > limits.max_bytes:
        raise ImageError(f"the video has {len(data)} bytes, more than the limit of {limits.max_bytes} "
                         "(--max-video-bytes)")
    meta = probe(data, limits)
    indices = sample_frame_indices(meta.num_frames, meta.fps, cfg)
    if len(indices) > limits.max_frames:
        raise ImageError(f"the video gives {len(indices)} frames at {min(cfg.sample_fps, meta.fps):g} frames per "
                         f"second, more than the limit of {limits.max_frames} (--max-video-frames)")
    frames = dict(zip(indices, decode_frames(data, indices), strict=True))
    out = []
    for idx, prompt in chunk_plan(indices, meta.fps, cfg):
        pixels, grid, n = preprocess_chunk([frames[i] for i in idx], image_cfg, cfg)
        out.append(VideoChunk(pixels, grid, n, prompt, tuple(idx)))
    return out
