"""ddtree == plain greedy with images, over HTTP with the official openai client: two real servers on the same tiny random Kimi K2.6 checkpoint
with a MoonViT tower (plain decoding, then DDTree with suffix drafts at a fixed budget) answer the same image
conversations token for token, and the DDTree server accepted drafts on them (``spec_stats``). The random
model's text does not repeat its prompt, so each conversation is sent twice: the second time the suffix source
drafts from the first answer, held in its shared index of finished outputs (as an agent resending a turn).
Slow: two
server start-ups (the scheduler-level check with scripted drafts, tests/server/test_image_prefill.py, runs in
the default suite)."""

from __future__ import annotations

import openai
import pytest

from tests.server.conftest import running_server
from tests.server.image_files import data_url, random_image
from tests.server.kimi_tokenizer_files import write_tiny_kimi

pytestmark = pytest.mark.slow

COMMON = ["--device", "cpu", "--dtype", "float32", "--max-total-tokens", "4096", "--chunked-prefill-size", "24",
          "--max-images-per-request", "2", "--served-model-name", "default", "--log-level", "warning"]
DDTREE = ["--speculative-algorithm", "ddtree", "--speculative-draft-sources", "suffix",
          "--speculative-ddtree-budget", "8"]


def _conversations() -> list[list[dict]]:
    def image(seed: int, size=(84, 56)) -> dict:
        return {"type": "image_url", "image_url": {"url": data_url(random_image(seed, size), "PNG")}}

    text = {"type": "text", "text": "Describe this picture."}
    return [[{"role": "user", "content": [image(1), text]}],
            [{"role": "user", "content": [text, image(2, (140, 112))]}],  # 20 image tokens over 24-token chunks
            [{"role": "user", "content": [image(3), image(4), text]}]]


def _answers(base: str) -> list[dict]:
    """Each conversation's answer through the official openai client, as a dict (``spec_stats`` included)."""
    oai = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=300)
    return [oai.chat.completions.create(model="default", messages=messages, max_tokens=32, temperature=0,
                                        logprobs=True, extra_body={"chat_template_kwargs": {"thinking": False}}
                                        ).to_dict() for messages in _conversations()]


def _tokens(answer: dict) -> list[str]:
    return [t["token"] for t in answer["choices"][0]["logprobs"]["content"]]


def test_ddtree_equals_plain_greedy_with_images_over_http(tmp_path_factory):
    path = tmp_path_factory.mktemp("kimi") / "tiny-kimi-vision"
    write_tiny_kimi(path, 512, vision=True)
    logs = tmp_path_factory.mktemp("images-ddtree")
    with running_server(["--model-path", str(path), *COMMON], logs, name="plain") as srv:
        plain = _answers(srv.base)
    with running_server(["--model-path", str(path), *COMMON, *DDTREE], logs, name="ddtree") as srv:
        first, again = _answers(srv.base), _answers(srv.base)
    for p, a, b in zip(plain, first, again, strict=True):
        assert _tokens(a) == _tokens(p) == _tokens(b)
        assert a["usage"]["prompt_tokens"] == b["usage"]["prompt_tokens"] == p["usage"]["prompt_tokens"]
    stats = [b["spec_stats"] for b in again]
    assert all(s["accepted_tokens"] >= 8 and s["acceptance_length"] > 1.5 for s in stats), stats
