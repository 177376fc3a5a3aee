"""MoonViT's forward written from the architecture's definition, the independent reference of the tower's tests
(tests/model_executor/test_moonvit.py: images; tests/server/test_video_logits.py: video chunks): the patch
convolution as a matmul, the position table resized bicubically plus each frame's fixed sin-cos time row,
attention with 2D rotary positions as complex multiplication, an explicit softmax, explicit LayerNorm / GELU
formulas, the frames averaged per 2x2 group by index arithmetic, the projector. float32."""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F


def _ln(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * w + b


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def _gelu(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))


def time_rows(t: int, d: int) -> torch.Tensor:
    """Frame k's row: sin then cos of k * 10000^(-j / (d/2)), j < d/2 (numpy float32, as published)."""
    omega = np.arange(d // 2, dtype=np.float32) / (d / 2.0)
    omega = 1.0 / 10000 ** omega
    out = np.einsum("m,d->md", np.arange(t, dtype=np.float32), omega)
    return torch.from_numpy(np.concatenate([np.sin(out), np.cos(out)], axis=1)).float()


def reference_chunk(sd: dict[str, torch.Tensor], vc: dict, patches: torch.Tensor, t: int, h: int, w: int
                    ) -> torch.Tensor:
    """One chunk's token embeddings [h/2 * w/2, text hidden] from the definition."""
    d, heads = vc["vt_hidden_size"], vc["vt_num_attention_heads"]
    hd, hw = d // heads, h * w
    n = t * hw
    x = patches.reshape(n, -1) @ sd["vision_tower.patch_embed.proj.weight"].reshape(d, -1).T
    x = x + sd["vision_tower.patch_embed.proj.bias"]
    table = sd["vision_tower.patch_embed.pos_emb.weight"]
    if tuple(table.shape[:2]) != (h, w):
        table = F.interpolate(table.permute(2, 0, 1)[None], size=(h, w), mode="bicubic", align_corners=False)[0]
        table = table.permute(1, 2, 0)
    pos = table.reshape(hw, d)
    rows_t = time_rows(t, d) if t > 1 else torch.zeros(1, d)
    x = x + torch.cat([pos + rows_t[k] for k in range(t)])
    freqs = torch.tensor([10000.0 ** (-(4 * i) / hd) for i in range(hd // 4)])
    rows = torch.tensor([(p % hw) // w for p in range(n)], dtype=torch.float32)
    cols = torch.tensor([(p % hw) % w for p in range(n)], dtype=torch.float32)
    cis = torch.empty(n, hd // 2, dtype=torch.complex64)
    cis[:, 0::2] = torch.polar(torch.ones(n, hd // 4), cols[:, None] * freqs)
    cis[:, 1::2] = torch.polar(torch.ones(n, hd // 4), rows[:, None] * freqs)

    def rot(v: torch.Tensor) -> torch.Tensor:
        c = torch.view_as_complex(v.reshape(n, heads, hd // 2, 2).contiguous()) * cis[:, None, :]
        return torch.view_as_real(c).reshape(n, heads, hd)

    for i in range(vc["vt_num_hidden_layers"]):
        b = f"vision_tower.encoder.blocks.{i}."
        y = _ln(x, sd[b + "norm0.weight"], sd[b + "norm0.bias"])
        qkv = (y @ sd[b + "wqkv.weight"].T + sd[b + "wqkv.bias"]).reshape(n, 3, heads, hd)
        q, k, v = rot(qkv[:, 0]), rot(qkv[:, 1]), qkv[:, 2]
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
        probs = torch.exp(scores - scores.amax(-1, keepdim=True))
        probs = probs / probs.sum(-1, keepdim=True)
        x = x + torch.einsum("hqk,khd->qhd", probs, v).reshape(n, d) @ sd[b + "wo.weight"].T + sd[b + "wo.bias"]
        y = _ln(x, sd[b + "norm1.weight"], sd[b + "norm1.bias"])
        x = x + _gelu_tanh(y @ sd[b + "mlp.fc0.weight"].T + sd[b + "mlp.fc0.bias"]) @ sd[b + "mlp.fc1.weight"].T \
            + sd[b + "mlp.fc1.bias"]
    x = _ln(x, sd["vision_tower.encoder.final_layernorm.weight"], sd["vision_tower.encoder.final_layernorm.bias"])
    out = []
    for r in range(h // 2):
        for c in range(w // 2):
            group = torch.stack([sum(x[f * hw + (2 * r + dr) * w + 2 * c + dc] for f in range(t)) / t
                                 for dr in (0, 1) for dc in (0, 1)])  # [4, d], the frames averaged
            g = _ln(group, sd["mm_projector.pre_norm.weight"], sd["mm_projector.pre_norm.bias"],
                    vc["projector_ln_eps"]).reshape(-1)
            g = _gelu(g @ sd["mm_projector.proj.0.weight"].T + sd["mm_projector.proj.0.bias"])
            out.append(g @ sd["mm_projector.proj.2.weight"].T + sd["mm_projector.proj.2.bias"])
    return torch.stack(out)


def reference_embed(sd: dict[str, torch.Tensor], vc: dict, patches: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """One image's token embeddings [h/2 * w/2, text hidden] from the definition: a chunk of one frame."""
    return reference_chunk(sd, vc, patches, 1, h, w)
