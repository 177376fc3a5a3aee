"""MoonViT, Kimi K2.5 / K2.6's vision tower, and its patch-merger projector (plain torch, replicated on every
TP rank: ~0.4B parameters, exact on every rank without collectives).

Architecture (the published checkpoints' ``vision_config``; names below are the checkpoint's tensor names):

- ``vision_tower.patch_embed.proj``: a 14x14 stride-14 convolution over each patch ``[3, 14, 14]`` -> ``D``;
  ``vision_tower.patch_embed.pos_emb.weight`` ``[H0, W0, D]`` (64 x 64) is a learned 2D position table,
  resized bicubically (``align_corners=False``) to the image's patch grid ``(h, w)`` when that differs, and
  added to the patch embeddings (row-major over the grid). A video chunk of ``t`` > 1 frames (``init_pos_emb_time``
  at most) lays its frames' patches out frame after frame, each frame with the same 2D table plus a fixed 1D
  sin-cos time row: for frame ``k``, ``[sin(k w_j), cos(k w_j)]`` over ``j < D/2``, ``w_j = 10000^(-2j/D)``
  (not a checkpoint tensor); an image, or a one-frame chunk, gets no time term.
- ``vision_tower.encoder.blocks.{i}``: pre-LayerNorm blocks, ``x += wo(attn(norm0(x)))``,
  ``x += mlp.fc1(gelu_tanh(mlp.fc0(norm1(x))))``; ``wqkv`` packs q, k, v as ``[3, heads, head_dim]`` (with
  biases). Attention is bidirectional inside one image or one video chunk, across all its frames (never
  across images or chunks), scale ``1/sqrt(head_dim)``.
  Queries and keys get a 2D rotary embedding: the head dimension is read as ``head_dim/2`` complex pairs
  (elements ``2k, 2k+1``); pair ``2i`` turns by ``col * f_i`` and pair ``2i+1`` by ``row * f_i``, with
  ``f_i = 10000^(-4i/head_dim)``, ``i < head_dim/4``, (row, col) the patch's place in the grid (the same for
  every frame of a chunk).
- ``vision_tower.encoder.final_layernorm``; then the 2x2 merge: each 2x2 block of neighbouring patches
  (row-major over the ``h/2 x w/2`` merged grid) becomes one token of ``4 x D`` features, in the order
  (0,0), (0,1), (1,0), (1,1); a chunk's ``t`` frames are averaged first (``merge_type`` ``sd2_tpool``), so a
  chunk gives ``h/2 * w/2`` tokens like one image.
- ``mm_projector`` (``patchmerger``): ``pre_norm`` LayerNorm over each patch's ``D`` features
  (``projector_ln_eps``), flatten to ``4D``, ``proj.0`` Linear ``4D -> 4D``, exact GELU, ``proj.2`` Linear
  ``4D -> text hidden``. One output row per image token.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ddtree_serve.model_executor.weight_loader import default_weight_loader

VISION_PREFIXES = ("vision_tower.", "mm_projector.")


@dataclass(frozen=True)
class MoonViTConfig:
    """The checkpoint's ``vision_config`` (Kimi K2.5 / K2.6 spellings)."""

    patch_size: int = 14
    hidden_size: int = 1152  # vt_hidden_size
    num_layers: int = 27  # vt_num_hidden_layers
    num_heads: int = 16  # vt_num_attention_heads
    intermediate_size: int = 4304  # vt_intermediate_size
    pos_emb_height: int = 64  # init_pos_emb_height
    pos_emb_width: int = 64  # init_pos_emb_width
    pos_emb_time: int = 4  # init_pos_emb_time: the most frames one video chunk may have
    merge_kernel: tuple[int, int] = (2, 2)  # merge_kernel_size
    text_hidden_size: int = 7168
    projector_ln_eps: float = 1e-5
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_hf(cls, vc: dict[str, Any], text_hidden_size: int) -> MoonViTConfig:
        """From ``config.json``'s ``vision_config``; ValueError for a layout this tower does not implement."""
        for key, want in (("pos_emb_type", "divided_fixed"), ("merge_type", "sd2_tpool"),
                          ("mm_projector_type", "patchmerger"), ("video_attn_type", "spatial_temporal")):
            if vc.get(key, want) != want:
                raise ValueError(f"vision_config.{key} = {vc[key]!r} is not supported (only {want!r})")
        mm_hidden = vc.get("mm_hidden_size", vc["vt_hidden_size"])
        if mm_hidden != vc["vt_hidden_size"]:
            raise ValueError(f"vision_config.mm_hidden_size {mm_hidden} != vt_hidden_size {vc['vt_hidden_size']}")
        if vc.get("qkv_hidden_size", vc["vt_hidden_size"]) != vc["vt_hidden_size"]:
            raise ValueError("vision_config.qkv_hidden_size != vt_hidden_size is not supported")
        merge = vc.get("merge_kernel_size", [2, 2])
        return cls(patch_size=int(vc["patch_size"]), hidden_size=int(vc["vt_hidden_size"]),
                   num_layers=int(vc["vt_num_hidden_layers"]), num_heads=int(vc["vt_num_attention_heads"]),
                   intermediate_size=int(vc["vt_intermediate_size"]),
                   pos_emb_height=int(vc.get("init_pos_emb_height", 64)),
                   pos_emb_width=int(vc.get("init_pos_emb_width", 64)),
                   pos_emb_time=int(vc.get("init_pos_emb_time", 4)),
                   merge_kernel=(int(merge[0]), int(merge[1])),
                   text_hidden_size=int(vc.get("text_hidden_size", text_hidden_size)),
                   projector_ln_eps=float(vc.get("projector_ln_eps", 1e-5)))

    def num_parameters(self) -> int:
        """Parameters of the tower and projector (what ``plan`` counts)."""
        d, i, p = self.hidden_size, self.intermediate_size, self.patch_size
        m = d * self.merge_kernel[0] * self.merge_kernel[1]
        block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (i * d + i) + (d * i + d)
        return (3 * p * p * d + d + self.pos_emb_height * self.pos_emb_width * d + self.num_layers * block + 2 * d
                + 2 * d + (m * m + m) + (m * self.text_hidden_size + self.text_hidden_size))


