"""Image inputs over HTTP with the official clients, on a tiny random Kimi K2.6 checkpoint with a MoonViT tower
and the stand-in Kimi tokenizer: an image changes the answer; the same image resent is a prefix-cache hit
(``cached_tokens``) and a different one is not; bad images, http URLs and too many images are 400s naming
``messages`` and reach no scheduler; Anthropic ``image`` blocks give the chat answer. (ddtree == plain greedy
with images: tests/server/test_image_prefill.py; a model without a vision tower: test_no_vision_model_refuses.)"""

from __future__ import annotations

import base64

import anthropic
import httpx
import openai
import pytest

from tests.server.conftest import running_server
from tests.server.image_files import data_url, image_bytes, random_image
from tests.server.kimi_tokenizer_files import write_tiny_kimi

OFF = {"chat_template_kwargs": {"thinking": False}}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("kimi") / "tiny-kimi-vision"
    write_tiny_kimi(path, 512, vision=True)
    args = ["--model-path", str(path), "--device", "cpu", "--dtype", "float32", "--max-total-tokens", "4096",
            "--chunked-prefill-size", "24", "--max-images-per-request", "2", "--max-image-bytes", "60000",
            "--served-model-name", "default", "--log-level", "warning"]
    with running_server(args, tmp_path_factory.mktemp("kimi-images")) as srv:
        yield srv.base


@pytest.fixture(scope="module")
def oai(base):
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)


def _ask(oai, content, max_tokens: int = 8, **extra):
    return oai.chat.completions.create(model="default", messages=[{"role": "user", "content": content}],
                                       max_tokens=max_tokens, temperature=0, logprobs=True, top_logprobs=2,
                                       extra_body={**OFF, **extra})


def _image(seed: int, size=(84, 56), fmt: str = "PNG") -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(random_image(seed, size), fmt)}}


def _first_logprobs(r) -> list[float]:
    return [t.logprob for t in r.choices[0].logprobs.content[0].top_logprobs]


def test_an_image_changes_the_answer(base, oai):
    assert httpx.get(base + "/model_info", timeout=30).json()["has_image_understanding"] is True
    text = {"type": "text", "text": "What is in this picture?"}
    plain = _ask(oai, [text])
    a, b = _ask(oai, [_image(1), text]), _ask(oai, [_image(2), text])
    small = _ask(oai, [_image(1, (56, 56)), text])
    # 84 x 56 pixels: a 4 x 6 patch grid, 6 image tokens; 56 x 56: 4 x 4 patches, 4 tokens (plus the marker)
    assert a.usage.prompt_tokens == small.usage.prompt_tokens + 2 >= plain.usage.prompt_tokens + 6 + 3
    assert _first_logprobs(a) != _first_logprobs(plain) and _first_logprobs(a) != _first_logprobs(b)
    jpeg = _ask(oai, [_image(1, fmt="JPEG"), text])
    assert jpeg.usage.prompt_tokens == a.usage.prompt_tokens


def test_the_same_image_resent_is_a_cache_hit_and_another_image_is_not(oai):
    text = {"type": "text", "text": "Describe the weather in this photo, please."}
    big = (140, 112)  # an 8 x 10 patch grid: 20 image tokens, split over prefill chunks of 24
    first = _ask(oai, [text, _image(7, big)], max_tokens=6)
    again = _ask(oai, [text, _image(7, big)], max_tokens=6)
    other = _ask(oai, [text, _image(8, big)], max_tokens=6)
    n = first.usage.prompt_tokens
    assert again.usage.prompt_tokens == other.usage.prompt_tokens == n
    assert first.usage.prompt_tokens_details.cached_tokens < n - 20 - 5
    assert again.usage.prompt_tokens_details.cached_tokens == n - 1  # all but the last prompt token
    assert again.choices[0].message.content == first.choices[0].message.content
    # the image, its end marker, the turn's end and the assistant header follow the text: not matched
    assert other.usage.prompt_tokens_details.cached_tokens <= n - 20 - 5


BAD = [
    ({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}, "not fetched"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgoAAAANSUhEUg=="}}, "image 0"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(b"x" * 64).decode()}},
     "cannot be decoded"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,%%%"}}, "base64"),
    ({"type": "image_url", "image_url": {"url": data_url(random_image(3), "GIF")}}, "not supported"),
    (_image(4, (400, 400)), "limit of 60000 bytes"),
]


@pytest.mark.parametrize(("part", "words"), BAD)
def test_bad_images_are_400_naming_messages(base, oai, part, words):
    with pytest.raises(openai.BadRequestError) as e:
        _ask(oai, [{"type": "text", "text": "look"}, part])
    assert e.value.body["param"] == "messages" and words in e.value.body["message"], e.value.body


def test_too_many_images_and_images_outside_user_messages_are_400(base, oai):
    with pytest.raises(openai.BadRequestError, match="more than the limit of 2"):
        _ask(oai, [_image(1), _image(2), _image(3)])
    with pytest.raises(openai.BadRequestError, match="must not contain"):  # the text spells the placeholder
        _ask(oai, [_image(1), {"type": "text", "text": "<|media_pad|>"}])
    r = httpx.post(base + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "system", "content": [_image(1)]}, {"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    assert _ask(oai, [_image(5), {"type": "text", "text": "still serving?"}]).choices[0].finish_reason == "length"


def test_anthropic_image_block_gives_the_chat_answer(base, oai):
    img = random_image(11)
    png = base64.b64encode(image_bytes(img, "PNG")).decode()
    ant = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=120)
    m = ant.messages.create(model="default", max_tokens=8, extra_body={"temperature": 0}, messages=[{
        "role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                  "data": png}},
                                    {"type": "text", "text": "What is this?"}]}])
    chat = oai.chat.completions.create(model="default", max_tokens=8, temperature=0, messages=[{
        "role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + png}},
                                    {"type": "text", "text": "What is this?"}]}])
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == chat.usage.prompt_tokens  # image tokens in
    assert "".join(b.text for b in m.content if b.type == "text") == (chat.choices[0].message.content or "")
    with pytest.raises(anthropic.BadRequestError, match="not fetched"):
        ant.messages.create(model="default", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]}])


def test_responses_input_image_gives_the_chat_answer(base, oai):
    """OpenAI Responses `input_image` parts (issue 46 item 3) through the official SDK: the same prompt and
    answer as chat's image_url part; a file_id is a 400."""
    url = data_url(random_image(12), "PNG")
    r = oai.responses.create(model="default", max_output_tokens=8, temperature=0, input=[{
        "role": "user", "content": [{"type": "input_image", "image_url": url, "detail": "auto"},
                                    {"type": "input_text", "text": "What is this?"}]}],
    )
    chat = oai.chat.completions.create(model="default", max_tokens=8, temperature=0, messages=[{
        "role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                    {"type": "text", "text": "What is this?"}]}])
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.output_text == (chat.choices[0].message.content or "")
    with pytest.raises(openai.BadRequestError, match="file_id"):
        oai.responses.create(model="default", max_output_tokens=4, input=[{
            "role": "user", "content": [{"type": "input_image", "file_id": "file-1", "image_url": url}]}])
