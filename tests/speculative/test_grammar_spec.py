"""Structured outputs under speculation (default model + shipped DFlash drafter): greedy DDTree and DFlash
output equals greedy constrained output without speculation token for token (with and without drafter-side
masking), sampled speculative outputs validate, and sampled tree verification under per-node grammar
masks reproduces sequential sampling from the masked target (Monte Carlo against the exact law)."""

from __future__ import annotations

import json
import random

import pytest
import torch

from model_executor.grammar import GrammarBackend, GrammarState, mask_tree_logits
from server.engine import Engine, SamplingParams
from speculative.verify import verify_tree
from tests.kernels.test_speculative_exactness import exact_outcomes
from tests.kernels.tree_helpers import random_tree
from tests.model_executor.test_grammar import EOS, REGEX, VOCAB, brute_row, make_tree
from tests.model_executor.test_grammar_engine import MAX_TOKENS, PROMPTS, SCHEMAS, check_json


def _engine(path: str, alg: str, **kw) -> Engine:
    spec = {} if alg == "none" else {"draft_model_path": "default", "ddtree_budget": 16}
    return Engine(path, dtype="float32", max_total_tokens=8192, speculative_algorithm=alg, **spec, **kw)


class _Engines(dict):
    """Engines by algorithm, loaded on first use (a deselected algorithm costs nothing)."""

    def __init__(self, path: str):
        super().__init__()
        self.path = path

    def __missing__(self, alg: str) -> Engine:
        self[alg] = _engine(self.path, alg)
        return self[alg]


@pytest.fixture(scope="module")
def engines(default_model_path):
    es = _Engines(default_model_path)
    yield es
    for e in es.values():
        e.shutdown()


def _params(temperature: float = 0.0) -> list[SamplingParams]:
    return [SamplingParams(temperature=temperature, seed=3 + i, max_tokens=MAX_TOKENS, json_schema=json.dumps(s))
            for i, s in enumerate(SCHEMAS)]


@pytest.mark.parametrize("alg", ["ddtree", pytest.param("dflash", marks=pytest.mark.slow)])
def test_greedy_speculative_equals_plain_constrained(engines, alg):
    free = SamplingParams(temperature=0, max_tokens=24)
    prompts = PROMPTS + ["The capital of France is"]  # a free request shares the batch
    ref = engines["none"].generate(prompts, _params() + [free])
    e = engines[alg]
    spec = e.scheduler.spec
    for mask_drafts in (True, False):
        spec.mask_drafts = mask_drafts
        try:
            got = e.generate(prompts, _params() + [free])
        finally:
            spec.mask_drafts = True
        assert [o.token_ids for o in got] == [o.token_ids for o in ref], f"mask_drafts={mask_drafts}"
        assert sum(o.spec_accepted_tokens for o in got) > 0
    for o, s in zip(got, SCHEMAS, strict=False):
        check_json(o.text, s)
    st = e.stats()
    assert st.kv_used_tokens == 0 and st.running == 0


@pytest.mark.parametrize("alg", ["ddtree", pytest.param("dflash", marks=pytest.mark.slow)])
def test_sampled_speculative_outputs_validate(engines, alg):
    outs = engines[alg].generate(PROMPTS, _params(temperature=1.0))
    for o, s in zip(outs, SCHEMAS, strict=True):
        assert o.finish_reason == "stop", o.text
        check_json(o.text, s)


def test_stop_token_mid_path_keeps_matcher(engines):
    """A user stop token inside an accepted path ends the request there; the next request with the same
    grammar starts from a fresh matcher and matches the plain engine."""
    ref = engines["none"].generate([PROMPTS[0]], _params()[:1])[0]
    stop = ref.token_ids[5]
    p = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, json_schema=json.dumps(SCHEMAS[0]), stop_token_ids=(stop,))
    a = engines["none"].generate([PROMPTS[0]], p)[0]
    b = engines["ddtree"].generate([PROMPTS[0]], p)[0]
    assert a.token_ids == b.token_ids == ref.token_ids[:6] and b.finish_reason == "stop"
    again = engines["ddtree"].generate([PROMPTS[0]], _params()[:1])[0]
    assert again.token_ids == ref.token_ids


