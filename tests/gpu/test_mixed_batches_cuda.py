"""GPU check, issue 14: mixed greedy + sampled batches on the real sgl-kernel against the CPU reference
under the kernel's acceptance rule (``coin_rule=PINNED_COIN_RULE``, ddtree_serve/kernels/speculative.py), the same
through the engine on the default model (greedy requests of a mixed DDTree batch equal plain greedy),
and the KV pool the server sizes on a real device."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ddtree_serve.kernels.dispatch import SGL_KERNEL
from tests.gpu.spy import spy
from tests.gpu.test_kernels_cuda import compare, cuda, need, random_batch
from tests.kernels.tree_helpers import run_greedy, run_sampling
from tests.speculative.scripted_drafts import install

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _pinned_rule():
    import ddtree_serve.kernels.speculative as spec

    rule = getattr(spec, "PINNED_COIN_RULE", None)
    if rule is None:
        pytest.fail(
            "ddtree_serve.kernels.speculative.PINNED_COIN_RULE is missing: the CPU reference cannot state the kernel's rule"
        )
    return rule


@pytest.mark.parametrize("greedy_coin", [0.0, 1.0])
def test_mixed_batch_matches_reference_under_the_kernel_rule(greedy_coin, monkeypatch, backend_report):
    """Half the rows greedy (one-hot target rows, coin 0 or 1), half sampled (coins in (0, 1])."""
    need(SGL_KERNEL)
    rule = _pinned_rule()
    calls = spy(monkeypatch, SGL_KERNEL, "tree_speculative_sampling_target_only")
    bs, d, vocab = 16, 12, 1000
    tree, logits, s = random_batch(11, bs, d, vocab)
    target = logits.softmax(-1)  # [bs, D, V]
    greedy = torch.arange(bs) % 2 == 0  # [bs]
    target[greedy] = torch.nn.functional.one_hot(logits[greedy].argmax(-1), vocab).float()
    g = torch.Generator().manual_seed(5)
    coins = 1 - torch.rand(bs, d, generator=g)  # (0, 1]: both rules accept with the same probability
    coins[greedy] = greedy_coin
    final = torch.rand(bs, generator=g)
    ref = run_sampling(tree, coins, final, target, s=s, coin_rule=rule)
    got = run_sampling(cuda(tree), coins.cuda(), final.cuda(), target.cuda(), s=s)
    compare(ref, got, bs, d)
    assert len(calls) == 1
    if greedy_coin == 1.0:  # greedy rows carrying coin 1 are exact under either rule
        want = run_greedy(tree, logits.argmax(-1), s)
        rows = greedy.nonzero()[:, 0]
        assert torch.equal(got["accept_token_num"].cpu()[rows], want["accept_token_num"][rows])
        assert torch.equal(got["accept_index"].cpu()[rows], want["accept_index"][rows])
    backend_report.append(
        f"mixed greedy+sampled batch (greedy coin {greedy_coin}): sgl-kernel == reference coin_rule={rule!r}"
    )


def _default_pair() -> tuple[str, str]:
    from ddtree_serve.model_executor.default_drafter import default_drafter_path
    from ddtree_serve.model_executor.default_model import default_model_dir

    model = default_model_dir()
    if not (Path(model) / "config.json").exists():
        pytest.skip(
            f"default model not prepared at {model} (ddtree_serve.model_executor.default_model.ensure_default_model prepares it)"
        )
    return str(model), default_drafter_path()


def test_engine_mixed_batch_greedy_rows_equal_plain_greedy(monkeypatch, backend_report):
    """float32 (attention on the torch reference, sgl-kernel verifying): greedy requests inside a batch
    with sampled ones equal plain greedy decoding token for token."""
    need(SGL_KERNEL)
    from ddtree_serve.server.engine import Engine, SamplingParams

    model, drafter = _default_pair()
    prompts = ["List three prime numbers.", "Name a color.", "Count to five.", "Say hello."]
    common = dict(device="cuda", dtype="float32", max_total_tokens=4096)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    base = Engine(model, **common)
    try:
        want = [o.token_ids for o in base.generate(prompts, greedy)]
    finally:
        base.shutdown()
    calls = spy(monkeypatch, SGL_KERNEL, "tree_speculative_sampling_target_only")
    spec = Engine(model, speculative_algorithm="ddtree", draft_model_path=drafter, ddtree_budget=16, **common)
    log = install(spec, None)  # the engine's own drafts (the shipped drafter, suffix), every step logged
    try:
        sampled = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=24, ignore_eos=True, seed=3)
        outs = spec.generate(prompts + prompts, [greedy] * 4 + [sampled] * 4)
    finally:
        spec.shutdown()
    assert [o.token_ids for o in outs[:4]] == want
    log.assert_accepted()  # the equality covers accepted depth >= 2 paths, not the trees' roots alone
    assert len(calls) > 0
    backend_report.append(
        f"engine mixed batch (default pair, float32): greedy rows == plain greedy; "
        f"sgl-kernel sampled verification ran {len(calls)} times"
    )


def test_kv_pool_sized_on_the_device(backend_report):
    """The KV pool the server sizes on this device with the default cache settings."""
    from ddtree_serve.server.engine import Engine

    model, _ = _default_pair()
    free_before, total = torch.cuda.mem_get_info()
    eng = Engine(model, device="cuda", dtype="bfloat16")
    try:
        runner = eng.scheduler.runner
        per_token = runner.kv.layout.bytes_per_token(runner.kv.dtype)
        tokens = runner.num_slots
    finally:
        eng.shutdown()
    assert 16 <= tokens and tokens * per_token <= free_before
    backend_report.append(
        f"KV pool on {torch.cuda.get_device_name()}: {tokens} tokens x {per_token} B "
        f"({tokens * per_token / 2**30:.2f} GiB; device {total / 2**30:.0f} GiB, "
        f"{free_before / 2**30:.0f} GiB free before load)"
    )
