"""Structured output over HTTP (issue 17): ``response_format``, ``regex``, ``ebnf`` and a forced
``tool_choice`` become one grammar constraint in ``SamplingParams`` (through the real request models), bad or
conflicting ones are a 400 in OpenAI's error JSON, and on a real server (default model, CPU, hermes tool
parser) constrained replies parse and validate, and a forced tool choice yields tool calls every time,
streamed and not. The end-to-end tests need the engine's grammar masks (the ``grammar`` branch)."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema_rs
import pytest

from ddtree_serve.server.http.errors import APIError
from ddtree_serve.server.http.protocol import ChatCompletionRequest, CompletionRequest
from ddtree_serve.server.http.serving_common import make_params, parse_body
from ddtree_serve.server.http.serving_structured import JSON_OBJECT_SCHEMA, constraint_of
from ddtree_serve.server.parsers.tool_grammar import tool_call_ebnf
from tests.server.conftest import running_server

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "likes_tea": {"type": "boolean"}}, "required": ["name", "age", "likes_tea"]}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 32},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}
TIME = {"type": "object", "properties": {"timezone": {"enum": ["UTC", "CET", "PST"]}}, "required": ["timezone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Current time", "parameters": TIME}}]
TOOL_SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
USER = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def _chat(body: dict) -> ChatCompletionRequest:
    return parse_body(ChatCompletionRequest, json.dumps({"messages": USER, **body}).encode())


def _completion(body: dict) -> CompletionRequest:
    return parse_body(CompletionRequest, json.dumps({"prompt": "x", **body}).encode())


def _grammar(req, tool_parser: str | None = "hermes") -> tuple[str | None, str | None, str | None]:
    p = make_params(req, 16, 0, None, constraint=constraint_of(req, tool_parser))
    return p.json_schema, p.regex, p.ebnf


# ---- the mapping, through the real request models ------------------------------------------------------
@pytest.mark.parametrize("make", [_chat, _completion])
def test_response_format_regex_and_ebnf_map_to_sampling_params(make) -> None:
    assert _grammar(make({})) == (None, None, None)
    assert _grammar(make({"response_format": {"type": "text"}})) == (None, None, None)
    assert _grammar(make({"response_format": {"type": "json_object"}})) == ('{"type": "object"}', None, None)
    assert JSON_OBJECT_SCHEMA == '{"type": "object"}'
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    assert _grammar(make({"response_format": rf})) == (json.dumps(PERSON), None, None)
    assert _grammar(make({"regex": "[0-9]{3}"})) == (None, "[0-9]{3}", None)
    assert _grammar(make({"ebnf": 'root ::= "yes" | "no"'})) == (None, None, 'root ::= "yes" | "no"')


@pytest.mark.parametrize("parser", ["hermes", "kimi_k2"])
def test_forced_tool_choice_maps_to_the_tool_grammar(parser) -> None:
    tools = [(t["function"]["name"], t["function"]["parameters"]) for t in TOOLS]
    assert _grammar(_chat({"tools": TOOLS, "tool_choice": "required"}), parser) == (
        None, None, tool_call_ebnf(parser, tools))
    named = {"type": "function", "function": {"name": "get_time"}}
    assert _grammar(_chat({"tools": TOOLS, "tool_choice": named}), parser) == (
        None, None, tool_call_ebnf(parser, tools, named="get_time"))
    for choice in ("auto", "none", None):
        assert _grammar(_chat({"tools": TOOLS, "tool_choice": choice}), parser) == (None, None, None)
    assert _grammar(_chat({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}), parser) == (
        None, None, tool_call_ebnf(parser, tools, parallel=False))


MALFORMED = [
    {"response_format": {"type": "xml"}},
    {"response_format": {"type": "json_schema"}},  # no json_schema
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},  # no schema
    {"response_format": {"type": "json_schema", "json_schema": {"schema": PERSON}}},  # no name
    {"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": PERSON}}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
    {"response_format": {"type": "json_object", "json_schema": {"name": "x", "schema": PERSON}}},
    {"response_format": "json"},
    {"response_format": {}},
]


@pytest.mark.parametrize("body", MALFORMED)
def test_malformed_response_format_is_400(body) -> None:
    for make in (_chat, _completion):
        with pytest.raises(APIError) as e:
            make(body)
        assert e.value.status == 400 and e.value.param == "response_format", e.value.message


@pytest.mark.parametrize(("body", "param"), [({"regex": ""}, "regex"), ({"regex": 3}, "regex"),
                                             ({"ebnf": ""}, "ebnf"), ({"ebnf": ["root ::= x"]}, "ebnf")])
def test_malformed_regex_and_ebnf_are_400(body, param) -> None:
    with pytest.raises(APIError) as e:
        _chat(body)
    assert e.value.status == 400 and e.value.param == param


CONFLICTS = [
    ({"regex": "a", "ebnf": 'root ::= "a"'}, "ebnf"),
    ({"response_format": {"type": "json_object"}, "regex": "a"}, "regex"),
    ({"response_format": {"type": "json_object"}, "tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
    ({"ebnf": 'root ::= "a"', "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
     "tool_choice"),
]


@pytest.mark.parametrize(("body", "param"), CONFLICTS)
def test_more_than_one_constraint_is_400(body, param) -> None:
    with pytest.raises(APIError) as e:
        constraint_of(_chat(body), "hermes")
    assert e.value.status == 400 and e.value.param == param and e.value.code == "conflicting_constraints"


def test_forced_tool_choice_errors_are_400() -> None:
    cases = [({"tool_choice": "required"}, "hermes", "tool_choice", "needs 'tools'"),
             ({"tools": TOOLS, "tool_choice": "required"}, None, "tool_choice", "--tool-call-parser"),
             ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "kimi_k2",
              "tool_choice", "not in 'tools'"),
             ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
               "tool_choice": "required"}, "hermes", "tools", "tools[0].function.parameters")]
    for body, parser, param, words in cases:
        with pytest.raises(APIError) as e:
            constraint_of(_chat(body), parser)
        assert e.value.status == 400 and e.value.param == param and words in e.value.message, e.value.message
    # parallel_tool_calls: false with tool_choice auto is no constraint: the parser keeps the first call
    assert not constraint_of(_chat({"tools": TOOLS, "parallel_tool_calls": False}), "hermes").active


# ---- a real server ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from ddtree_serve.model_executor.default_model import ensure_default_model

    ensure_default_model()
    with running_server(["--max-total-tokens", "8192", "--tool-call-parser", "hermes"], tmp_path_factory.mktemp("server")) as srv:
        yield srv.base


def _post(base: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(base + path, json=body, timeout=300)


def _stream(base: str, path: str, body: dict) -> list[dict]:
    events = []
    with httpx.stream("POST", base + path, json={**body, "stream": True}, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


HTTP_400 = [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    ("/v1/chat/completions", {"regex": "a", "ebnf": 'root ::= "a"'}, "ebnf"),
    ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ("/v1/completions", {"response_format": {"type": "json_object"}, "regex": "a"}, "regex"),
    ("/v1/completions", {"regex": "("}, "regex"),  # the engine cannot compile it
    ("/v1/chat/completions", {"ebnf": "root ::= undefined_rule"}, "ebnf"),  # likewise
]


@pytest.mark.parametrize(("path", "extra", "param"), HTTP_400)
def test_bad_constraints_are_400_over_http(base, path, extra, param) -> None:
    body = {"messages": USER} if path.endswith("chat/completions") else {"prompt": "x"}
    r = _post(base, path, {**body, "max_tokens": 4, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param, err
    assert "Traceback" not in r.text


PEOPLE = ["Describe a person called Ada as JSON.", "Who are you?"]


def _each_at_once(check, items: list[str]) -> None:
    """``check(i, item)`` for every item, the requests of all items in flight together (one batch on the server
    instead of one request after another); each item's assertions raise here, in order."""
    with ThreadPoolExecutor(len(items)) as ex:
        futures = [ex.submit(check, i, item) for i, item in enumerate(items)]
    for f in futures:
        f.result()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_replies_parse_and_validate(base, temperature) -> None:
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}

    def one(i: int, prompt: str) -> None:
        r = _post(base, "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}], "seed": i,
                                                 "temperature": temperature, "max_tokens": 150, "response_format": rf})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        assert jsonschema_rs.is_valid(PERSON, json.loads(choice["message"]["content"])), choice

    _each_at_once(one, PEOPLE)


