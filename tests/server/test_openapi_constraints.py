"""The published spec (/openapi.json) and validation agree, without a model: the spec is built from the real
app (``create_app``) and the bodies go through the real validation and pre-model checks of each route (the
request models, the Messages / Responses translations to chat, the structured-output and tool rules). The
rules that need the model (the tokenizer, the context, grammar compilation) are covered over HTTP by the slow
fuzz (tests/server/test_openapi_fuzz.py), with the same documented normalisation.

- each rule validation enforces is in the spec: a body that breaks it is invalid by the spec and refused,
  naming the field; its fixed sibling is valid by the spec and accepted;
- (slow) schemathesis's schema-valid bodies (normalised) pass validation, and its invalid ones never raise
  anything but a 400: the HTTP fuzz's check without the model, a quick way to find a rule missing from the spec.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema_rs
import pytest

from ddtree_serve.server.config import ServerConfig
from ddtree_serve.server.http.api import create_app
from ddtree_serve.server.http.chat_bridge import chat_request
from ddtree_serve.server.http.errors import APIError
from ddtree_serve.server.http.metrics import ServerMetrics
from ddtree_serve.server.http.openapi import openapi_spec
from ddtree_serve.server.http.protocol import ChatCompletionRequest, CompletionRequest
from ddtree_serve.server.http.protocol_messages import MessagesRequest
from ddtree_serve.server.http.protocol_responses import ResponsesRequest
from ddtree_serve.server.http.serving_common import validation_error
from ddtree_serve.server.http.serving_messages import chat_of as messages_chat
from ddtree_serve.server.http.serving_responses import chat_of as responses_chat
from ddtree_serve.server.http.serving_structured import constraint_of
from ddtree_serve.server.http.tokenize_routes import DetokenizeRequest, TokenizeRequest
from ddtree_serve.server.io_struct import IpcEndpoints
from ddtree_serve.server.tokenizer_manager import TokenizerManager
from tests.server.openapi_fuzz_normalise import normalise

CONFIG = ServerConfig().replace("server", tool_call_parser="hermes", reasoning_parser="deepseek-r1")
CHAT, COMPLETIONS, MESSAGES, RESPONSES = ("POST /v1/chat/completions", "POST /v1/completions", "POST /v1/messages",
                                          "POST /v1/responses")
TOKENIZE, DETOKENIZE = "POST /tokenize", "POST /detokenize"
BODY_SCHEMA = {CHAT: "ChatCompletionRequest", COMPLETIONS: "CompletionRequest", MESSAGES: "MessagesRequest",
               RESPONSES: "ResponsesRequest", TOKENIZE: "TokenizeRequest", DETOKENIZE: "DetokenizeRequest"}
GENERATED = 25  # schemathesis bodies per operation and mode


@pytest.fixture(scope="module")
def spec() -> dict[str, Any]:
    tm = TokenizerManager(CONFIG, IpcEndpoints.in_dir("/nonexistent"), None, ServerMetrics("m"))
    return openapi_spec(create_app(CONFIG, tm))


def _validate(model: type, body: Any) -> Any:
    """As FastAPI validates a route's body (python mode), with the server's 400 for a failure."""
    from pydantic import ValidationError

    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise validation_error([{**err, "loc": ("body", *err["loc"])} for err in e.errors(include_url=False)]) \
            from None


def refusal(label: str, body: Any) -> APIError | None:
    """The 400 the route's validation and pre-model checks give ``body`` (None: accepted up to the model).
    The server's settings: CONFIG (a tool-call and a reasoning parser)."""
    try:
        if label == CHAT:
            constraint_of(_validate(ChatCompletionRequest, body), "hermes")
        elif label == COMPLETIONS:
            req = _validate(CompletionRequest, body)
            if req.max_tokens == 0 and not req.echo:  # the handler's first check
                return APIError(400, "max_tokens 0 without echo", param="max_tokens")
            constraint_of(req)
        elif label == MESSAGES:
            constraint_of(messages_chat(_validate(MessagesRequest, body), CONFIG), "hermes")
        elif label == RESPONSES:
            constraint_of(responses_chat(_validate(ResponsesRequest, body)), "hermes")
        elif label == TOKENIZE:
            req = _validate(TokenizeRequest, body)
            if req.messages is not None:
                chat_request({"messages": [m.model_dump(exclude_none=True) for m in req.messages]})
        else:
            _validate(DetokenizeRequest, body)
    except APIError as e:
        return e
    return None


