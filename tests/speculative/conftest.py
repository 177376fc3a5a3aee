"""Fixtures shared by the speculative tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def plain_refs(default_model_path):
    """Seeded plain outputs of four chat prompts for every variant of tests/speculative/test_seeded_lossless.py
    (prefix cache off): the reference of its tests and of test_device_tree.py's and test_padded_trees.py's.
    Session-scoped: a plain float32 engine's outputs are fixed, so one computation (~11 s) serves all three
    modules instead of one per module."""
    from benchmarks.common import CHAT_PROMPTS, chat_ids
    from ddtree_serve.server.engine import Engine
    from tests.speculative.test_seeded_lossless import VARIANTS

    base = Engine(default_model_path, dtype="float32", max_total_tokens=16384, disable_radix_cache=True)
    try:
        ids = chat_ids(base.tokenizer, CHAT_PROMPTS)[:4]
        refs = {name: [o.token_ids for o in base.generate(input_ids=ids, sampling_params=params)]
                for name, params in VARIANTS.items()}
    finally:
        base.shutdown()
    return ids, refs


@pytest.fixture(scope="session")
def copy_chat_ref(default_model_path):
    """Plain greedy outputs of tests/speculative/test_suffix_engine.py's copy and chat prompts (the reference),
    and the prompts' ids: shared by its tests and test_suffix_gate.py's, computed once (~5 s) for both."""
    from ddtree_serve.server.engine import SamplingParams
    from tests.speculative.test_suffix_engine import CHAT, COPY, _chat_ids, _engine

    plain = _engine(default_model_path, speculative_algorithm="none")
    try:
        ids = _chat_ids(plain, COPY + CHAT)
        ref = [o.token_ids for o in plain.generate(input_ids=ids, sampling_params=SamplingParams(temperature=0,
                                                                                                   max_tokens=40))]
    finally:
        plain.shutdown()
    return ids, ref
