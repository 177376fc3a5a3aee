"""Fixtures shared by the grammar tests (test_grammar.py, test_grammar_gate.py): the default model's tokenizer and
one xgrammar backend over it, built once per module."""

from __future__ import annotations

import pytest

from ddtree_serve.model_executor.grammar import GrammarBackend

GRAMMAR_VOCAB = 49152  # SmolLM2's vocabulary (the default model)
GRAMMAR_EOS = 2  # its <|im_end|>


@pytest.fixture(scope="module")
def tok(default_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_path)


@pytest.fixture(scope="module")
def backend(tok):
    b = GrammarBackend(tok, GRAMMAR_VOCAB, (GRAMMAR_EOS,))
    yield b
    b.shutdown()
