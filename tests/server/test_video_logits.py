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

import pytest
import torch

from ddtree_serve.model_executor.sampling_params import SamplingParams
from ddtree_serve.server.config import ServerConfig
from ddtree_serve.server.io_struct import GenerateReq
from ddtree_serve.server.multimodal.frontend import ImageLimits, MediaRef, VisionFrontend
from ddtree_serve.server.multimodal.video import VideoLimits
from ddtree_serve.server.scheduling.scheduler import Scheduler
from tests.model_executor.moonvit_reference import reference_chunk
from tests.model_executor.tiny_deepseek import write_reference
from tests.model_executor.tiny_moonvit import tiny_vision_config
from tests.server.kimi_tokenizer_files import special_token_ids, write_tiny_kimi
from tests.server.video_files import declare_video, video_bytes, video_data_url
from tests.speculative.scripted_drafts import greedy_script, install

VOCAB = 512
PAD = special_token_ids(VOCAB, media=True)["<|media_pad|>"]


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
