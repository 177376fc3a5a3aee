"""The field of an admission refusal (issue 38): a real ``Scheduler`` over a tiny random Llama refuses requests
with an ``AdmissionError`` / a ``SamplingParams`` error whose field ``rejection_param`` names, and the HTTP side
turns the engine's field names into each API's (``param_names``, ``engine_error``). Over HTTP:
tests/server/test_admission_params.py."""

from __future__ import annotations

import pytest

from ddtree_serve.model_executor.sampling_params import SamplingParams
from ddtree_serve.server.config import ServerConfig
from ddtree_serve.server.http.serving_common import engine_error, param_names
from ddtree_serve.server.http.serving_structured import Constraint
from ddtree_serve.server.io_struct import GenerateReq, TextOut
from ddtree_serve.server.scheduling.request import AdmissionError, rejection_param

CONTEXT, KV = 128, 96


@pytest.fixture(scope="module")
def scheduler(tmp_path_factory):
    from ddtree_serve.server.scheduling.scheduler import Scheduler
    from tests.conftest import write_tiny_llama_family

    target = write_tiny_llama_family(tmp_path_factory.mktemp("tiny-llama"), "llama")
    return Scheduler(ServerConfig.from_flat(dict(model_path=target, dtype="float32", device="cpu",
                                                 context_length=CONTEXT, max_running_requests=2,
                                                 max_total_tokens=KV)))


REFUSED = [  # (prompt ids, sampling params, the field)
    ([], SamplingParams(max_tokens=4), "prompt"),
    ([1] * (KV + 1), SamplingParams(max_tokens=None), "prompt"),  # no room in the KV cache
    ([1] * 10, SamplingParams(max_tokens=CONTEXT), "prompt"),  # prompt + max_tokens over the context
    ([1] * 10, SamplingParams(max_tokens=KV - 5), "prompt"),  # ... over the KV cache
    ([300], SamplingParams(max_tokens=4), "prompt"),  # outside the 256-token vocabulary
    ([1], SamplingParams(temperature=-1.0), "temperature"),
    ([1], SamplingParams(logit_bias={300: 1.0}), "logit_bias"),
    ([1], SamplingParams(regex="("), "regex"),
    ([1], SamplingParams(json_schema="{"), "json_schema"),
]


@pytest.mark.parametrize(("ids", "params", "field"), REFUSED)
def test_scheduler_refusals_name_their_field(scheduler, ids, params, field) -> None:
    with pytest.raises(ValueError) as e:
        scheduler.add_request(GenerateReq("r", ids, params))
    assert rejection_param(e.value, params) == field, str(e.value)
    assert not scheduler.has_work()  # nothing was queued


def test_rejection_param_of_other_errors() -> None:
    assert rejection_param(AdmissionError("x", None)) is None
    assert rejection_param(ValueError("something else")) is None
    assert rejection_param(ValueError("cannot compile"), SamplingParams(ebnf="root ::= x")) == "ebnf"


def test_each_api_names_the_engines_fields() -> None:
    chat = param_names("messages", "max_completion_tokens", Constraint(json_schema="{}"), logprobs="top_logprobs")
    assert [chat[k] for k in ("prompt", "max_tokens", "json_schema", "regex", "logprobs")] == [
        "messages", "max_completion_tokens", "response_format", "regex", "top_logprobs"]
    forced = param_names("messages", constraint=Constraint(ebnf="root ::= x", forces_tools=True))
    assert forced["ebnf"] == "tool_choice"
    assert param_names("prompt")["prompt_logprobs"] == "logprobs"

    def out(param: str | None, status: int = 400) -> TextOut:
        return TextOut("r", "", [], finished=True, error="refused", error_status=status, error_param=param)

    assert engine_error(out("prompt"), chat).param == "messages"
    assert engine_error(out("temperature"), chat).param == "temperature"  # the same name in every API
    assert engine_error(out(None), chat).param is None
    err = engine_error(out("prompt", 500), chat)  # a failure inside the server is about no field
    assert err.status == 500 and err.param is None