N_MC = 40_000
TV_TOL = 0.03  # as tests/kernels/test_speculative_exactness.py: expected TV ~0.015 at N_MC, <= 60 outcomes


@pytest.fixture(scope="module")
def backend(default_model_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_path)
    b = GrammarBackend(tok, VOCAB, (EOS,))
    b.alphabet = [tok.convert_tokens_to_ids(t) for t in ("a", "b", "c", "ab", "x")] + [EOS]
    yield b
    b.shutdown()


@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow)])
def test_masked_sampled_verification_is_exact(backend, seed):
    """Target logits live on a six-token alphabet (a, b, c, ab, x, EOS; -inf elsewhere) under the grammar
    ``[ab]{0,3}c``. The emitted (last accepted node, bonus token) of sampled verification over masked rows
    (``mask_tree_logits``) follows the exact law of sequential sampling from the masked target, with masks
    computed independently by brute force per path."""
    rng = random.Random(seed)
    alpha = backend.alphabet
    na = len(alpha)
    parents, local = random_tree(rng, 9, na)
    tokens = [alpha[t] for t in local]
    g = torch.Generator().manual_seed(100 + seed)
    small = torch.randn(len(parents), na, generator=g)  # [D, A]
    for c in range(1, len(parents)):
        small[parents[c], local[c]] += 1.5  # a drafter that is often right
    logits = torch.full((1, len(parents), VOCAB), float("-inf"))  # [1, D, V]
    logits[0][:, alpha] = small
    state = GrammarState(backend.compile("regex", REGEX), (EOS,), VOCAB)
    tree = make_tree(parents, tokens)
    masked = mask_tree_logits([state], tree, logits)[0][:, alpha]  # [D, A]
    # the exact law from brute-force masks (rows the walk can never reach: uniform, unused)
    rows = torch.full((len(parents), na), 1.0 / na, dtype=torch.float64)
    temperature = 0.8
    for i in range(len(parents)):
        path, k = [], i
        while k > 0:
            path.append(tokens[k])
            k = parents[k]
        want = brute_row(backend, "regex", REGEX, path[::-1])
        if want is not None:
            allowed = ((want[torch.tensor(alpha) >> 5] >> (torch.tensor(alpha) & 31)) & 1).bool()  # [A]
            rows[i] = torch.where(allowed, small[i].double() / temperature, -torch.inf).softmax(-1)
    s = 1 + max(int(x) for x in tree.depths[0])
    exact = exact_outcomes(parents, local, rows, s, na)
    # Monte Carlo: N copies of the tree in the local alphabet, one generator each
    batch = make_tree(parents, local, copies=N_MC)
    res = verify_tree(batch, masked.expand(N_MC, -1, -1).contiguous(), torch.full((N_MC,), temperature),
                      torch.full((N_MC,), -1), torch.ones(N_MC), torch.zeros(N_MC, dtype=torch.bool),
                      [torch.Generator().manual_seed(seed * N_MC + i) for i in range(N_MC)])
    ar = torch.arange(N_MC)
    last = res.accept_index[ar, res.accept_length]
    bonus = res.emitted_tokens[ar, res.accept_length]
    emp = torch.bincount(last * na + bonus, minlength=len(parents) * na).double() / N_MC
    tv = 0.5 * float((emp - exact).abs().sum())
    assert tv < TV_TOL, f"TV {tv:.4f}"
    free = exact_outcomes(parents, local, (small.double() / temperature).softmax(-1), s, na)
    assert 0.5 * float((free - exact).abs().sum()) > 0.1, "the grammar must change the law"
