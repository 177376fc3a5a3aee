"""docs/API.md's field lists match the request models (issue 46): every field of the chat and completion
requests is documented in "Request fields" (or linked from there), and the list of known-but-refused fields
names exactly the fields whose values validation refuses, each of which really is a 400 naming itself."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from ddtree_serve.server.http.protocol import ChatCompletionRequest, CompletionRequest

DOC = (Path(__file__).resolve().parents[2] / "docs" / "API.md").read_text()
SECTION = DOC[DOC.index("## Request fields"):DOC.index("\n## ", DOC.index("## Request fields") + 5)]
# the refused list: the bullets after "never silently dropped:"
REFUSED_LIST = SECTION.split("never silently dropped:", 1)[1].split("\n\n", 1)[0]
# a value of each refused field that the server refuses (a field's default or null is accepted)
REFUSED = {"store": True, "metadata": {"k": "v"}, "service_tier": "flex", "stream_options": {"include_usage": True},
           "best_of": 3, "suffix": "tail",
           "functions": [{"name": "f"}], "function_call": "auto", "audio": {"voice": "x"},
           "web_search_options": {}, "verbosity": "low", "modalities": ["audio"], "top_logprobs": 2}
CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("model", [ChatCompletionRequest, CompletionRequest], ids=lambda m: m.__name__)
def test_every_request_field_is_documented(model) -> None:
    missing = [f for f in model.model_fields if not re.search(rf"`{f}[`.:\[ (]", SECTION)]
    assert not missing, f"docs/API.md 'Request fields' does not name {missing}"


def test_the_refused_list_is_what_validation_refuses() -> None:
    named = set(re.findall(r"`([a-z_]+)[`:]", REFUSED_LIST)) & (set(ChatCompletionRequest.model_fields)
                                                                | set(CompletionRequest.model_fields))
    # the list also names the fields a refusal depends on: n (best_of must equal it), stream (stream_options),
    # logprobs (top_logprobs), tools and tool_choice
    # (tools without --tool-call-parser: a server setting, refused by the handler, tests/server/test_server.py)
    listed = named - {"n", "tools", "tool_choice", "stream", "logprobs"}
    assert listed == set(REFUSED), sorted(listed ^ set(REFUSED))
    for field, value in REFUSED.items():
        model = CompletionRequest if field in ("best_of", "suffix") else ChatCompletionRequest
        base = {"prompt": "x"} if model is CompletionRequest else dict(CHAT)
        with pytest.raises(ValidationError) as e:
            model.model_validate({**base, field: value})
        assert any(field in err["loc"] for err in e.value.errors()), (field, e.value.errors())
