"""Images through the scheduler (ddtree_serve/server/scheduling/image_prefill.py, the prefix cache's image keys) on a tiny
random Kimi K2.6 checkpoint with a MoonViT tower: an image changes the greedy output; chunked prefill that
splits a prompt inside an image gives the same tokens; the same image resent is a prefix-cache hit past its
span and a different image is not, with outputs unchanged; ddtree (scripted drafts that accept and reject)
equals plain greedy with images."""

from __future__ import annotations

import pytest

from ddtree_serve.model_executor.sampling_params import SamplingParams
from ddtree_serve.server.config import ServerConfig
from ddtree_serve.server.io_struct import GenerateReq, ImageInput
from ddtree_serve.server.multimodal.frontend import ImageLimits, VisionFrontend
from ddtree_serve.server.multimodal.image_processor import ImageProcessorConfig
from ddtree_serve.server.scheduling.scheduler import Scheduler
from tests.server.image_files import data_url, random_image
from tests.server.kimi_tokenizer_files import special_token_ids, write_tiny_kimi
from tests.speculative.scripted_drafts import greedy_script, install

VOCAB = 512
PAD = special_token_ids(VOCAB, media=True)["<|media_pad|>"]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def kimi(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("kimi-vision")
    write_tiny_kimi(path, VOCAB, vision=True)
    return str(path)


@pytest.fixture(scope="module")
def plain(kimi) -> Scheduler:
    """A plain scheduler without the prefix cache, whole prompts in one chunk: the reference."""
    return _scheduler(kimi, cache=False)


def _scheduler(path: str, algorithm: str = "none", chunk: int = 512, cache: bool = True, **kw) -> Scheduler:
    spec = dict(speculative_algorithm="ddtree", speculative_ddtree_budget=8) if algorithm == "ddtree" else {}
    return Scheduler(ServerConfig.from_flat(dict(model_path=path, dtype="float32", device="cpu", context_length=512,
                                                 max_running_requests=4, max_total_tokens=4096,
                                                 chunked_prefill_size=chunk, disable_radix_cache=not cache, **spec,
                                                 **kw)))


def _prompt(text: list[int], seeds: list[int], tail: list[int]) -> tuple[list[int], tuple[ImageInput, ...]]:
    """``text``, one image per seed (each 56 x 84 pixels: 6 tokens), then ``tail``."""
    front = VisionFrontend(ImageProcessorConfig(), PAD, ImageLimits(8, 10**7, 10**7))
    images = front.load([data_url(random_image(s, (56, 84))) for s in seeds])
    return front.expand(text + [PAD] * len(seeds) + tail, images)


def _run(s: Scheduler, reqs: list[tuple[str, list[int], tuple[ImageInput, ...]]],
         params: SamplingParams = GREEDY) -> dict[str, tuple[list[int], int]]:
    """rid -> (output tokens, cached prompt tokens) of ``reqs`` run together to the end."""
    for rid, ids, images in reqs:
        s.add_request(GenerateReq(rid, ids, params, images))
    out: dict[str, tuple[list[int], int]] = {}
    while s.has_work():
        for o in s.step():
            assert o.error is None, o.error
            toks, _ = out.get(o.rid, ([], 0))
            out[o.rid] = (toks + o.token_ids, o.cached_tokens)
    return out


def test_images_change_the_output_and_a_split_inside_an_image_is_exact(kimi, plain):
    text, tail = [5, 17, 42, 99, 3], [7, 8, 9]
    prompts = {f"img{k}": _prompt(text, [k], tail) for k in (1, 2, 3)}
    whole = _run(plain, [(rid, *p) for rid, p in prompts.items()])
    split = _run(_scheduler(kimi, chunk=7, cache=False), [(rid, *p) for rid, p in prompts.items()])
    assert {r: o for r, (o, _) in split.items()} == {r: o for r, (o, _) in whole.items()}
    ids, images = prompts["img1"]
    assert images[0].offset == len(text) and images[0].num_tokens == 6 and ids[5:11] == [PAD] * 6
    bare = _run(plain, [("none", ids, ())])["none"][0]  # placeholders, no image
    outputs = [o for o, _ in whole.values()] + [bare]
    assert len({tuple(o) for o in outputs}) >= 3, outputs


def test_prefix_cache_keys_image_tokens_by_content(kimi, plain):
    s = _scheduler(kimi, chunk=16)
    text, tail = [11, 12, 13, 14], [21, 22, 23, 24, 25]
    first = _run(s, [("a", *_prompt(text, [1], tail))])["a"]
    again = _run(s, [("a2", *_prompt(text, [1], tail))])["a2"]  # the same image, decoded afresh
    other = _run(s, [("b", *_prompt(text, [2], tail))])["b"]
    assert first[1] == 0
    assert again[1] >= len(text) + 6 and again[0] == first[0]  # matched past the image; the same output
    assert other[1] <= len(text)  # the text before the image only
    fresh = _run(plain, [("b-fresh", *_prompt(text, [2], tail))])["b-fresh"]
    assert other[0] == fresh[0]
    s.kv.tree.check()


def test_ddtree_equals_plain_greedy_with_images(kimi):
    prompts = {"p1": _prompt([5, 6, 7], [4], [8, 9]), "p2": _prompt([30, 31], [5, 6], [32, 33, 34])}
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = _run(_scheduler(kimi, chunk=8), [(rid, *p) for rid, p in prompts.items()], params)
    refs = {tuple(prompts[rid][0]): toks for rid, (toks, _) in plain.items()}
    s = _scheduler(kimi, "ddtree", chunk=8)
    log = install(s, greedy_script(refs, VOCAB))
    spec = _run(s, [(rid, *p) for rid, p in prompts.items()], params)
    assert {r: o for r, (o, _) in spec.items()} == {r: o for r, (o, _) in plain.items()}
    log.assert_accepted()


def test_text_only_mode_loads_no_tower_and_refuses_images(kimi, plain):
    """--max-images-per-request 0: the tower's weights are skipped; an image request is refused at admission."""
    s = _scheduler(kimi, cache=False, max_images_per_request=0)
    assert s.runner.model.vision is None and plain.runner.model.vision is not None
    ids, images = _prompt([5], [1], [6])
    with pytest.raises(ValueError, match="no vision tower"):
        s.add_request(GenerateReq("x", ids, GREEDY, images))