def _spec_valid(spec: dict[str, Any], label: str, body: Any) -> bool:
    schema = {"$ref": f"#/components/schemas/{BODY_SCHEMA[label]}", "components": spec["components"]}
    return jsonschema_rs.Draft202012Validator(schema).is_valid(body)


USER = [{"role": "user", "content": "Hi"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
A_TOOLS = [{"name": "f", "input_schema": {"type": "object"}}]
R_TOOLS = [{"type": "function", "name": "f"}]
JSON_RF = {"type": "json_object"}
# (operation, a body breaking one rule, the field its 400 names, the same body with the rule kept)
RULES = [
    (CHAT, {"messages": USER, "regex": "a", "ebnf": 'root ::= "a"'}, "ebnf", {"messages": USER, "regex": "a"}),
    (CHAT, {"messages": USER, "response_format": JSON_RF, "tools": TOOLS, "tool_choice": "required"},
     "tool_choice", {"messages": USER, "response_format": JSON_RF, "tools": TOOLS, "tool_choice": "auto"}),
    (CHAT, {"messages": USER, "tool_choice": "required"}, "tool_choice",
     {"messages": USER, "tools": TOOLS, "tool_choice": "required"}),
    (CHAT, {"messages": USER, "tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools",
     {"messages": USER, "tools": [{"type": "function", "function": {"name": "a_b"}}]}),
    (CHAT, {"messages": USER, "seed": 2**64}, "seed", {"messages": USER, "seed": -(2**52)}),  # int64, published as +-2**53
    (CHAT, {"messages": USER, "top_logprobs": 2}, "top_logprobs",
     {"messages": USER, "top_logprobs": 2, "logprobs": True}),
    (COMPLETIONS, {"prompt": ""}, "prompt", {"prompt": " "}),
    (COMPLETIONS, {"prompt": ["a", ""]}, "prompt", {"prompt": ["a", "b"]}),
    (COMPLETIONS, {"prompt": [1, -1]}, "prompt", {"prompt": [1, 0]}),
    (COMPLETIONS, {"prompt": "a", "best_of": 2}, "best_of", {"prompt": "a", "best_of": 1}),
    (COMPLETIONS, {"prompt": "a", "best_of": 1, "n": 2}, "best_of", {"prompt": "a", "best_of": 1, "n": 1}),
    (COMPLETIONS, {"prompt": "a", "response_format": JSON_RF, "regex": "a"}, "regex",
     {"prompt": "a", "response_format": {"type": "text"}, "regex": "a"}),
    (COMPLETIONS, {"prompt": "a", "max_tokens": 0}, "max_tokens", {"prompt": "a", "max_tokens": 0, "echo": True}),
    (TOKENIZE, {"prompt": "a", "messages": USER}, None, {"prompt": "a"}),
    (TOKENIZE, {}, None, {"messages": USER}),
    (TOKENIZE, {"prompt": "a", "tools": TOOLS}, None, {"messages": USER, "tools": TOOLS}),
    (TOKENIZE, {"messages": USER, "continue_final_message": True}, None,
     {"messages": USER, "continue_final_message": True, "add_generation_prompt": False}),
    (DETOKENIZE, {"tokens": [1, -2]}, "tokens", {"tokens": [1, 2]}),
    (RESPONSES, {"input": []}, "input", {"input": "Hi"}),
    (RESPONSES, {"input": "Hi", "store": True}, "store", {"input": "Hi", "store": False}),
    (RESPONSES, {"input": "Hi", "include": ["x"]}, "include",
     {"input": "Hi", "include": ["reasoning.encrypted_content"]}),
    (RESPONSES, {"input": "Hi", "truncation": "auto"}, "truncation", {"input": "Hi", "truncation": "disabled"}),
    (RESPONSES, {"input": "Hi", "background": True}, "background", {"input": "Hi", "background": None}),
    (RESPONSES, {"input": "Hi", "tool_choice": "required"}, "tool_choice",
     {"input": "Hi", "tools": R_TOOLS, "tool_choice": "required"}),
    (RESPONSES, {"input": "Hi", "tools": R_TOOLS, "tool_choice": "required", "text": {"format": JSON_RF}},
     "tool_choice", {"input": "Hi", "tools": R_TOOLS, "text": {"format": JSON_RF}}),
    (RESPONSES, {"input": "Hi", "text": {"format": {"type": "json_schema", "name": "a b", "schema": {}}}}, "text",
     {"input": "Hi", "text": {"format": {"type": "json_schema", "name": "a_b", "schema": {}}}}),
    (RESPONSES, {"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text",
     {"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}}),
    (RESPONSES, {"input": [{"type": "reasoning", "summary": []}]}, "input",
     {"input": [{"type": "reasoning", "summary": []}], "instructions": "Be brief."}),
    (MESSAGES, {"max_tokens": 4, "messages": USER, "tool_choice": {"type": "any"}}, "tool_choice",
     {"max_tokens": 4, "messages": USER, "tools": A_TOOLS, "tool_choice": {"type": "any"}}),
    (MESSAGES, {"max_tokens": 4, "messages": USER, "tool_choice": {"type": "auto", "name": "f"}}, "tool_choice",
     {"max_tokens": 4, "messages": USER, "tool_choice": {"type": "auto"}}),
    (MESSAGES, {"max_tokens": 4, "messages": USER, "tools": [{"name": "a.b", "input_schema": {}}]}, "tools",
     {"max_tokens": 4, "messages": USER, "tools": [{"name": "a-b", "input_schema": {}}]}),
    (MESSAGES, {"max_tokens": 4, "messages": USER, "thinking": {"type": "adaptive", "display": "omitted"}},
     "thinking", {"max_tokens": 4, "messages": USER, "thinking": {"type": "adaptive", "display": "summarized"}}),
    (MESSAGES, {"max_tokens": 4, "messages": USER, "output_config": {"effort": "extreme"}}, "output_config",
     {"max_tokens": 4, "messages": USER, "output_config": {"effort": "max"}}),
    (MESSAGES, {"max_tokens": 4, "messages": [{"role": "system", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "x"}}]}, *USER]},
     "messages", {"max_tokens": 4, "messages": [{"role": "system", "content": [{"type": "text", "text": "S"}]},
                                                *USER]}),
    (MESSAGES, {"max_tokens": 4, "messages": USER, "speed": "fast"}, "speed", {"max_tokens": 4, "messages": USER}),
    (MESSAGES, {"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "1", "name": "f", "input": {}}]}]}, "messages",
     {"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]}),
]


@pytest.mark.parametrize(("label", "broken", "param", "kept"), RULES,
                         ids=[f"{r[0].split()[1]}-{i}" for i, r in enumerate(RULES)])
def test_each_rule_is_in_the_spec_and_enforced(spec, label, broken, param, kept) -> None:
    err = refusal(label, broken)
    assert err is not None and err.status == 400, (label, broken)
    assert err.param == param, (err.param, err.message)
    assert not _spec_valid(spec, label, broken), f"the spec lets {broken} through; validation refuses it"
    assert refusal(label, kept) is None, refusal(label, kept).message
    assert _spec_valid(spec, label, kept), f"the spec refuses {kept}; validation accepts it"


def _generated(spec: dict[str, Any], label: str, positive: bool) -> list[Any]:
    import schemathesis
    from hypothesis import HealthCheck, given, settings

    schema = schemathesis.openapi.from_dict(spec)
    mode = schemathesis.GenerationMode.POSITIVE if positive else schemathesis.GenerationMode.NEGATIVE
    op = next(r.ok() for r in schema.get_all_operations() if r.ok().label == label)
    bodies: list[Any] = []

    @settings(max_examples=GENERATED, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=op.as_strategy(generation_mode=mode))
    def draw(case) -> None:
        bodies.append(case.body)

    draw()
    return bodies


@pytest.mark.slow  # ~10 s an operation on 2 busy cores
@pytest.mark.parametrize("label", list(BODY_SCHEMA))
def test_schema_valid_bodies_pass_validation(spec, label) -> None:
    refused = []
    for body in _generated(spec, label, positive=True):
        body = normalise(label, json.loads(json.dumps(body)))
        err = refusal(label, body)
        if err is not None:
            refused.append(f"{err.param}: {err.message}\n    body: {json.dumps(body)[:400]}")
    assert not refused, f"{label}: schema-valid bodies refused:\n  " + "\n  ".join(refused)


@pytest.mark.slow
@pytest.mark.parametrize("label", list(BODY_SCHEMA))
def test_schema_invalid_bodies_get_a_400(spec, label) -> None:
    for body in _generated(spec, label, positive=False):
        err = refusal(label, body)  # anything but an APIError escapes and fails the test
        assert err is None or err.status == 400, (err.status, err.message)
