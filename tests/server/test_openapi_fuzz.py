"""Schemathesis over the published spec (/openapi.json) against a real server process: generated requests,
valid (positive) and invalid (negative) under the schema, never get a 5xx. Slow: a bounded number of
examples per operation, each a real request to a real model (a short context keeps generations short)."""

from __future__ import annotations

import pytest

from tests.server.conftest import running_server

pytestmark = pytest.mark.slow
EXAMPLES = 20  # per operation and generation mode


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from model_executor.default_model import ensure_default_model

    ensure_default_model()
    with running_server(["--context-length", "64", "--max-running-requests", "16"],
                        tmp_path_factory.mktemp("fuzz")) as srv:
        yield srv.base, srv.log


def _fuzz(op, mode, base: str, log, seen: dict[str, set[int]], valid: dict[str, list[int]],
          rejected: dict[str, list[str]]) -> None:
    """Run EXAMPLES generated requests of one operation in one generation mode; none may get a 5xx. The statuses
    of schema-valid (positive) bodies are kept in ``valid``: the spec publishes what validation enforces, so
    they should be accepted."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from hypothesis.errors import Unsatisfiable

    positive = mode == schemathesis.GenerationMode.POSITIVE

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=op.as_strategy(generation_mode=mode))
    def check(case) -> None:
        if positive and isinstance(case.body, dict):
            # let valid bodies reach the model: a random model name is a 404, random logit_bias keys are not
            # token ids, and random max_tokens overrun the 64-token context (400s the schema cannot express)
            case.body.pop("model", None)
            case.body.pop("logit_bias", None)
            if "prompt" in case.body and not (isinstance(case.body["prompt"], str) and case.body["prompt"].strip()):
                case.body["prompt"] = "Hello"  # empty prompts and random token ids are 400s the schema cannot express
            for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
                if isinstance(case.body.get(key), int):
                    case.body[key] = min(case.body[key], 4)
        response = case.call(base_url=base, timeout=300)
        seen.setdefault(op.label, set()).add(response.status_code)
        if positive:
            valid.setdefault(op.label, []).append(response.status_code)
            if response.status_code == 400:
                rejected.setdefault(op.label, []).append(response.text[:160])
        assert response.status_code < 500, (
            f"{op.label} -> {response.status_code}: {response.text[:500]}\n"
            f"body: {case.body!r}\nserver log tail:\n{log.read_text()[-2000:]}"
        )

    try:
        check()
    except Unsatisfiable:  # nothing invalid to generate (e.g. a GET without parameters)
        assert not positive, op.label


def test_schemathesis_finds_no_server_error(server) -> None:
    schemathesis = pytest.importorskip("schemathesis")

    base, log = server
    schema = schemathesis.openapi.from_url(base + "/openapi.json")
    seen: dict[str, set[int]] = {}
    valid: dict[str, list[int]] = {}
    rejected: dict[str, list[str]] = {}  # the 400 bodies of schema-valid requests
    for result in schema.get_all_operations():
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            _fuzz(result.ok(), mode, base, log, seen, valid, rejected)
    assert {"POST /v1/chat/completions", "POST /v1/completions", "POST /v1/messages", "POST /v1/responses",
            "POST /tokenize", "POST /detokenize"} <= set(seen)
    assert 400 in seen["POST /v1/chat/completions"]  # the negative examples were rejected, not crashed on
    assert 200 in seen["POST /v1/completions"]  # and valid ones generated
    print({k: sorted(v) for k, v in seen.items()})
    accepted = {k: sum(c < 400 for c in v) / len(v) for k, v in valid.items() if v}
    print("schema-valid bodies accepted:", accepted)
    for route, texts in rejected.items():
        print(route, "schema-valid but rejected:", *texts, sep="\n  ")
    # Not yet asserted (issue 38, left open): on 2026-12-03 only 25-30% of the schema-valid chat / completions
    # bodies were accepted; the published schema is still looser than validation in places.
