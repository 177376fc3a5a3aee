"""Image URLs and video over HTTP (issue 62): a real server on a tiny random Kimi K2.6 checkpoint with a MoonViT
tower and Kimi's video fields, started with ``--allowed-media-domains 127.0.0.1``, fetching from a real loopback
HTTP server the test starts (tests/server/media_server.py):

- an http image URL gives the same prompt and answer as the same image sent as a data: URL, on chat, Responses
  (``input_image``) and Anthropic Messages (``image`` source ``url``);
- a host not listed, a redirect to a private address, too large, too slow, the wrong type and a 404 are 400s
  whose ``param`` names the URL's part of the request, and the server keeps serving;
- a video (data: URL and http URL) is answered, both the same; a video beyond the limits is a 400;
- reliability: 200 concurrent image-URL requests, slow and failing fetches mixed in: every one answers 200 or
  400 (no 5xx), none is stuck.
"""

from __future__ import annotations

import asyncio
import time

import anthropic
import httpx
import openai
import pytest

from tests.server.conftest import running_server
from tests.server.image_files import data_url, random_image
from tests.server.kimi_tokenizer_files import write_tiny_kimi
from tests.server.media_server import media_server
from tests.server.video_files import declare_video, video_bytes, video_data_url

OFF = {"chat_template_kwargs": {"thinking": False}}


@pytest.fixture(scope="module")
def media():
    with media_server() as s:
        s.videos["/clip.mp4"] = video_bytes(10, fps=4, size=(70, 56))
        s.videos["/long.mp4"] = video_bytes(40, fps=4, size=(70, 56))
        yield s


@pytest.fixture(scope="module")
def base(tmp_path_factory, media):
    path = tmp_path_factory.mktemp("kimi") / "tiny-kimi-video"
    write_tiny_kimi(path, 512, vision=True)
    declare_video(path)
    args = ["--model-path", str(path), "--device", "cpu", "--dtype", "float32", "--max-total-tokens", "8192",
            "--chunked-prefill-size", "64", "--max-images-per-request", "2", "--max-image-bytes", "60000",
            "--allowed-media-domains", "127.0.0.1", "--media-fetch-timeout", "2", "--max-video-seconds", "5",
            "--max-videos-per-request", "1",
            "--max-running-requests", "32", "--served-model-name", "default", "--log-level", "warning"]
    with running_server(args, tmp_path_factory.mktemp("kimi-media")) as srv:
        yield srv.base


@pytest.fixture(scope="module")
def oai(base):
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)


def _chat(oai, content: list[dict], max_tokens: int = 6):
    return oai.chat.completions.create(model="default", messages=[{"role": "user", "content": content}],
                                       max_tokens=max_tokens, temperature=0, extra_body=OFF)


def _img(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


TEXT = {"type": "text", "text": "What is this?"}


def test_an_image_url_answers_as_its_data_url(base, oai, media):
    url = media.base + "/img/21.png"
    by_url, inline = _chat(oai, [_img(url), TEXT]), _chat(oai, [_img(data_url(random_image(21, (84, 56)))), TEXT])
    assert by_url.usage.prompt_tokens == inline.usage.prompt_tokens
    assert by_url.choices[0].message.content == inline.choices[0].message.content
    r = oai.responses.create(model="default", max_output_tokens=6, temperature=0, input=[{
        "role": "user", "content": [{"type": "input_image", "image_url": url}, {"type": "input_text",
                                                                                "text": "What is this?"}]}])
    plain = oai.chat.completions.create(model="default", messages=[{"role": "user", "content": [_img(url), TEXT]}],
                                        max_tokens=6, temperature=0)  # the agent APIs' default thinking
    assert r.output_text == (plain.choices[0].message.content or "")
    ant = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=120)
    m = ant.messages.create(model="default", max_tokens=6, extra_body={"temperature": 0}, messages=[{
        "role": "user", "content": [{"type": "image", "source": {"type": "url", "url": url}}, TEXT]}])
    assert "".join(b.text for b in m.content if b.type == "text") == (plain.choices[0].message.content or "")


@pytest.mark.parametrize(("path", "words"), [
    ("http://example.com/a.png", "not in --allowed-media-domains"),
    ("http://127.0.0.2:9/a.png", "not allowed"),
    ("/redirect?to=http://169.254.169.254/latest/meta-data", "not allowed"),
    ("/big.png", "more than the limit of 60000"),
    ("/slow.png", "timed out after 2 s"),
    ("/page.html", "content type 'text/html'"),
    ("/missing.png", "HTTP 404"),
])
def test_fetch_failures_are_400_naming_the_part(base, oai, media, path, words):
    url = path if path.startswith("http") else media.base + path
    with pytest.raises(openai.BadRequestError) as e:
        _chat(oai, [TEXT, _img(url)])
    body = e.value.body
    assert body["param"] == "messages[0].content[1].image_url.url" and words in body["message"], body
    assert "image 0 (messages[0].content[1].image_url.url)" in body["message"]
    assert _chat(oai, [TEXT], max_tokens=1).choices[0].finish_reason == "length"  # still serving


def test_video_by_data_url_and_by_url(base, oai, media):
    q = {"type": "text", "text": "What happens?"}
    inline = _chat(oai, [{"type": "video_url", "video_url": {"url": video_data_url(media.videos["/clip.mp4"])}}, q])
    by_url = _chat(oai, [{"type": "video_url", "video_url": {"url": media.base + "/clip.mp4"}}, q])
    text_only = _chat(oai, [q])
    assert by_url.usage.prompt_tokens == inline.usage.prompt_tokens
    # two chunks of 2 x 3 tokens, each with its timestamp and markers: far more than the text alone
    assert inline.usage.prompt_tokens > text_only.usage.prompt_tokens + 12
    assert by_url.choices[0].message.content == inline.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="lasts 10.0 s, more than the limit of 5 s"):
        _chat(oai, [{"type": "video_url", "video_url": {"url": media.base + "/long.mp4"}}, q])
    with pytest.raises(openai.BadRequestError, match="content type 'image/png'"):
        _chat(oai, [{"type": "video_url", "video_url": {"url": media.base + "/img/1.png"}}, q])


def test_200_concurrent_image_url_requests_with_slow_and_failing_fetches(base, media):
    kinds = ["/img/{}.png", "/img/{}.png", "/slow.png", "/missing.png", "/fail.png", "/trickle.png"]

    async def one(client: httpx.AsyncClient, i: int) -> tuple[str, int, str]:
        path = kinds[i % len(kinds)].format(100 + i % 7)
        r = await client.post("/v1/chat/completions", json={
            "model": "default", "max_tokens": 2, "temperature": 0, **OFF,
            "messages": [{"role": "user", "content": [_img(media.base + path), TEXT]}]})
        return path, r.status_code, "" if r.status_code == 200 else r.text[:200]

    async def run() -> list[tuple[str, int, str]]:
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as client:
            return await asyncio.gather(*(one(client, i) for i in range(200)))

    start = time.monotonic()
    results = asyncio.run(run())
    took = time.monotonic() - start
    assert all(s < 500 for _, s, _ in results), [r for r in results if r[1] >= 500]
    assert all(s == 200 for p, s, _ in results if p.startswith("/img/")), [r for r in results if r[1] != 200]
    assert all(s == 400 for p, s, _ in results if not p.startswith("/img/")), results
    assert took < 110, took  # nothing waited for the client's timeout
