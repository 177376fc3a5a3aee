"""Request limits and the published spec, over real HTTP against a real server process (default model,
CPU) started with small limits: body size (413), prompt length (400), waiting requests (503 with
Retry-After), a chat without ``max_tokens`` ending with ``length`` at the context limit, OpenAI's message
role rules (400), JSON bodies whatever their Content-Type, and /openapi.json + /docs."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.server.conftest import running_server

CONTEXT, MAX_BODY, MAX_PROMPT = 40, 4096, 36  # the chat prompt below is 33 tokens
USER = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from ddtree_serve.model_executor.default_model import ensure_default_model

    ensure_default_model()
    args = ["--context-length", str(CONTEXT), "--max-running-requests", "1", "--max-waiting-requests", "1",
            "--max-request-body-bytes", str(MAX_BODY), "--max-prompt-tokens", str(MAX_PROMPT),
            # a fixed budget: its per-step KV margin (17 slots) fits this tiny pool
            "--speculative-ddtree-budget", "16"]
    with running_server(args, tmp_path_factory.mktemp("limits")) as srv:
        yield srv.base


def _post(base: str, path: str, body, **kw) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = kw.pop("headers", {"Content-Type": "application/json"})
    return httpx.post(base + path, content=content, headers=headers, timeout=120, **kw)


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and "Traceback" not in r.text
    return err


def test_chat_without_max_tokens_ends_at_the_context_limit(server) -> None:
    r = _post(server, "/v1/chat/completions", {"messages": USER, "ignore_eos": True, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["total_tokens"] == CONTEXT


def test_body_size_limit_gives_413(server) -> None:
    big = {"messages": [{"role": "user", "content": "x" * MAX_BODY}]}
    err = _error(_post(server, "/v1/chat/completions", big), 413)
    assert "max_request_body_bytes" in err["message"]

    def chunks():  # no Content-Length: counted while reading
        yield json.dumps(big).encode()

    _error(
        httpx.post(
            server + "/v1/completions",
            content=chunks(),
            timeout=60,
            headers={"Content-Type": "application/json"},
        ),
        413,
    )


def test_prompt_token_limit_gives_400(server) -> None:
    err = _error(
        _post(server, "/v1/completions", {"prompt": list(range(1, MAX_PROMPT + 2)), "max_tokens": 1}), 400
    )
    assert "max_prompt_tokens" in err["message"]
    ok = _post(server, "/v1/completions", {"prompt": list(range(1, MAX_PROMPT + 1)), "max_tokens": 1})
    assert ok.status_code == 200, ok.text


def test_full_queue_gives_503_with_retry_after(server) -> None:
    """One running + one waiting request fill this server; a third gets 503 with Retry-After, and is
    accepted again once the two are gone (they are aborted by closing their connections)."""
    long = {"prompt": "Once upon a time", "max_tokens": 30, "ignore_eos": True, "stream": True}

    async def hold(c: httpx.AsyncClient) -> None:
        async with c.stream("POST", "/v1/completions", json=long) as r:
            async for _ in r.aiter_bytes():
                pass

    async def inflight(c: httpx.AsyncClient) -> int:
        text = (await c.get("/metrics")).text
        line = next(x for x in text.splitlines() if x.startswith("ddtree_num_inflight_http_reqs{"))
        return int(float(line.rsplit(" ", 1)[1]))

    async def run() -> httpx.Response:
        async with httpx.AsyncClient(base_url=server, timeout=300) as c:
            held = [asyncio.create_task(hold(c)) for _ in range(2)]
            for _ in range(600):
                if await inflight(c) == 2:
                    break
                await asyncio.sleep(0.1)
            third = await c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
            for t in held:
                t.cancel()
            await asyncio.gather(*held, return_exceptions=True)
            return third

    third = asyncio.run(run())
    err = _error(third, 503)
    assert err["code"] == "queue_full" and third.headers["retry-after"] == "1"
    assert _post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 1}).status_code == 200


BAD_MESSAGES = [
    [{"role": "tool"}],
    [{"role": "tool", "content": "42"}],
    [{"role": "user", "content": "x"}, {"role": "tool", "content": "42", "tool_call_id": "c1"}],
    [{"role": "assistant"}],
    [{"role": "user"}],
    [{"role": "system", "content": None}],
    [
        {
            "role": "user",
            "content": "x",
            "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": "{}"}}],
        }
    ],
]


@pytest.mark.parametrize("messages", BAD_MESSAGES)
def test_message_role_rules(server, messages) -> None:
    assert _error(_post(server, "/v1/chat/completions", {"messages": messages}), 400)["param"] == "messages"


def test_body_is_json_whatever_the_content_type(server) -> None:
    for ctype in ("application/x-www-form-urlencoded", "text/plain"):
        r = _post(
            server, "/v1/completions", {"prompt": "Hi", "max_tokens": 1}, headers={"Content-Type": ctype}
        )
        assert r.status_code == 200, r.text
    assert (
        _error(_post(server, "/v1/completions", b"[1, 2]"), 400)["message"]
        == "the request body must be a JSON object"
    )


def test_openapi_spec_and_docs(server) -> None:
    spec = httpx.get(server + "/openapi.json", timeout=30).json()
    for path, model in (
        ("/v1/chat/completions", "ChatCompletionRequest"),
        ("/v1/completions", "CompletionRequest"),
    ):
        body = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{model}"}
        assert "400" in spec["paths"][path]["post"]["responses"]
    chat = spec["components"]["schemas"]["ChatCompletionRequest"]
    assert {"messages", "temperature", "max_tokens", "tools"} <= set(chat["properties"])
    assert "ChatMessage" in spec["components"]["schemas"] and "ErrorResponse" in spec["components"]["schemas"]
    docs = httpx.get(server + "/docs", timeout=30)
    assert docs.status_code == 200 and "swagger" in docs.text.lower()
