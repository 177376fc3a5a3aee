"""Schemathesis over the published spec (/openapi.json) against a real server process (default model, CPU).

Positive mode (bodies valid by the spec): every body, after the documented normalisation
(tests/server/openapi_fuzz_normalise.py, docs/API.md "What the spec cannot say"), is accepted (2xx); the
failure lists the rejected bodies per operation. Negative mode (bodies the spec forbids): never a 5xx.
Slow: ``EXAMPLES`` generated requests per operation and mode (``DDTREE_FUZZ_EXAMPLES``, default 20), each a
real request to the real model. The server's settings are those under which the spec's rules are the whole
story: a tool-call and a reasoning parser (tools and thinking are served), a context the generated prompts fit.

    PYTHONPATH=$PWD python -m pytest -q -m slow tests/server/test_openapi_fuzz.py -s
"""

from __future__ import annotations

import json
import os

import pytest

from tests.server.conftest import running_server
from tests.server.openapi_fuzz_normalise import normalise

pytestmark = pytest.mark.slow
EXAMPLES = int(os.environ.get("DDTREE_FUZZ_EXAMPLES", "20"))  # per operation and generation mode
SERVER_ARGS = ["--context-length", "4096", "--max-running-requests", "16", "--tool-call-parser", "hermes",
               "--reasoning-parser", "deepseek-r1"]
CONTEXT_ERROR = "context_length_exceeded"  # the error code of a prompt over the served context (a 400 the spec cannot state)
OPERATIONS = {"POST /v1/chat/completions", "POST /v1/completions", "POST /v1/messages", "POST /v1/responses",
              "POST /tokenize", "POST /detokenize"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from ddtree_serve.model_executor.default_model import ensure_default_model

    ensure_default_model()
    with running_server(SERVER_ARGS, tmp_path_factory.mktemp("fuzz")) as srv:
        yield srv.base, srv.log


def _fuzz(op, mode, base: str, log, seen: dict[str, set[int]], refused: dict[str, list[str]]) -> None:
    """Run EXAMPLES generated requests of one operation in one generation mode: none may get a 5xx; a
    schema-valid (positive) body that is not accepted is recorded in ``refused``."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from hypothesis.errors import Unsatisfiable

    positive = mode == schemathesis.GenerationMode.POSITIVE

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=op.as_strategy(generation_mode=mode))
    def check(case) -> None:
        if positive:
            case.body = normalise(op.label, case.body)
        response = case.call(base_url=base, timeout=300)
        seen.setdefault(op.label, set()).add(response.status_code)
        too_long = response.status_code == 400 and CONTEXT_ERROR in response.text  # the tokenizer's and settings' rule
        if positive and not 200 <= response.status_code < 300 and not too_long:
            body = json.dumps(case.body, ensure_ascii=False, default=str)
            refused.setdefault(op.label, []).append(f"{response.status_code} {response.text[:300]}\n    body: "
                                                    f"{body[:600]}")
        assert response.status_code < 500, (
            f"{op.label} -> {response.status_code}: {response.text[:500]}\n"
            f"body: {case.body!r}\nserver log tail:\n{log.read_text()[-2000:]}"
        )

    try:
        check()
    except Unsatisfiable:  # nothing invalid to generate (e.g. a GET without parameters)
        assert not positive, op.label


def test_schema_valid_bodies_are_accepted_and_none_gets_a_5xx(server) -> None:
    schemathesis = pytest.importorskip("schemathesis")

    base, log = server
    schema = schemathesis.openapi.from_url(base + "/openapi.json")
    seen: dict[str, set[int]] = {}
    refused: dict[str, list[str]] = {}  # schema-valid bodies (normalised) that got no 2xx
    for result in schema.get_all_operations():
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            _fuzz(result.ok(), mode, base, log, seen, refused)
    print({k: sorted(v) for k, v in seen.items()})
    assert OPERATIONS <= set(seen)
    assert 400 in seen["POST /v1/chat/completions"]  # the negative examples were rejected, not crashed on
    report = "\n".join(f"{op}: {len(texts)} schema-valid bodies refused\n  " + "\n  ".join(texts)
                       for op, texts in sorted(refused.items()))
    assert not refused, "the spec is looser than validation (or validation stricter than the spec):\n" + report
