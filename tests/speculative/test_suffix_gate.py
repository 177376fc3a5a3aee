"""The suffix gate on an accelerator (``speculative/suffix_gate.py``; docs/DESIGN.md 4.13): suffix drafts leave the
device path only where their nodes deeper than any DFlash node are expected to add a step's worth of tokens; an
engine on the device path with DFlash and suffix drafts stays plain decoding's token for token, takes the host
path for a request that copies, keeps the device path (its trees drafted ahead) for chat, and holds no slot. On a
CPU the gate is not consulted (tests/speculative/test_suffix_engine.py: suffix nodes accepted as before)."""

from __future__ import annotations

import numpy as np

from ddtree_serve.model_executor.model_runner import ModelRunner
from ddtree_serve.server.engine import SamplingParams
from ddtree_serve.speculative.ddtree import PoppedNodes
from ddtree_serve.speculative.suffix_gate import SuffixGate, evidence_ratios
from tests.speculative.test_suffix_engine import COPY, _assert_released, _chat_ids, _engine


def _chains(depths: list[int], logw: float = 0.0, evidence: list[tuple[float, float]] | None = None) -> PoppedNodes:
    """One suffix chain per request, ``depths[b]`` levels deep, every node scored ``logw``."""
    bs, width = len(depths), max(max(depths), 1)
    held = np.arange(width)[None, :] < np.array(depths)[:, None]  # [bs, W]
    return PoppedNodes(tokens=np.ones((bs, width), dtype=np.int64),
                       parents=np.where(held, np.arange(width)[None, :] - 1, -1),
                       depths=np.where(held, np.arange(1, width + 1)[None, :], 0),
                       logws=np.where(held, logw, -np.inf), counts=np.array(depths, dtype=np.int64),
                       evidence=np.array(evidence, dtype=np.float64) if evidence is not None else None)


def test_gate_weighs_deep_calibrated_nodes_against_a_steps_tokens() -> None:
    gate = SuffixGate(block_size=8, tokens_per_step=4.0)
    long_copy = _chains([40])  # 33 nodes at depths 8..40, each expected reached
    assert gate.admits(long_copy, np.ones(1))
    assert not gate.admits(_chains([7]), np.ones(1))  # no node deeper than the DFlash tree
    assert not gate.admits(_chains([10]), np.ones(1))  # 3 deep nodes: under a step's 4 tokens
    assert not gate.admits(long_copy, np.array([0.1]))  # a request whose suffix drafts seldom hold
    assert not gate.admits(_chains([40, 0, 0, 0, 0, 0, 0, 0, 0, 0]), np.ones(10))  # 33 < 10 requests x 4
    assert gate.admits(_chains([40, 40, 0, 0]), np.ones(4))
    assert (gate.admitted, gate.deferred) == (2, 4)
    gate.observe([1, 1])
    assert gate.tokens_per_step == 4.0 - 0.2 * 3.0
    assert evidence_ratios(_chains([3, 3], evidence=[(2.0, 4.0), (0.0, 0.0)])).tolist() == [0.5, 1.0]
    assert evidence_ratios(_chains([3])).tolist() == [1.0]


def test_device_path_with_suffix_drafts_equals_plain(default_model_path, copy_chat_ref, monkeypatch) -> None:
    """The copy and chat prompts (greedy, 40 tokens) in one batch and the code copy alone, DFlash and suffix drafts at
    budget 8 on the device path (forced: the runner reports an accelerator): plain decoding's tokens; the code copy
    at batch 1 passes the gate (suffix nodes accepted), the mixed batch keeps the device path for some steps (trees
    drafted ahead and taken); every slot and suffix index released."""
    ids, ref = copy_chat_ref
    monkeypatch.setattr(ModelRunner, "accelerated", property(lambda self: True))
    e = _engine(default_model_path, speculative_algorithm="ddtree", draft_sources="dflash,suffix", ddtree_budget=8,
                draft_model_path="default")
    try:
        worker = e.scheduler.spec
        gate = worker.suffix_gate
        sp = SamplingParams(temperature=0, max_tokens=40)
        mixed = e.generate(input_ids=ids, sampling_params=sp)
        assert [o.token_ids for o in mixed] == ref
        assert gate.deferred > 0 and worker.ahead_taken > 0  # the device path kept, its trees drafted ahead
        worker.suffix.shared.__init__(worker.suffix.config)  # batch 1 without the outputs above
        before = gate.admitted
        single = e.generate(input_ids=_chat_ids(e, COPY[:1]), sampling_params=sp)[0]  # the code to repeat
        assert single.token_ids == ref[0]
        assert gate.admitted > before and single.spec_accepted_suffix > 0
        _assert_released(e)
    finally:
        e.shutdown()

