"""Chat fields that would change the reply and cannot be honoured are a 400 naming them, never ignored
(ddtree_serve/server/http/protocol.py ``CHAT_REFUSED``); their null forms and text-only ``modalities`` are accepted."""

from __future__ import annotations

import pytest

from ddtree_serve.server.http.chat_bridge import chat_request
from ddtree_serve.server.http.errors import APIError
from ddtree_serve.server.http.protocol import CHAT_REFUSED

USER = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(("field", "value"), [("audio", {"voice": "alloy", "format": "wav"}),
                                              ("web_search_options", {}), ("verbosity", "low"),
                                              ("modalities", ["text", "audio"])])
def test_refused(field, value) -> None:
    with pytest.raises(APIError) as e:
        chat_request({"messages": USER, field: value})
    assert e.value.status == 400 and e.value.param == field, e.value.message
    if field in CHAT_REFUSED:
        assert CHAT_REFUSED[field] in e.value.message


def test_null_and_text_only_accepted() -> None:
    req = chat_request({"messages": USER, "audio": None, "web_search_options": None, "verbosity": None,
                        "modalities": ["text"]})
    assert req.modalities == ["text"]
