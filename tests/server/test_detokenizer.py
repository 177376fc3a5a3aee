"""Incremental detokenization with the default model's tokenizer: multi-byte characters split over tokens,
stop strings spanning tokens, EOS trimming."""

from __future__ import annotations

import random

import pytest

from ddtree_serve.model_executor.default_model import default_model_dir
from ddtree_serve.server.detokenizer import IncrementalDetokenizer
from ddtree_serve.server.io_struct import DetokenizeReq, TokenOut

TEXT = "Héllo wörld — 日本語のテキスト 🎉🎉 done.\n\nUser: hi"


@pytest.fixture(scope="module")
def tokenizer():
    if not (default_model_dir() / "tokenizer.json").exists():
        pytest.skip("default model not prepared")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_model_dir()))


def _run(detok, ids, stop=(), seed=0, finish_reason="stop"):
    rng = random.Random(seed)
    detok.add(DetokenizeReq("r", stop=stop))
    pieces, i, last = [], 0, None
    while i < len(ids):
        k = rng.randint(1, 3)
        chunk, i = ids[i:i + k], i + k
        out = detok.process(TokenOut("r", chunk, finished=i >= len(ids),
                                     finish_reason=finish_reason if i >= len(ids) else None))
        if out is None:
            break
        pieces.append(out.text)
        last = out
        if out.finished:
            break
    return pieces, last


@pytest.mark.parametrize("seed", range(8))
def test_stream_matches_full_decode(tokenizer, seed) -> None:
    eos = tokenizer.eos_token_id
    ids = tokenizer.encode(TEXT, add_special_tokens=False) + [eos]
    detok = IncrementalDetokenizer(tokenizer, (eos,))
    pieces, last = _run(detok, ids, seed=seed)
    assert "".join(pieces) == TEXT  # EOS trimmed
    assert all("\ufffd" not in p for p in pieces)
    assert last.finished and last.finish_reason == "stop" and last.matched_stop == eos
    assert "r" not in detok.states


@pytest.mark.parametrize("seed", range(8))
def test_stop_string(tokenizer, seed) -> None:
    ids = tokenizer.encode(TEXT + " and some more text after it", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, ())
    pieces, last = _run(detok, ids, stop=("User:", "never"), seed=seed, finish_reason="length")
    assert "".join(pieces) == TEXT[:TEXT.index("User:")]
    assert last.finished and last.finish_reason == "stop" and last.matched_stop == "User:"
    assert last.abort_scheduler  # the scheduler has not finished it yet
    assert detok.process(TokenOut("r", [1], finished=True, finish_reason="abort")) is None


def test_held_prefix_released_on_finish(tokenizer) -> None:
    ids = tokenizer.encode("abc Use", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, ())
    pieces, last = _run(detok, ids, stop=("User:",), finish_reason="length")
    assert "".join(pieces) == "abc Use" and last.finish_reason == "length"


def test_error_passthrough(tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer, ())
    detok.add(DetokenizeReq("r"))
    out = detok.process(TokenOut("r", [], finished=True, error="too long"))
    assert out.error == "too long" and out.error_status == 400 and out.finished
