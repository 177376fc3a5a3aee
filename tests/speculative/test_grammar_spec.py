"""Structured outputs under speculation (default model + shipped DFlash drafter): greedy DDTree and DFlash
output equals greedy constrained output without speculation token for token (with and without drafter-side
masking), sampled speculative outputs validate, and sampled tree verification under per-node grammar
masks reproduces sequential sampling from the masked target (Monte Carlo against the exact law). A grammar
behind a reasoning gate (dormant until an end-of-reasoning token) stays exact when accepted draft paths
cross that token."""

from __future__ import annotations

import json
import random

import pytest
import torch

from ddtree_serve.model_executor.grammar import GrammarBackend, GrammarState, mask_tree_logits
from ddtree_serve.model_executor.position_uniforms import SampleKeys
from ddtree_serve.server.engine import Engine, SamplingParams
from ddtree_serve.speculative.verify import verify_tree
from tests.kernels.test_speculative_exactness import exact_outcomes
from tests.kernels.tree_helpers import random_tree
from tests.model_executor.test_grammar import EOS, REGEX, VOCAB, brute_row, make_tree
from tests.model_executor.test_grammar_engine import MAX_TOKENS, PROMPTS, SCHEMAS, check_json
from tests.speculative.scripted_drafts import install


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
    # Monte Carlo: N copies of the tree in the local alphabet, one seed each
    batch = make_tree(parents, local, copies=N_MC)
    res = verify_tree(batch, masked.expand(N_MC, -1, -1).contiguous(), torch.full((N_MC,), temperature),
                      torch.full((N_MC,), -1), torch.ones(N_MC), torch.zeros(N_MC, dtype=torch.bool),
                      SampleKeys.build([seed * N_MC + i for i in range(N_MC)], [0] * N_MC, torch.device("cpu")))
    ar = torch.arange(N_MC)
    last = res.accept_index[ar, res.accept_length]
    bonus = res.emitted_tokens[ar, res.accept_length]
    emp = torch.bincount(last * na + bonus, minlength=len(parents) * na).double() / N_MC
    tv = 0.5 * float((emp - exact).abs().sum())
    assert tv < TV_TOL, f"TV {tv:.4f}"
    free = exact_outcomes(parents, local, (small.double() / temperature).softmax(-1), s, na)
    assert 0.5 * float((free - exact).abs().sum()) > 0.1, "the grammar must change the law"


GATED_PROMPT = "The weather report in JSON:"
GATED_SCHEMA = SCHEMAS[1]  # {"city": enum, "sunny": boolean}: a bounded answer
END_AT = 6  # output position of the end token
DEPTH = 4  # scripted chain depth


def crossing_script(ref: list[int], end_at: int, vocab: int):
    """Drafts around ``ref`` (the plain output): before the end token, a correct chain that makes a step
    start at ``end_at - 1``; from there a correct chain of ``DEPTH`` (the end token at depth 2, grammar tokens
    below it); every tree also holds a wrong sibling at depth 1 and one below the chain's first node."""

    def script(prompt: list[int], output: list[int], max_depth: int) -> list[tuple[int, int]]:
        k = len(output)
        if output != ref[:k] or k >= len(ref):
            return []
        n = DEPTH if k >= end_at - 1 else end_at - 2 - k  # accepted n, then the bonus: the next step at end_at - 1
        chain = ref[k:k + n]
        if not chain:
            return []
        nodes = [(i, t) for i, t in enumerate(chain)]  # node i + 1 under node i (0: root)
        nodes.append((0, (chain[0] + 1) % vocab))
        if len(chain) > 1:
            nodes.append((1, (chain[1] + 1) % vocab))
        return nodes

    return script


def test_greedy_ddtree_equals_plain_across_the_end_of_reasoning(engines):
    """The end-of-reasoning token is one the model itself writes early in its free greedy text (the default
    model has no ``</think>`` token; the gate knows only a token id). The reasoning before it is that free
    text, the answer after it valid JSON; DDTree (the shipped drafter with drafter-side masking, plus
    scripted drafts whose accepted path runs through the end token at depth 2) equals plain decoding."""
    plain, spec = engines["none"], engines["ddtree"]
    vocab = plain.tokenizer.vocab_size
    free = plain.generate(GATED_PROMPT, SamplingParams(temperature=0, max_tokens=END_AT + 1))[0].token_ids
    end = free[END_AT]
    assert end not in free[:END_AT], "pick a position whose token is new in the free text"
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, json_schema=json.dumps(GATED_SCHEMA),
                        reasoning_end_ids=(end,))
    ref = plain.generate(GATED_PROMPT, sp)[0]
    assert ref.finish_reason == "stop"
    assert ref.token_ids[:END_AT + 1] == free, "the reasoning is the free greedy text"
    check_json(plain.tokenizer.decode(ref.token_ids[END_AT + 1:], skip_special_tokens=True), GATED_SCHEMA)

    worker = getattr(spec.scheduler, "scheduler", spec.scheduler).spec  # as ``install`` finds it
    own_suffix, own_decode = worker.suffix, worker.decode
    try:
        log = install(spec, crossing_script(ref.token_ids, END_AT, vocab))
        starts: list[tuple[int, int]] = []  # (output length before the step, accepted nodes)
        logged = worker.decode

        def decode(reqs, eos_ids):
            before = [len(q.output_ids) for q in reqs]
            out = logged(reqs, eos_ids)
            starts.extend(zip(before, (r.accepted for r in out), strict=True))
            return out

        worker.decode = decode
        got = spec.generate(GATED_PROMPT, sp)[0]
    finally:
        worker.suffix, worker.decode = own_suffix, own_decode
    assert got.token_ids == ref.token_ids and got.finish_reason == "stop"
    log.assert_accepted(min_depth=2)
    # a step whose accepted path holds the end token and grammar tokens after it
    assert any(k <= END_AT and k + a - 1 >= END_AT + 1 for k, a in starts), starts
    st = spec.stats()
    assert st.kv_used_tokens == 0 and st.running == 0
