"""The verify-workspace cap end to end: a stated ``verify_workspace_gb`` lowers the per-request budget of
a step so that ``batch x (budget + 1)`` verify tokens fit ``max_verify_tokens``, and the output stays
exactly the plain greedy output (the cap changes the tree, never the tokens). Also ``max_tokens=None``:
admitted when the prompt fits and ended with ``length`` at the request limit."""

from __future__ import annotations

import pytest

from ddtree_serve.model_executor.memory import GIB, LOGIT_ROW_BYTES_PER_ENTRY
from ddtree_serve.server.engine import Engine, SamplingParams
from tests.speculative.drafter_utils import write_random_drafter

VOCAB, BLOCK, BATCH = 24, 5, 2
PROMPTS = [[3, 7, 11, 2], [5, 1, 9, 13]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.conftest import write_tiny_llama_family

    root = tmp_path_factory.mktemp("cap")
    target = write_tiny_llama_family(root / "target", "qwen3", vocab=VOCAB, seed=3, num_hidden_layers=4)
    drafter = write_random_drafter(target, root / "drafter", num_layers=1, block_size=BLOCK, seed=1, std=0.3)
    return target, drafter


def _workspace_gb(max_verify_tokens: int) -> float:
    """The verify_workspace_gb that allows exactly ``max_verify_tokens`` at BATCH requests."""
    rows = max_verify_tokens + BATCH * (BLOCK - 1) + 0.5
    return rows * VOCAB * LOGIT_ROW_BYTES_PER_ENTRY / GIB


def _run(target: str, drafter: str | None, **kw) -> tuple[list, Engine]:
    spec = dict(speculative_algorithm="ddtree", draft_model_path=drafter, ddtree_budget=8) if drafter else {}
    e = Engine(target, dtype="float32", max_total_tokens=4096, max_running_requests=BATCH, **spec, **kw)
    try:
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        return e.generate(input_ids=PROMPTS, sampling_params=params), e
    finally:
        e.shutdown()


def test_capped_steps_are_lossless_and_bounded(tiny) -> None:
    target, drafter = tiny
    ref, _ = _run(target, None)
    free, e_free = _run(target, drafter)
    assert e_free.scheduler.workspace.max_verify_tokens == BATCH * 9  # derived: the full batch x budget
    assert [o.token_ids for o in free] == [o.token_ids for o in ref]
    assert sum(o.spec_accepted_tokens for o in free) > 0  # the random drafter gets paths accepted
    # 2 verify tokens for 2 requests: budget 0 (root only) every step, i.e. plain decoding through the worker
    root_only, e = _run(target, drafter, verify_workspace_gb=_workspace_gb(BATCH))
    assert e.scheduler.spec.max_verify_tokens == BATCH
    assert [o.token_ids for o in root_only] == [o.token_ids for o in ref]
    # no tree was verified: 11 plain steps (+ the prefill's token), no verify step, acceptance 0
    assert all(o.spec_plain_steps == 11 and o.spec_verify_steps == 0 and o.spec_accepted_tokens == 0
               and o.acceptance_length == 0.0 for o in root_only)
    # 6 verify tokens for 2 requests: budget 2, so at most 2 accepted drafts per step
    capped, _ = _run(target, drafter, verify_workspace_gb=_workspace_gb(6))
    assert [o.token_ids for o in capped] == [o.token_ids for o in ref]
    assert all(o.spec_accepted_tokens <= 2 * o.spec_verify_steps for o in capped)


def test_no_max_tokens_runs_to_the_request_limit(tiny) -> None:
    target, drafter = tiny
    for kw in ({}, dict(speculative_algorithm="ddtree", draft_model_path=drafter, ddtree_budget=8)):
        e = Engine(target, dtype="float32", context_length=40, max_total_tokens=4096, **kw)
        try:
            out = e.generate(
                input_ids=PROMPTS[:1],
                sampling_params=SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
            )[0]
            assert out.finish_reason == "length" and len(PROMPTS[0]) + len(out.token_ids) == 40
            with pytest.raises(ValueError, match="leaves no room"):
                e.generate(input_ids=[[1] * 40], sampling_params=SamplingParams(max_tokens=None))
        finally:
            e.shutdown()
    # a KV pool smaller than the context: the request limit is the pool less one step's slots
    e = Engine(target, dtype="float32", context_length=4096, max_total_tokens=64)
    try:
        assert e.scheduler.max_request_tokens == 63
        out = e.generate(
            input_ids=PROMPTS[:1],
            sampling_params=SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
        )[0]
        assert out.finish_reason == "length" and len(PROMPTS[0]) + len(out.token_ids) == 63
    finally:
        e.shutdown()