def test_json_object_and_completion_constraints(base) -> None:
    r = _post(base, "/v1/chat/completions", {"messages": USER, "temperature": 0, "max_tokens": 200,
                                             "response_format": {"type": "json_object"}})
    assert r.status_code == 200, r.text
    assert isinstance(json.loads(r.json()["choices"][0]["message"]["content"]), dict)
    r = _post(base, "/v1/completions", {"prompt": "My phone number is", "temperature": 1.0, "seed": 3,
                                        "max_tokens": 20, "regex": "[0-9]{3}-[0-9]{4}"})
    assert r.status_code == 200, r.text
    assert re.fullmatch("[0-9]{3}-[0-9]{4}", r.json()["choices"][0]["text"]), r.json()
    events = _stream(base, "/v1/completions", {"prompt": "Is the sky blue? Answer:", "max_tokens": 8,
                                                "temperature": 0, "ebnf": 'root ::= " yes" | " no"'})
    assert "".join(c["text"] for e in events for c in e["choices"]) in (" yes", " no")


def _check_calls(calls: list[dict], names: set[str]) -> None:
    assert calls
    for call in calls:
        fn = call["function"]
        assert fn["name"] in names, call
        assert jsonschema_rs.is_valid(TOOL_SCHEMAS[fn["name"]], json.loads(fn["arguments"])), call


