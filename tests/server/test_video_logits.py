"""Video through MoonViT and the text model, exact against references written here, on a tiny random Kimi K2.6
checkpoint with a MoonViT tower that declares Kimi's video fields (tests/server/video_files.py):

- the tower on a video chunk (t frames) against a forward written from the architecture's definition: the
  patch convolution as a matmul, the bicubically resized 2D table plus each frame's fixed sin-cos time row
  (numpy, float32), attention over all the chunk's patches with the 2D rotary positions repeated per frame
  as complex multiplication, an explicit softmax, the frames averaged per 2x2 group, then the projector;
- the served logits with speculation on (ddtree, scripted drafts that accept and reject) against transformers'
  DeepseekV3 on the dequantized weights, fed the reference chunk embeddings over the placeholder rows: the
  greedy tokens and every step's log-probabilities."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ddtree_serve.model_executor.sampling_params import SamplingParams
from ddtree_serve.server.config import ServerConfig
from ddtree_serve.server.io_struct import GenerateReq
from ddtree_serve.server.multimodal.frontend import ImageLimits, MediaRef, VisionFrontend
from ddtree_serve.server.multimodal.video import VideoLimits
from ddtree_serve.server.scheduling.scheduler import Scheduler
from tests.model_executor.test_moonvit import _gelu, _gelu_tanh, _ln
from tests.model_executor.tiny_deepseek import write_reference
from tests.model_executor.tiny_moonvit import tiny_vision_config
from tests.server.kimi_tokenizer_files import special_token_ids, write_tiny_kimi
from tests.server.video_files import declare_video, video_bytes, video_data_url
from tests.speculative.scripted_drafts import greedy_script, install

VOCAB = 512
PAD = special_token_ids(VOCAB, media=True)["<|media_pad|>"]


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


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("kimi-video")
    tiny = write_tiny_kimi(path, VOCAB, vision=True)
    declare_video(path)
    return tiny, write_reference(tiny, tmp_path_factory.mktemp("kimi-video-ref"))


def _scheduler(path: str, ddtree: bool) -> Scheduler:
    spec = dict(speculative_algorithm="ddtree", speculative_ddtree_budget=8) if ddtree else {}
    return Scheduler(ServerConfig.from_flat(dict(model_path=path, dtype="float32", device="cpu", context_length=512,
                                                 max_running_requests=2, max_total_tokens=4096,
                                                 chunked_prefill_size=16, max_videos_per_request=1, **spec)))


def test_the_encoder_reserve_covers_a_chunk_only_with_video_on(ckpt):
    """--max-videos-per-request > 0 sizes the tower's reserve for a chunk of 4 frames of 4096 patches each (plus
    the merge padding), more than the largest image; with video off (the default) the image bound stays."""
    from ddtree_serve.model_executor.models.moonvit import max_image_patches, max_vision_patches

    tiny, _ = ckpt
    chunk = 4 * (4096 + 2 * 512 + 1)
    assert max_vision_patches(tiny.path) == chunk > max_image_patches(tiny.path) == 16384 + 2 * 512 + 1
    assert _scheduler(tiny.path, ddtree=False).runner.model.max_image_patches == chunk
    off = Scheduler(ServerConfig.from_flat(dict(model_path=tiny.path, dtype="float32", device="cpu",
                                                context_length=512, max_total_tokens=4096)))
    assert off.runner.model.max_image_patches == 16384 + 2 * 512 + 1


@pytest.mark.parametrize("grid", [(4, 4, 4), (2, 6, 4), (3, 8, 8), (1, 4, 6)])
def test_the_tower_on_a_chunk_matches_the_reference(ckpt, grid):
    tiny, _ = ckpt
    t, h, w = grid
    patches = torch.rand(t * h * w, 3, 14, 14, generator=torch.Generator().manual_seed(t * 1000 + h * 10 + w)) * 2 - 1
    s = _scheduler(tiny.path, ddtree=False)
    got = s.runner.model.embed_images([patches], [grid])[0]
    want = reference_chunk(tiny.vision_state, tiny_vision_config(tiny.text_config["hidden_size"]), patches, t, h, w)
    torch.testing.assert_close(got, want, atol=5e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="1 to 4 frames"):
        s.runner.model.embed_images([torch.rand(5 * 16, 3, 14, 14)], [(5, 4, 4)])


def test_served_logits_with_speculation_match_the_reference(ckpt):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tiny, ref_path = ckpt

    tok = AutoTokenizer.from_pretrained(tiny.path, trust_remote_code=True)
    front = VisionFrontend.for_model(tiny.path, tok, ImageLimits(2, 10**6, 10**6),
                                     VideoLimits(10**7, 60, 64, 10**6), max_videos=1)
    video, = asyncio.run(front.prepare([MediaRef("video", video_data_url(video_bytes(10, fps=4, size=(70, 56))))]))
    chunks = list(video.chunks)
    assert [c.grid for c in chunks] == [(4, 4, 6), (1, 4, 6)]  # 5 frames sampled: a chunk of 4, one of 1
    ids, inputs = front.expand([5, 17, 42] + [PAD] * len(chunks) + [7, 8, 9], chunks)

    vc = tiny_vision_config(tiny.text_config["hidden_size"])
    ref = AutoModelForCausalLM.from_pretrained(ref_path, dtype=torch.float32).eval()
    steps = 8
    with torch.no_grad():
        embeds = ref.get_input_embeddings()(torch.tensor(ids)).clone()
        for im in inputs:
            embeds[im.offset:im.end] = reference_chunk(tiny.vision_state, vc, im.pixel_values, *im.grid)
        want_tokens, want_logprobs = [], []
        for _ in range(steps):
            logits = ref(inputs_embeds=embeds[None]).logits[0, -1]
            lp = torch.log_softmax(logits.double(), -1)
            tok_id = int(logits.argmax())
            want_tokens.append(tok_id)
            want_logprobs.append(lp)
            embeds = torch.cat([embeds, ref.get_input_embeddings()(torch.tensor([tok_id]))])

    s = _scheduler(tiny.path, ddtree=True)
    log = install(s, greedy_script({tuple(ids): want_tokens}, VOCAB))
    s.add_request(GenerateReq("v", ids, SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True, logprobs=3),
                              inputs))
    tokens, logprobs = [], []
    while s.has_work():
        for o in s.step():
            assert o.error is None, o.error
            tokens += o.token_ids
            logprobs += o.logprobs or []
    assert tokens == want_tokens
    for k, ((lp, top), want) in enumerate(zip(logprobs, want_logprobs, strict=True)):
        assert math.isclose(lp, float(want[tokens[k]]), abs_tol=2e-4), (k, lp, float(want[tokens[k]]))
        for alt, alt_lp in top:
            assert math.isclose(alt_lp, float(want[alt]), abs_tol=2e-4), (k, alt, alt_lp)
    log.assert_accepted()
