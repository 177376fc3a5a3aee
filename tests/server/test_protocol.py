"""OpenAI protocol models and request parsing: accepted shapes, 400s with the parameter named."""

from __future__ import annotations

import json

import pytest

from ddtree_serve.server.http.errors import APIError
from ddtree_serve.server.http.protocol import ChatCompletionRequest, CompletionRequest, SpecStats, error_body
from ddtree_serve.server.http.serving_common import make_params, parse_body

MSG = [{"role": "user", "content": "hi"}]


def _chat(**kw) -> ChatCompletionRequest:
    return parse_body(ChatCompletionRequest, json.dumps({"model": "m", "messages": MSG, **kw}).encode())


def _completion(**kw) -> CompletionRequest:
    return parse_body(CompletionRequest, json.dumps({"model": "m", **kw}).encode())


def test_chat_request_fields() -> None:
    r = _chat(messages=[{"role": "system", "content": "s"},
                        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                        {"role": "assistant", "content": None, "tool_calls": [
                            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                        {"role": "tool", "tool_call_id": "c1", "content": "42"}],
              max_completion_tokens=5, temperature=0, top_p=0.5, top_k=3, min_p=0.1, seed=7, stop="\n", n=2,
              stream=True, stream_options={"include_usage": True}, logprobs=True, top_logprobs=3,
              tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
              tool_choice="auto", chat_template_kwargs={"thinking": False}, ignore_eos=True, user="u",
              presence_penalty=0.0, some_unknown_field=1)
    assert r.messages[1].text() == "ab"
    assert r.max_new_tokens == 5 and r.num_logprobs == 3 and r.include_usage
    assert r.stop_list() == ["\n"]
    p = make_params(r, r.max_new_tokens, 1, r.num_logprobs)
    assert p.seed == 8 and p.temperature == 0.0 and p.top_k == 3 and p.ignore_eos and p.logprobs == 3


def test_completion_prompt_shapes() -> None:
    assert _completion(prompt="a").prompts() == ["a"]
    assert _completion(prompt=["a", "b"]).prompts() == ["a", "b"]
    assert _completion(prompt=[1, 2, 3]).prompts() == [[1, 2, 3]]
    assert _completion(prompt=[[1, 2], [3]]).prompts() == [[1, 2], [3]]
    assert _completion(prompt="a").max_tokens == 16


@pytest.mark.parametrize("body,param", [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": 0}, "top_k"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 1.5}, "max_tokens"),
    ({"n": 0}, "n"),
    ({"stop": 3}, "stop"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages"),
    ({"top_logprobs": 21}, "top_logprobs"),
    ({"stream": "yes"}, "stream"),
    ({"seed": "1"}, "seed"),
])
def test_chat_bad_values(body: dict, param: str) -> None:
    with pytest.raises(APIError) as e:
        _chat(**body)
    assert e.value.status == 400 and e.value.param == param
    err = e.value.body()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"


@pytest.mark.parametrize("raw", [b"{", b"not json", b"[1, 2]", b""])
def test_malformed_json(raw: bytes) -> None:
    with pytest.raises(APIError) as e:
        parse_body(ChatCompletionRequest, raw)
    assert e.value.status == 400


def test_completion_bad_prompt() -> None:
    for prompt in ([], 5, [1.5], None):
        with pytest.raises(APIError):
            _completion(prompt=prompt)


def test_spec_stats_and_error_shape() -> None:
    s = SpecStats.of(verify_steps=4, accepted_tokens=8)
    assert s.acceptance_length == 3.0
    assert SpecStats.of(0, 0).acceptance_length == 0.0
    body = error_body(404, "no such model", "model", "model_not_found")
    assert body == {"error": {"message": "no such model", "type": "not_found_error", "param": "model",
                              "code": "model_not_found"}}


def test_image_parts_parse_and_other_media_are_rejected_clearly() -> None:
    """image_url parts validate (whether the model takes them is the handler's 400: tests/server/test_images.py);
    audio or video parts, and images outside user messages, are 400s naming ``messages``."""
    from ddtree_serve.server.http.errors import APIError
    from ddtree_serve.server.http.protocol import ChatCompletionRequest
    from ddtree_serve.server.http.serving_common import parse_body

    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                                      {"type": "image_url", "image_url": {"url": "data:,"}}]}]}
    req = parse_body(ChatCompletionRequest, json.dumps(body).encode())
    assert req.messages[0].image_urls() == ["data:,"] and req.messages[0].text("<img>") == "what is this?<img>"
    for part, role, words in [({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}, "user",
                               "not supported"),
                              ({"type": "image_url", "image_url": {"url": "data:,"}}, "system", "'user' messages")]:
        body = {"messages": [{"role": role, "content": [part]}]}
        with pytest.raises(APIError) as e:
            parse_body(ChatCompletionRequest, json.dumps(body).encode())
        assert e.value.status == 400 and words in e.value.message and e.value.param == "messages", e.value.message


def test_two_tool_answers_to_one_assistant_turn_are_accepted() -> None:
    calls = [{"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": "{}"}} for i in (1, 2)]
    r = _chat(messages=[*MSG, {"role": "assistant", "content": "", "tool_calls": calls},
                        {"role": "tool", "tool_call_id": "c1", "content": "1"},
                        {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "2"}]}])
    assert [m.role for m in r.messages] == ["user", "assistant", "tool", "tool"]
    with pytest.raises(APIError, match="must answer a preceding assistant"):
        _chat(messages=[*MSG, {"role": "tool", "tool_call_id": "c1", "content": "1"}])


def test_null_means_the_default_and_the_spec_says_so():
    """OpenAI accepts null for temperature, top_p, n, stream, logprobs, max_tokens, echo, ... and means the
    default (issue 46 item 6): so does the server, and the published schema allows null for each."""
    from ddtree_serve.server.http.protocol import NULL_MEANS_DEFAULT, ChatCompletionRequest, CompletionRequest

    chat = {"messages": [{"role": "user", "content": "hi"}]}
    nulls = {k: None for k in NULL_MEANS_DEFAULT}
    for model, base in ((ChatCompletionRequest, chat), (CompletionRequest, {"prompt": "x"})):
        fields = {k: v for k, v in nulls.items() if k in model.model_fields}
        got, default = model.model_validate({**base, **fields}), model.model_validate(base)
        for k in fields:
            assert getattr(got, k) == getattr(default, k), k
        props = model.model_json_schema()["properties"]
        for k in fields:
            assert {"type": "null"} in props[k].get("anyOf", []), k
    assert CompletionRequest.model_validate({"prompt": "x", "max_tokens": None}).max_tokens == 16