def read_vision_config(path: str) -> tuple[MoonViTConfig | None, int | None]:
    """The vision tower's config and the image placeholder token id from a Kimi K2.5/K2.6 ``config.json``;
    (None, None) when it has no complete ``vision_config`` (a text-only wrapper, or another model)."""
    cfg_path = Path(path) / "config.json"
    if not path or not cfg_path.exists():
        return None, None
    full = json.loads(cfg_path.read_text())
    vc = full.get("vision_config") or {}
    if "vt_hidden_size" not in vc:
        return None, None
    text_hidden = int((full.get("text_config") or full)["hidden_size"])
    token = full.get("media_placeholder_token_id")
    return MoonViTConfig.from_hf(vc, text_hidden), (int(token) if token is not None else None)


class PatchEmbed(nn.Module):
    def __init__(self, cfg: MoonViTConfig, dtype: torch.dtype):
        super().__init__()
        p = cfg.patch_size
        self.proj = nn.Conv2d(3, cfg.hidden_size, kernel_size=p, stride=p, dtype=dtype)
        self.pos_emb = nn.Module()
        self.pos_emb.weight = nn.Parameter(torch.empty(cfg.pos_emb_height, cfg.pos_emb_width, cfg.hidden_size,
                                                       dtype=dtype), requires_grad=False)

    def forward(self, patches: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """``patches`` [t*h*w, 3, p, p] of one image (t = 1) or video chunk, frame after frame, each row-major
        over the ``grid`` (t, h, w) -> [t*h*w, D]."""
        t, h, w = grid
        x = self.proj(patches.to(self.proj.weight.dtype)).flatten(1)  # [L, D]
        table = self.pos_emb.weight  # [H0, W0, D]
        if (h, w) != tuple(table.shape[:2]):
            table = F.interpolate(table.float().permute(2, 0, 1).unsqueeze(0), size=(h, w), mode="bicubic",
                                  align_corners=False).squeeze(0).permute(1, 2, 0)  # [h, w, D]
        table = table.reshape(-1, table.shape[-1])  # [h*w, D]
        if t > 1:
            table = (table.float()[None] + time_embedding(t, table.shape[-1], x.device)[:, None]).flatten(0, 1)
        return x + table.to(x.dtype)


def time_embedding(t: int, dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[t, dim] float32: frame k's fixed 1D sin-cos row, [sin(k w_j), cos(k w_j)], w_j = 10000^(-2j/dim)."""
    w = 1.0 / 10000.0 ** (torch.arange(dim // 2, dtype=torch.float64, device=device) / (dim / 2.0))
    angles = torch.arange(t, dtype=torch.float64, device=device)[:, None] * w  # [t, dim/2]
    return torch.cat([angles.sin(), angles.cos()], dim=-1).float()


def rope_2d(grid: tuple[int, int], head_dim: int, theta: float, device: torch.device
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [h*w, head_dim/2] (float32) of the 2D rotary embedding: pair 2i by col*f_i, 2i+1 by row*f_i."""
    h, w = grid
    freqs = theta ** (-torch.arange(0, head_dim, 4, device=device)[: head_dim // 4].float() / head_dim)  # [hd/4]
    rows = torch.arange(h, device=device).repeat_interleave(w).float()  # [L]
    cols = torch.arange(w, device=device).repeat(h).float()  # [L]
    angles = torch.stack([cols[:, None] * freqs, rows[:, None] * freqs], dim=-1).flatten(1)  # [L, hd/2]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` [L, heads, hd]: rotate each pair (x[2k], x[2k+1]) by angle k (float32 math, back to x's dtype)."""
    xf = x.float().unflatten(-1, (-1, 2))  # [L, heads, hd/2, 2]
    a, b = xf[..., 0], xf[..., 1]
    c, s = cos[:, None, :], sin[:, None, :]  # [L, 1, hd/2]
    return torch.stack([a * c - b * s, a * s + b * c], dim=-1).flatten(-2).to(x.dtype)


class MLP(nn.Module):
    def __init__(self, d: int, inter: int, dtype: torch.dtype):
        super().__init__()
        self.fc0 = nn.Linear(d, inter, dtype=dtype)
        self.fc1 = nn.Linear(inter, d, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1(F.gelu(self.fc0(x), approximate="tanh"))


class EncoderBlock(nn.Module):
    def __init__(self, cfg: MoonViTConfig, dtype: torch.dtype):
        super().__init__()
        d = cfg.hidden_size
        self.heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.norm0 = nn.LayerNorm(d, dtype=dtype)
        self.norm1 = nn.LayerNorm(d, dtype=dtype)
        self.wqkv = nn.Linear(d, 3 * d, dtype=dtype)
        self.wo = nn.Linear(d, d, dtype=dtype)
        self.mlp = MLP(d, cfg.intermediate_size, dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x`` [L, D] of one image."""
        q, k, v = self.wqkv(self.norm0(x)).unflatten(-1, (3, self.heads, self.head_dim)).unbind(1)  # [L, h, hd]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # 4-D [1, h, L, hd]: the fused kernels (flash / memory-efficient) take it, no [h, L, L] scores on CUDA
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                           v.transpose(0, 1)[None])[0]  # [h, L, hd]
        x = x + self.wo(o.transpose(0, 1).flatten(1))  # [L, D]
        return x + self.mlp(self.norm1(x))


class Encoder(nn.Module):
    def __init__(self, cfg: MoonViTConfig, dtype: torch.dtype):
        super().__init__()
        self.cfg = cfg
        self.blocks = nn.ModuleList(EncoderBlock(cfg, dtype) for _ in range(cfg.num_layers))
        self.final_layernorm = nn.LayerNorm(cfg.hidden_size, dtype=dtype)

    def forward(self, x: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        cos, sin = rope_2d(grid[1:], self.cfg.head_dim, self.cfg.rope_theta, x.device)  # [h*w, hd/2]
        if grid[0] > 1:  # every frame of a chunk: the same 2D positions
            cos, sin = cos.repeat(grid[0], 1), sin.repeat(grid[0], 1)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.final_layernorm(x)


class MoonViT(nn.Module):
    """The vision tower: one image's (or video chunk's) patches -> merged groups [h/2 * w/2, 4, D]."""

    def __init__(self, cfg: MoonViTConfig, dtype: torch.dtype):
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg, dtype)
        self.encoder = Encoder(cfg, dtype)

    def forward(self, patches: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        t, h, w = grid
        kh, kw = self.cfg.merge_kernel
        x = self.encoder(self.patch_embed(patches, grid), grid)  # [t*h*w, D]
        x = x.view(t, h // kh, kh, w // kw, kw, -1)
        x = x[0] if t == 1 else x.mean(dim=0)  # the chunk's frames pooled: [h/kh, kh, w/kw, kw, D]
        return x.permute(0, 2, 1, 3, 4).reshape((h // kh) * (w // kw), kh * kw, -1)


class PatchMergerProjector(nn.Module):
    """``mm_projector``: merged groups [N, 4, D] -> image token embeddings [N, text hidden]."""

    def __init__(self, cfg: MoonViTConfig, dtype: torch.dtype):
        super().__init__()
        d = cfg.hidden_size
        m = d * cfg.merge_kernel[0] * cfg.merge_kernel[1]
        self.pre_norm = nn.LayerNorm(d, eps=cfg.projector_ln_eps, dtype=dtype)
        self.proj = nn.Sequential(nn.Linear(m, m, dtype=dtype), nn.GELU(),
                                  nn.Linear(m, cfg.text_hidden_size, dtype=dtype))

    def forward(self, groups: torch.Tensor) -> torch.Tensor:
        return self.proj(self.pre_norm(groups).flatten(1))  # [N, text hidden]


class KimiVision(nn.Module):
    """Tower + projector under the checkpoint's names (``vision_tower.*``, ``mm_projector.*``)."""

    def __init__(self, cfg: MoonViTConfig, dtype: torch.dtype):
        super().__init__()
        self.cfg = cfg
        self.vision_tower = MoonViT(cfg, dtype)
        self.mm_projector = PatchMergerProjector(cfg, dtype)

    @torch.inference_mode()
    def embed_images(self, pixel_values: list[torch.Tensor], grids: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        """Per image: ``pixel_values[i]`` [t*h*w, 3, p, p] (normalised, see ddtree_serve/server/multimodal/image_processor.py)
        with ``grids[i]`` = (t, h, w) patches -> [h/2 * w/2, text hidden] embeddings: an image (t = 1), or a
        video chunk of t <= ``pos_emb_time`` frames (pooled to one frame's tokens)."""
        out = []
        for pv, (t, h, w) in zip(pixel_values, grids, strict=True):
            if not 1 <= t <= self.cfg.pos_emb_time:
                raise ValueError(f"MoonViT takes 1 to {self.cfg.pos_emb_time} frames per chunk, got t = {t}")
            out.append(self.mm_projector(self.vision_tower(pv, (t, h, w))))
        return out

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Copy ``vision_tower.*`` / ``mm_projector.*`` tensors (a tensor or a lazy slice) into the modules;
        ValueError on an unexpected or a missing one."""
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            if name not in params:
                raise ValueError(f"unexpected vision weight {name!r}")
            default_weight_loader(params[name], tensor)
            loaded.add(name)
        missing = set(params) - loaded
        if missing:
            raise ValueError(f"checkpoint is missing vision weights: {sorted(missing)[:8]}")


def merged_tokens(grid: tuple[int, int], merge: tuple[int, int] = (2, 2)) -> int:
    """Image tokens of a patch grid (h, w): (h / kh) * (w / kw)."""
    return (grid[0] // merge[0]) * (grid[1] // merge[1])


def encoder_peak_bytes(cfg: MoonViTConfig, max_patches: int, dtype_bytes: int, fused: bool = True) -> int:
    """A bound of the tower's activation peak for one image of ``max_patches`` patches: the residual, the normed
    input, qkv, the attention output, the MLP hidden, and float32 rotary copies of q, k; with ``fused`` False
    (SDPA's math path) also the ``[heads, L, L]`` scores and their softmax."""
    d, i = cfg.hidden_size, cfg.intermediate_size
    scores = 0 if fused else 2 * cfg.num_heads * max_patches * max_patches * dtype_bytes
    return max_patches * ((6 * d + i) * dtype_bytes + 2 * d * 4) + scores


def fused_attention_available(device: torch.device | str) -> bool:
    """Whether SDPA runs a fused kernel (no ``[heads, L, L]`` scores) for the tower's 4-D attention on
    ``device``: on CUDA when the flash or memory-efficient backend is enabled (MoonViT's head dim, 72, suits
    both), else the math path; on CPU torch's fused CPU kernel takes 4-D inputs without a mask."""
    if not str(device).startswith("cuda"):
        return True
    return bool(torch.backends.cuda.flash_sdp_enabled() or torch.backends.cuda.mem_efficient_sdp_enabled())


def read_media_config(path: str) -> dict[str, Any]:
    """``media_proc_cfg`` of the checkpoint's ``preprocessor_config.json`` ({} when absent)."""
    f = Path(path) / "preprocessor_config.json" if path else None
    if f is None or not f.exists():
        return {}
    return json.loads(f.read_text()).get("media_proc_cfg") or {}


DEFAULT_IN_PATCH_LIMIT = 16384  # Kimi K2.5 / K2.6's published in_patch_limit
DEFAULT_SIDE_LIMIT = 512  # patch_limit_on_one_side


def max_vision_patches(path: str, merge: int = 2, frames: int = 4) -> int:
    """The most patches one image or one video chunk (``frames`` frames, each under the per-frame limit
    ``in_patch_limit_each_frame``, 4096 published, padded like an image) reaches: what the tower's
    activation reserve is sized for."""
    media = read_media_config(path)
    side = int(media.get("patch_limit_on_one_side", DEFAULT_SIDE_LIMIT))
    m = int(media.get("merge_kernel_size", merge))
    each = media.get("in_patch_limit_each_frame", 4096) or int(media.get("in_patch_limit", DEFAULT_IN_PATCH_LIMIT))
    chunk = int(media.get("temporal_merge_kernel_size", frames))
    per_frame = int(each) + 2 * (m - 1) * min(side, int(each)) + (m - 1) ** 2
    return max(max_image_patches(path, merge), chunk * per_frame)


def max_image_patches(path: str, merge: int = 2) -> int:
    """The most patches one image reaches after resizing and padding: ``in_patch_limit`` (read from the
    checkpoint's preprocessor config; the published default, logged, when absent) plus the padding of each
    side to a multiple of the merge kernel (h*w <= limit and h, w <= the side limit:
    (h + m - 1)(w + m - 1) <= limit + 2 (m - 1) side + (m - 1)^2)."""
    media = read_media_config(path)
    if "in_patch_limit" not in media:
        logging.getLogger(__name__).info("no in_patch_limit in %s/preprocessor_config.json: sizing the vision tower "
                                         "for the published %d patches", path, DEFAULT_IN_PATCH_LIMIT)
    limit = int(media.get("in_patch_limit", DEFAULT_IN_PATCH_LIMIT))
    side = int(media.get("patch_limit_on_one_side", DEFAULT_SIDE_LIMIT))
    m = int(media.get("merge_kernel_size", merge))
    return limit + 2 * (m - 1) * min(side, limit) + (m - 1) ** 2
