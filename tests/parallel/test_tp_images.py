"""Images under TP=2 (gloo, 2 processes): the replicated MoonViT tower on each rank, the pixels carried by the
broadcast request; greedy tokens equal TP=1's, prompts split inside images by chunked prefill, a resent image
served from the prefix cache."""

from __future__ import annotations

import pytest

from ddtree_serve.model_executor.sampling_params import SamplingParams
from ddtree_serve.server.engine import Engine
from ddtree_serve.server.io_struct import GenerateReq
from tests.server.kimi_tokenizer_files import write_tiny_kimi
from tests.server.test_image_prefill import VOCAB, _prompt

pytestmark = pytest.mark.slow  # two TP=2 processes plus a TP=1 engine (~30 s on 2 cores)

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _tokens(path: str, prompts: dict, **kw) -> dict[str, list[int]]:
    eng = Engine(path, device="cpu", dtype="float32", max_total_tokens=1024, chunked_prefill_size=8, **kw)
    try:
        sch = eng.scheduler
        out: dict[str, list[int]] = {}
        for rid, (ids, images) in prompts.items():
            sch.add_request(GenerateReq(rid, ids, GREEDY, images))
            while sch.has_work():  # one after the other: the resent image finds the first one cached
                for o in sch.step():
                    assert o.error is None, o.error
                    out.setdefault(o.rid, []).extend(o.token_ids)
        return out
    finally:
        eng.shutdown()


def test_tp2_with_images_equals_tp1(tmp_path) -> None:
    write_tiny_kimi(tmp_path, VOCAB, vision=True)
    prompts = {"a": _prompt([5, 6, 7], [1], [8, 9]), "b": _prompt([30, 31], [2, 3], [32]),
               "a-again": _prompt([5, 6, 7], [1], [8, 9, 10])}
    ref = _tokens(str(tmp_path), prompts)
    assert _tokens(str(tmp_path), prompts, tp_size=2) == ref
