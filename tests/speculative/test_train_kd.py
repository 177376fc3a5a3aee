"""Soft targets for drafter training (--teacher-topk / --kd-weight): the data stage stores the target's top-K
next-token log-probabilities per response token (== a plain forward's, up to float16), the KD loss equals a
hand computation (with and without the corpus vocabulary), alpha 0 is bit-identical to hard labels, and shards
without teacher data still train."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from ddtree_serve.speculative.train.datagen import generate_batch, make_runner, write_meta
from ddtree_serve.speculative.train.objective import dflash_loss, make_block_batch
from ddtree_serve.speculative.train.trainer import TrainConfig, corpus_vocab, train
from tests.conftest import write_tiny_llama_family

K = 8


@pytest.fixture(scope="module")
def kd_data(tmp_path_factory):
    """A tiny random Llama target; greedy and T=1 responses with features and top-K teacher data."""
    root = tmp_path_factory.mktemp("dflash-kd")
    target = write_tiny_llama_family(root / "target", "llama", vocab=64, num_hidden_layers=4, eos_token_id=63)
    runner = make_runner(target, 4096)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 60, (int(n),), generator=g).tolist() for n in torch.randint(4, 9, (12,), generator=g)]
    temps = [0.0] * 8 + [1.0] * 4
    teacher: list[tuple[torch.Tensor, torch.Tensor]] = []
    seqs, feats = generate_batch(runner, prompts, temps, 20, {63}, (0, 2), torch.Generator().manual_seed(5), K,
                                 teacher)
    plain, _ = generate_batch(runner, prompts, temps, 20, {63}, (0, 2), torch.Generator().manual_seed(5))
    assert plain == seqs  # storing the teacher does not change the generation
    recs = [{"tokens": torch.tensor(s, dtype=torch.int32), "prompt_len": len(p), "temperature": t,
             "feats": f.bfloat16(), "teacher_ids": ti, "teacher_logp": tl}
            for s, p, t, f, (ti, tl) in zip(seqs, prompts, temps, feats, teacher, strict=True)]
    return target, root, recs


def _data_dir(root, name: str, train_recs: list[dict], eval_recs: list[dict]):
    data = root / name
    write_meta(str(data), "target", (0, 2), "bfloat16")
    (data / "feat").mkdir(exist_ok=True)
    torch.save(train_recs, data / "feat" / "train_00000.pt")
    torch.save(eval_recs, data / "feat" / "eval_00000.pt")
    return data


def _strip(rec: dict) -> dict:
    return {k: v for k, v in rec.items() if not k.startswith("teacher_")}


def test_teacher_topk_equals_plain_forward(kd_data):
    from transformers import AutoModelForCausalLM

    target, _, recs = kd_data
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    for rec in recs:
        tokens, p0 = rec["tokens"].long(), rec["prompt_len"]
        ids, logp = rec["teacher_ids"], rec["teacher_logp"]
        r = tokens.numel() - p0
        assert ids.shape == (r, K) and ids.dtype == torch.int32 and logp.dtype == torch.float16
        with torch.no_grad():
            ref = torch.log_softmax(hf(tokens[None, :-1]).logits[0].float(), -1)[p0 - 1:]  # [R, V]: row r -> token p0+r
        torch.testing.assert_close(logp.float(), ref.gather(1, ids.long()), atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(logp.float(), ref.topk(K, -1).values, atol=2e-3, rtol=2e-3)
        if rec["temperature"] == 0.0:  # greedy: every response token is the teacher's top-1
            assert ids[:, 0].tolist() == tokens[p0:].tolist()


def test_block_batch_gathers_the_teacher_row_of_each_label():
    tokens = torch.arange(100, 112, dtype=torch.int32)  # S = 12, prompt 5, R = 7
    r = torch.arange(7)
    rec = {"tokens": tokens, "prompt_len": 5, "feats": torch.zeros(12, 6),
           "teacher_ids": torch.stack([105 + r, 200 + r], 1).int(),  # row r: [tokens[5 + r], marker]
           "teacher_logp": torch.stack([-0.1 - 0.01 * r, -3.0 - 0.01 * r], 1).half()}
    kw = dict(n_anchors=3, block_size=4, mask_token_id=7, gamma=2.0)
    plain = make_block_batch([rec], gen=torch.Generator().manual_seed(0), **kw)
    b = make_block_batch([rec, _strip(rec)], gen=torch.Generator().manual_seed(0), teacher=True, **kw)
    assert plain.teacher_ids is None and torch.equal(b.labels[0], plain.labels[0])  # same draws
    live = b.weights[0] > 0
    assert torch.equal(b.teacher_ids[0, live, 0], b.labels[0, live])
    assert torch.equal(b.teacher_ids[0, live, 1], b.labels[0, live] + 95)
    want = -0.1 - 0.01 * (b.labels[0, live] - 105).float()
    torch.testing.assert_close(b.teacher_logp[0, live, 0], want.half().float())
    assert bool(b.has_teacher[0, live].all()) and not bool(b.has_teacher[1].any())


def _hand_loss(h, head, y, w, t_ids, t_logp, has, alpha, keep=None) -> float:
    """Plain-Python reference: keep = allowed vocabulary ids (None: all)."""
    vocab = list(range(head.shape[0])) if keep is None else keep
    total = norm = 0.0
    for m in range(h.shape[0]):
        z = {v: float(h[m] @ head[v]) for v in vocab}
        lse = math.log(sum(math.exp(x) for x in z.values()))
        ce = lse - z[int(y[m])]
        pairs = [(int(i), float(lp)) for i, lp in zip(t_ids[m], t_logp[m], strict=True) if int(i) in z]
        if has[m] and pairs:
            s = sum(math.exp(lp) for _, lp in pairs)
            soft = sum(math.exp(lp) / s * (lse - z[i]) for i, lp in pairs)
            row = (1 - alpha) * ce + alpha * soft
        else:
            row = ce
        total, norm = total + float(w[m]) * row, norm + float(w[m])
    return total / norm


def test_kd_loss_equals_hand_computation():
    g = torch.Generator().manual_seed(0)
    h, head = torch.randn(1, 4, 3, generator=g), torch.randn(6, 3, generator=g)
    y = torch.tensor([[1, 3, 0, 4]])
    w = torch.tensor([[1.0, 0.5, 0.25, 0.0]])  # the last row carries no loss
    t_ids = torch.tensor([[[1, 2, 5], [3, 2, 0], [0, 5, 1], [4, 1, 2]]])
    t_logp = torch.tensor([[[-0.3, -1.7, -2.5], [-0.9, -1.0, -2.0], [-0.2, -2.2, -3.1], [-0.1, -2.0, -4.0]]])
    has = torch.tensor([[True, True, False, True]])
    for alpha in (0.5, 1.0):
        loss, st = dflash_loss(h, head, y, w, None, alpha, t_ids, t_logp, has)
        want = _hand_loss(h[0], head, y[0], w[0], t_ids[0], t_logp[0], has[0], alpha)
        assert math.isclose(float(loss), want, rel_tol=1e-5), (alpha, float(loss), want)
        assert "soft_ce" in st
    # corpus vocabulary without ids 2 and 5: row 0 keeps only id 1 (q = 1), row 1 renormalises over 3 and 0
    subset = torch.tensor([0, 1, 3, 4])
    loss, _ = dflash_loss(h, head, y, w, subset, 0.5, t_ids, t_logp, has)
    want = _hand_loss(h[0], head, y[0], w[0], t_ids[0], t_logp[0], has[0], 0.5, keep=[0, 1, 3, 4])
    assert math.isclose(float(loss), want, rel_tol=1e-5), (float(loss), want)
    # a row whose teacher ids all fall outside the vocabulary uses CE alone
    only_out = torch.tensor([[[2, 5, 5]] * 4])
    loss, _ = dflash_loss(h, head, y, w, subset, 0.5, only_out, t_logp, has)
    ce, _ = dflash_loss(h, head, y, w, subset)
    assert math.isclose(float(loss), float(ce), rel_tol=1e-6)


def test_alpha_zero_is_todays_loss_bit_for_bit():
    g = torch.Generator().manual_seed(3)
    h, head = torch.randn(2, 5, 8, generator=g), torch.randn(20, 8, generator=g)
    y, w = torch.randint(0, 20, (2, 5), generator=g), torch.rand(2, 5, generator=g) * (torch.rand(2, 5) > 0.3)
    t_ids, t_logp = torch.randint(0, 20, (2, 5, 4), generator=g), -torch.rand(2, 5, 4, generator=g)
    has = torch.ones(2, 5, dtype=torch.bool)
    rows = w.reshape(-1) > 0  # the pre-KD formula, written out
    logits = F.linear(h.reshape(-1, 8)[rows], head).float()
    ww = w.reshape(-1)[rows]
    ref = (F.cross_entropy(logits, y.reshape(-1)[rows], reduction="none") * ww).sum() / ww.sum().clamp_min(1e-6)
    loss, _ = dflash_loss(h, head, y, w, None, 0.0, t_ids, t_logp, has)
    assert torch.equal(loss, ref)
    kd, _ = dflash_loss(h, head, y, w, None, 0.5, t_ids, t_logp, has)
    assert not torch.allclose(kd, ref)  # the soft term does reach the loss when alpha > 0


def _cfg(data, target, out, **kw) -> TrainConfig:
    base = dict(data_dir=str(data), out_dir=str(out), target_path=target, num_layers=1, block_size=4,
                mask_token_id=62, steps=12, batch_size=4, anchors_per_seq=6, lr=3e-3, warmup=3, gamma=4.0,
                save_every=100, eval_budget=4, device="cpu", out_norm_scale=1.0, loss_vocab="corpus")
    return TrainConfig(**{**base, **kw})


def test_training_alpha0_unchanged_and_old_shards_train(kd_data, tmp_path):
    target, root, recs = kd_data
    with_t = _data_dir(root, "with_teacher", recs[3:], recs[:3])
    without = _data_dir(root, "without_teacher", [_strip(r) for r in recs[3:]], [_strip(r) for r in recs[:3]])
    a = train(_cfg(with_t, target, tmp_path / "a"))
    b = train(_cfg(without, target, tmp_path / "b"))
    assert a == {**b, "train_seconds": a["train_seconds"]}  # alpha 0: teacher keys change nothing
    sa = torch.load(tmp_path / "a" / "trainer_state.pt", weights_only=False)["model"]
    sb = torch.load(tmp_path / "b" / "trainer_state.pt", weights_only=False)["model"]
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    # alpha 0.5 on a mix of shards with and without teacher data trains, and the soft term changes the run
    mixed = _data_dir(root, "mixed", recs[3:7] + [_strip(r) for r in recs[7:]], recs[:3])
    for vocab in ("drop", "add"):
        kd = train(_cfg(mixed, target, tmp_path / f"kd_{vocab}", kd_weight=0.5, kd_corpus_vocab=vocab))
        assert kd["steps"] == 12 and kd["loss_ema"] < kd["loss_first"], kd
        assert kd["loss_first"] != a["loss_first"]
    with pytest.raises(ValueError, match="kd-weight"):
        train(_cfg(mixed, target, tmp_path / "bad", kd_weight=1.5))


def test_greedy_labels_take_the_teacher_top1_of_each_label():
    tokens = torch.arange(100, 112, dtype=torch.int32)  # S = 12, prompt 5, R = 7
    r = torch.arange(7)
    top1 = torch.where(r % 2 == 1, 300 + r, 105 + r)  # odd rows: the target preferred another token
    rec = {"tokens": tokens, "prompt_len": 5, "feats": torch.zeros(12, 6),
           "teacher_ids": torch.stack([top1, 200 + r], 1).int(), "teacher_logp": torch.full((7, 2), -0.7).half()}
    kw = dict(n_anchors=3, block_size=4, mask_token_id=7, gamma=2.0)
    plain = make_block_batch([rec, _strip(rec)], gen=torch.Generator().manual_seed(0), **kw)
    g = make_block_batch([rec, _strip(rec)], gen=torch.Generator().manual_seed(0), greedy_labels=True, **kw)
    assert g.teacher_ids is None and torch.equal(g.weights, plain.weights)  # same draws; no KD tensors
    live = g.weights[0] > 0
    row = plain.labels[0, live] - 105  # the teacher row of each live label
    assert torch.equal(g.labels[0, live], torch.where(row % 2 == 1, 300 + row, 105 + row))
    assert bool((g.labels[0, live] != plain.labels[0, live]).any())
    assert torch.equal(g.labels[1], plain.labels[1])  # a record without teacher data keeps its tokens
    both = make_block_batch([rec], gen=torch.Generator().manual_seed(0), teacher=True, greedy_labels=True, **kw)
    assert both.teacher_ids is not None and torch.equal(both.labels[0, live], g.labels[0, live])


def test_training_with_greedy_labels(kd_data, tmp_path):
    target, root, recs = kd_data
    greedy_only = _data_dir(root, "greedy_only", [r for r in recs[3:] if r["temperature"] == 0.0], recs[:3])
    a = train(_cfg(greedy_only, target, tmp_path / "a"))
    b = train(_cfg(greedy_only, target, tmp_path / "b", hard_labels="greedy"))
    assert a == {**b, "train_seconds": a["train_seconds"]}  # greedy responses: the labels are the tokens
    mixed = _data_dir(root, "mixed_t", recs[3:], recs[:3])  # T=1 responses: labels move to the top-1
    top1 = torch.cat([r["teacher_ids"][:, 0].long() for r in recs])
    assert bool(torch.isin(top1, corpus_vocab(recs, with_top1=True)).all())  # every greedy label is in the softmax
    tok = train(_cfg(mixed, target, tmp_path / "tok"))
    gl = train(_cfg(mixed, target, tmp_path / "gl", hard_labels="greedy"))
    assert gl["steps"] == 12 and gl["loss_ema"] < gl["loss_first"] and gl["loss_first"] != tok["loss_first"]
    with pytest.raises(ValueError, match="hard-labels"):
        train(_cfg(mixed, target, tmp_path / "bad", hard_labels="argmax"))