QUESTIONS = ["What is the weather like in Paris today?", "What time is it?", "Tell me a joke."]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_required_tool_choice_always_calls_a_tool(base, temperature) -> None:
    def one(i: int, q: str) -> None:
        body = {"messages": [{"role": "user", "content": q}], "tools": TOOLS, "tool_choice": "required",
                "temperature": temperature, "seed": i, "max_tokens": 120}
        r = _post(base, "/v1/chat/completions", body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        assert not choice["message"]["content"], choice
        _check_calls(choice["message"]["tool_calls"], set(TOOL_SCHEMAS))
        # streamed: the same deltas as today's tool calls (index, id and name first, then the arguments)
        events = _stream(base, "/v1/chat/completions", body)
        calls: dict[int, dict] = {}
        finish = [c["finish_reason"] for e in events for c in e["choices"] if c.get("finish_reason")]
        for e in events:
            for c in e["choices"]:
                for d in c["delta"].get("tool_calls") or []:
                    call = calls.setdefault(d["index"], {"id": None, "function": {"name": "", "arguments": ""}})
                    call["id"] = d.get("id") or call["id"]
                    call["function"]["name"] += d["function"].get("name") or ""
                    call["function"]["arguments"] += d["function"].get("arguments") or ""
        assert finish == ["tool_calls"], events
        assert all(c["id"] for c in calls.values())
        _check_calls([calls[k] for k in sorted(calls)], set(TOOL_SCHEMAS))

    _each_at_once(one, QUESTIONS)


def test_named_tool_choice_calls_that_tool(base) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    r = _post(base, "/v1/chat/completions", {"messages": USER, "tools": TOOLS, "tool_choice": named, "n": 2,
                                             "temperature": 1.0, "seed": 5, "max_tokens": 120})
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        assert choice["finish_reason"] == "tool_calls", choice
        calls = choice["message"]["tool_calls"]
        assert len(calls) == 1
        _check_calls(calls, {"get_time"})


@pytest.mark.slow  # flaky on bf16 CPUs: runs of the same greedy request differ (left open in issue 38's note)
def test_forced_tool_call_cut_by_max_tokens_is_length(base) -> None:
    """A forced call that max_tokens cuts short is not a call: finish_reason ``length`` (never ``tool_calls``),
    its partial text returned as content (hermes sends a call whole, at its closing tag), streamed and not."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    body = {"messages": USER, "tools": TOOLS, "tool_choice": named, "temperature": 0, "max_tokens": 80}
    whole = _post(base, "/v1/chat/completions", body).json()
    assert whole["choices"][0]["finish_reason"] == "tool_calls", whole
    n = whole["usage"]["completion_tokens"]
    # cut at half: bf16 batches may move the call's length by a token or two between runs, never by half
    cut = _post(base, "/v1/chat/completions", {**body, "max_tokens": n // 2}).json()
    choice = cut["choices"][0]
    assert choice["finish_reason"] == "length" and cut["usage"]["completion_tokens"] == n // 2, cut
    assert not choice["message"].get("tool_calls"), choice
    assert choice["message"]["content"].startswith("<tool_call>") and "get_weather" in choice["message"]["content"]
    events = _stream(base, "/v1/chat/completions", {**body, "max_tokens": n // 2})
    finish = [c["finish_reason"] for e in events for c in e.get("choices", []) if c.get("finish_reason")]
    content = "".join(c["delta"].get("content") or "" for e in events for c in e.get("choices", []))
    assert finish == ["length"] and content == choice["message"]["content"], events
    assert not any(c["delta"].get("tool_calls") for e in events for c in e.get("choices", []))
    # cut after the call closed, before the reply's end (its EOS): the call is returned, the reason stays length
    late_resp = _post(base, "/v1/chat/completions", {**body, "max_tokens": n - 1}).json()
    late = late_resp["choices"][0]
    ended_itself = late_resp["usage"]["completion_tokens"] < n - 1  # this run's call came out shorter
    assert late["finish_reason"] == ("tool_calls" if ended_itself else "length"), late_resp
    def fns(msg: dict) -> list:
        return [c["function"] for c in msg.get("tool_calls") or []]

    assert fns(late["message"]) in (fns(whole["choices"][0]["message"]), []), late
