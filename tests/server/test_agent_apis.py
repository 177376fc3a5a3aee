"""The agent APIs on a real server (default model, hermes tool parser, float32, an API key), through the
official SDKs: Anthropic Messages (/v1/messages) and OpenAI Responses (/v1/responses) give the same greedy
text as /v1/chat/completions for the same conversation, stream in their own event formats, round-trip tool
calls, constrain output through the grammar path, and refuse what they cannot honour in their own error
shapes; /tokenize and /detokenize match the prompts chat completions generates from."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema_rs
import openai
import pytest

from tests.server.conftest import running_server

KEY = "sk-agent-key"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 32},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}
A_TOOLS = [{"name": "get_weather", "description": "Current weather in a city", "input_schema": WEATHER}]
R_TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather in a city",
            "parameters": WEATHER}]
C_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                             "parameters": WEATHER}}]
SYSTEM = "You are a terse assistant."
QUESTION = "What is the weather in Paris?"
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from ddtree_serve.model_executor.default_model import ensure_default_model

    ensure_default_model()
    args = ["--api-key", KEY, "--max-total-tokens", "8192", "--tool-call-parser", "hermes", "--dtype", "float32"]
    with running_server(args, tmp_path_factory.mktemp("agents")) as srv:
        yield srv.base


@pytest.fixture(scope="module")
def ant(base):
    return anthropic.Anthropic(base_url=base, api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def oai(base):
    return openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _chat(oai, messages: list[dict], max_tokens: int, **kw):
    return oai.chat.completions.create(model="default", messages=messages, max_tokens=max_tokens, temperature=0,
                                       **kw)


def _post(base: str, path: str, body: dict, key: str | None = KEY) -> httpx.Response:
    headers = {"x-api-key": key} if key else {}
    return httpx.post(base + path, json=body, headers=headers, timeout=120)


def _events(base: str, path: str, body: dict) -> list[tuple[str, dict]]:
    out = []
    with httpx.stream("POST", base + path, json={**body, "stream": True}, headers={"x-api-key": KEY},
                      timeout=120) as r:
        assert r.status_code == 200, r.read()
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                assert data["type"] == name, (name, data)
                out.append((name, data))
    return out


# ---- Anthropic Messages ----------------------------------------------------------------------------------
def test_messages_text_equals_chat_streamed_and_not(base, ant, oai) -> None:
    msgs = [{"role": "user", "content": "Name three colours."}]
    chat = _chat(oai, [{"role": "system", "content": SYSTEM}, *msgs], 24)
    m = ant.messages.create(model="default", system=SYSTEM, messages=msgs, max_tokens=24, extra_body=GREEDY)
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == chat.choices[0].message.content
    assert m.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert m.usage.output_tokens == chat.usage.completion_tokens and m.usage.cache_read_input_tokens > 0
    with ant.messages.stream(model="default", system=[{"type": "text", "text": SYSTEM}], messages=msgs,
                             max_tokens=24, extra_body=GREEDY) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert streamed == final.content[0].text == m.content[0].text and final.stop_reason == m.stop_reason
    assert final.usage.output_tokens == m.usage.output_tokens
    names = [n for n, _ in _events(base, "/v1/messages", {"messages": msgs, "max_tokens": 8, **GREEDY})]
    assert names[:3] == ["message_start", "ping", "content_block_start"] and names[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}


@pytest.mark.slow  # keeps the default suite's share of this module near a minute
def test_messages_stop_sequence(ant) -> None:
    msgs = [{"role": "user", "content": "Count from one to ten in words."}]
    full = ant.messages.create(model="default", messages=msgs, max_tokens=24, extra_body=GREEDY).content[0].text
    word = full.split()[len(full.split()) // 2]
    m = ant.messages.create(model="default", messages=msgs, max_tokens=24, stop_sequences=[word], extra_body=GREEDY)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == word
    assert m.content[0].text == full[:full.index(word)]


def test_messages_tool_use_round_trip_equals_chat(base, ant, oai) -> None:
    msgs = [{"role": "user", "content": QUESTION}]
    forced = {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}  # one call, then EOS
    m = ant.messages.create(model="default", messages=msgs, tools=A_TOOLS, tool_choice=forced, max_tokens=60,
                            extra_body=GREEDY)
    calls = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and calls and calls[0].name == "get_weather"
    assert jsonschema_rs.is_valid(WEATHER, calls[0].input), calls[0].input
    # streamed: the arguments arrive as input_json_delta and add up to the same input
    events = _events(base, "/v1/messages", {"messages": msgs, "tools": A_TOOLS, "tool_choice": forced,
                                            "max_tokens": 60, **GREEDY})
    start = next(d for n, d in events if n == "content_block_start")
    assert start["content_block"]["type"] == "tool_use" and start["content_block"]["name"] == "get_weather"
    partial = "".join(d["delta"]["partial_json"] for n, d in events
                      if n == "content_block_delta" and d["index"] == start["index"])
    assert json.loads(partial) == calls[0].input
    assert next(d for n, d in events if n == "message_delta")["delta"]["stop_reason"] == "tool_use"
    # the result goes back; the answer equals chat completions' for the same conversation
    result = "18 degrees and sunny"
    answer = ant.messages.create(model="default", tools=A_TOOLS, max_tokens=16, extra_body=GREEDY, messages=[
        *msgs, {"role": "assistant", "content": m.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": calls[0].id, "content": result}]}])
    chat = _chat(oai, [*msgs, {"role": "assistant", "content": None, "tool_calls": [
        {"id": calls[0].id, "type": "function", "function": {"name": "get_weather",
                                                             "arguments": json.dumps(calls[0].input)}}]},
        {"role": "tool", "tool_call_id": calls[0].id, "content": result}], 16, tools=C_TOOLS)
    assert answer.content[0].type == "text" and answer.content[0].text == chat.choices[0].message.content


@pytest.mark.slow  # keeps the default suite's share of this module near a minute
def test_messages_output_config_format_is_json_schema(ant) -> None:
    m = ant.messages.create(model="default", messages=[{"role": "user", "content": QUESTION}], max_tokens=60,
                            extra_body={**GREEDY, "output_config": {"format": {"type": "json_schema",
                                                                                 "schema": WEATHER}}})
    assert m.stop_reason == "end_turn" and jsonschema_rs.is_valid(WEATHER, json.loads(m.content[0].text))


MESSAGE_400 = [
    ({"max_tokens": None}, "max_tokens"),
    ({"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}, "mcp_servers"),
    ({"thinking": {"type": "between_tools"}}, "between_tools"),
    ({"messages": [{"role": "system", "content": "only a system message"}]}, "user"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]}]},
     "image"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The"}]}, "prefill"),
    ({"temperature": 1.5}, "temperature"),
    ({"tool_choice": {"type": "tool", "name": "nope"}, "tools": A_TOOLS}, "nope"),
]


@pytest.mark.parametrize(("extra", "words"), MESSAGE_400)
def test_messages_errors_have_anthropic_shape(base, extra, words) -> None:
    body = {k: v for k, v in {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}.items()
            if v is not None}
    r = _post(base, "/v1/messages", body)
    assert r.status_code == 400, r.text
    err = r.json()
    assert set(err) == {"type", "error"} and err["type"] == "error", err
    assert err["error"]["type"] == "invalid_request_error" and words in err["error"]["message"], err


def test_messages_404_401_and_sdk_errors(base, ant) -> None:
    r = _post(base, "/v1/messages", {"model": "claude-x", "messages": [{"role": "user", "content": "hi"}],
                                     "max_tokens": 4})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error", r.text
    r = _post(base, "/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}, key=None)
    assert r.status_code == 401 and r.json() == {"type": "error", "error": {
        "type": "authentication_error", "message": "invalid or missing API key"}}
    with pytest.raises(anthropic.BadRequestError) as e:
        ant.messages.create(model="default", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                            extra_body={"speed": "fast"})
    assert e.value.body["error"]["type"] == "invalid_request_error" and "speed" in e.value.body["error"]["message"]


# ---- OpenAI Responses ------------------------------------------------------------------------------------
def test_responses_text_equals_chat_streamed_and_not(oai) -> None:
    chat = _chat(oai, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name three colours."}],
                 24)
    r = oai.responses.create(model="default", instructions=SYSTEM, input="Name three colours.",
                             max_output_tokens=24, temperature=0)
    assert r.output_text == chat.choices[0].message.content and r.status in ("completed", "incomplete")
    assert (r.status == "incomplete") == (chat.choices[0].finish_reason == "length")
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == chat.usage.completion_tokens
    with oai.responses.stream(model="default", instructions=SYSTEM, max_output_tokens=24, temperature=0,
                              input=[{"role": "user", "content": [{"type": "input_text",
                                                                   "text": "Name three colours."}]}]) as s:
        events = list(s)
    kinds = [ev.type for ev in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == f"response.{r.status}"
    deltas = "".join(ev.delta for ev in events if ev.type == "response.output_text.delta")
    assert deltas == events[-1].response.output_text == r.output_text


def test_responses_function_call_round_trip_equals_chat(oai) -> None:
    r = oai.responses.create(model="default", input=QUESTION, tools=R_TOOLS, max_output_tokens=60, temperature=0,
                             tool_choice={"type": "function", "name": "get_weather"}, parallel_tool_calls=False)
    call = r.output[0]
    assert call.type == "function_call" and call.name == "get_weather"
    assert jsonschema_rs.is_valid(WEATHER, json.loads(call.arguments))
    with oai.responses.stream(model="default", input=QUESTION, tools=R_TOOLS, max_output_tokens=60, temperature=0,
                              tool_choice={"type": "function", "name": "get_weather"}, parallel_tool_calls=False) as s:
        deltas = "".join(ev.delta for ev in s if ev.type == "response.function_call_arguments.delta")
        streamed = s.get_final_response().output[0]
    assert streamed.type == "function_call" and deltas == streamed.arguments == call.arguments
    result = "18 degrees and sunny"
    answer = oai.responses.create(model="default", tools=R_TOOLS, max_output_tokens=16, temperature=0, input=[
        {"role": "user", "content": QUESTION},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": result}])
    chat = _chat(oai, [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": result}], 16, tools=C_TOOLS)
    assert answer.output_text == chat.choices[0].message.content


def test_responses_text_format_json_schema(oai) -> None:
    r = oai.responses.create(model="default", input=QUESTION, max_output_tokens=60, temperature=0, text={
        "format": {"type": "json_schema", "name": "weather", "schema": WEATHER, "strict": True}})
    assert r.status == "completed" and jsonschema_rs.is_valid(WEATHER, json.loads(r.output_text))


@pytest.mark.parametrize(("extra", "param"), [
    ({"store": True}, "store"), ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"reasoning": {"effort": "high"}}, "reasoning"), ({"include": ["file_search_call.results"]}, "include"),
    ({"tools": [{"type": "function", "name": "a.b"}]}, "tools"), ({"max_output_tokens": 0}, "max_output_tokens")])
def test_responses_refusals_are_openai_400s(oai, extra, param) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model="default", input="hi", extra_body=extra)
    err = e.value.body
    assert err["param"] == param and err["type"] == "invalid_request_error", err


# ---- /tokenize, /detokenize -----------------------------------------------------------------------------
def test_tokenize_matches_chat_prompt_and_detokenize_inverts(base, oai) -> None:
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    chat = _chat(oai, msgs, 1, tools=C_TOOLS)
    tok = httpx.post(base + "/tokenize", json={"messages": msgs, "tools": C_TOOLS, "return_token_strs": True}).json()
    assert tok["count"] == len(tok["tokens"]) == chat.usage.prompt_tokens == len(tok["token_strs"])
    assert tok["max_model_len"] == 8192
    text = httpx.post(base + "/detokenize", json={"tokens": tok["tokens"]}).json()
    assert text["prompt"] == text["text"] and QUESTION in text["text"] and SYSTEM in text["text"]
    plain = httpx.post(base + "/tokenize", json={"prompt": QUESTION}).json()
    assert httpx.post(base + "/detokenize", json={"tokens": plain["tokens"]}).json()["text"] == QUESTION
    for path, body in (("/tokenize", {"prompt": "a", "messages": msgs}), ("/detokenize", {"tokens": [-1]})):
        r = httpx.post(base + path, json=body)
        assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text


def test_messages_count_tokens_and_documents(base, ant) -> None:
    """POST /v1/messages/count_tokens (Claude Code calls it; issue 46 item 8) through the official SDK: the
    prompt /v1/messages sends, system, tools and a plain-text document block included; PDF and URL document
    sources and citations are 400s in Anthropic's shape."""
    doc = {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "Paris is sunny."},
           "title": "Report"}
    messages = [{"role": "user", "content": [doc, {"type": "text", "text": QUESTION}]}]
    counted = ant.messages.count_tokens(model="default", system=SYSTEM, tools=A_TOOLS, messages=messages)
    m = ant.messages.create(model="default", system=SYSTEM, tools=A_TOOLS, messages=messages, max_tokens=2,
                            extra_body=GREEDY)
    assert counted.input_tokens == m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) > 0
    bare = ant.messages.count_tokens(model="default", system=SYSTEM, tools=A_TOOLS,
                                     messages=[{"role": "user", "content": QUESTION}])
    assert counted.input_tokens > bare.input_tokens  # the document's title and text are in the prompt
    for bad in ({"type": "base64", "media_type": "application/pdf", "data": "JVBERi0="},
                {"type": "url", "url": "https://example.invalid/a.pdf"}):
        r = _post(base, "/v1/messages/count_tokens", {"messages": [{"role": "user", "content": [
            {"type": "document", "source": bad}]}]})
        assert r.status_code == 400 and r.json()["type"] == "error" and "plain-text" in r.text, r.text
    r = _post(base, "/v1/messages", {"max_tokens": 2, "messages": [{"role": "user", "content": [
        {**doc, "citations": {"enabled": True}}]}]})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_responses_as_codex_sends_them(base, oai) -> None:
    """Issue 61: a namespace tool is served flattened and its call comes back with its name and namespace, a
    built-in tool is not offered (the request is served), reasoning.summary is accepted; streamed and not."""
    ns = {"type": "namespace", "name": "weather", "description": "Weather tools", "tools": [
        {"type": "function", "name": "get_weather", "description": "Current weather in a city", "parameters": WEATHER}]}
    body = {"input": QUESTION, "tools": [ns, {"type": "web_search"}], "tool_choice": "required",
            "parallel_tool_calls": False, "reasoning": {"summary": "auto"}, "store": False, "max_output_tokens": 60,
            "temperature": 0}
    r = _post(base, "/v1/responses", body)
    assert r.status_code == 200, r.text
    calls = [o for o in r.json()["output"] if o["type"] == "function_call"]
    assert calls and calls[0]["name"] == "get_weather" and calls[0]["namespace"] == "weather", r.json()["output"]
    assert jsonschema_rs.is_valid(WEATHER, json.loads(calls[0]["arguments"]))
    events = _events(base, "/v1/responses", body)
    done = [d["item"] for n, d in events if n == "response.output_item.done" and d["item"]["type"] == "function_call"]
    assert [(c["name"], c["namespace"], c["arguments"]) for c in done] == [
        (c["name"], c["namespace"], c["arguments"]) for c in calls]
    # the call goes back in the history, namespaced; the answer equals the plain function tool's
    follow = [{"role": "user", "content": QUESTION}, {**calls[0], "status": "completed"},
              {"type": "function_call_output", "call_id": calls[0]["call_id"], "output": "18 degrees"}]
    a = _post(base, "/v1/responses", {"input": follow, "tools": [ns], "max_output_tokens": 12, "temperature": 0})
    flat = {**calls[0], "name": "weather__get_weather"}
    flat.pop("namespace")
    b = _post(base, "/v1/responses", {"input": [follow[0], flat, follow[2]], "max_output_tokens": 12,
                                      "temperature": 0, "tools": [{**ns["tools"][0], "name": "weather__get_weather",
                                                                   "description": "Current weather in a city"}]})
    assert a.status_code == b.status_code == 200, (a.text, b.text)

    def seen(out: list[dict]) -> list:
        return [(o["type"], o.get("content"), o.get("arguments")) for o in out]

    assert seen(a.json()["output"]) == seen(b.json()["output"])  # the same prompt: the same greedy reply
