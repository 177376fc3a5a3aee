"""flashinfer attention glue (ddtree_serve/kernels/attention_flashinfer.py) against a recording stand-in for flashinfer:
metadata built the way the scheduler, spec worker and datagen build it (under torch.inference_mode(),
whose tensors have no version counter), the kernel and plan arguments chosen per forward mode, one plan
per forward, and outputs equal to the torch reference backend."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ddtree_serve.kernels.attention import TorchAttentionBackend
from ddtree_serve.kernels.attention_flashinfer import FlashInferAttentionBackend, plan_arguments
from ddtree_serve.model_executor.forward_batch import ForwardMode, build_forward_batch
from tests.kernels.flashinfer_standin import make_flashinfer_standin

HQ, HKV, D = 4, 2, 16


def _batch(mode: ForwardMode, prefix: list[int], extend: list[int], d: int = D):
    """A forward over len(prefix) requests (head dim ``d``), built in inference mode like the engine does."""
    g = torch.Generator().manual_seed(sum(prefix) * 7 + sum(extend))
    with torch.inference_mode():
        bs = len(prefix)
        table = torch.zeros(bs, 32, dtype=torch.int64)
        slots = torch.randperm(60, generator=g)[: sum(p + e for p, e in zip(prefix, extend, strict=True))] + 1
        out_loc, used = [], 0
        for b, (p, e) in enumerate(zip(prefix, extend, strict=True)):
            table[b, : p + e] = slots[used : used + p + e]
            out_loc.append(slots[used + p : used + p + e])
            used += p + e
        tree = None
        if mode == ForwardMode.TARGET_VERIFY:  # node i sees itself and node 0 (a star-shaped tree)
            q = max(extend)
            tree = torch.eye(q, dtype=torch.bool).expand(bs, q, q).clone()
            tree[:, :, 0] = True
        t = sum(extend)
        fb = build_forward_batch(
            mode,
            torch.zeros(t, dtype=torch.int64),
            torch.zeros(t, dtype=torch.int64),
            torch.cat(out_loc),
            table,
            torch.arange(bs),
            torch.tensor(prefix),
            torch.tensor(extend),
            tree_mask=tree,
        )
        k_cache = torch.randn(64, HKV, d, generator=g)
        v_cache = torch.randn(64, HKV, d, generator=g)
        qkv = [torch.randn(t, h, d, generator=g) for h in (HQ, HKV, HKV)]
    return fb, k_cache, v_cache, qkv


def _run(backend, fb, k_cache, v_cache, qkv, layers: int = 2) -> list[torch.Tensor]:
    outs = []
    with torch.inference_mode():
        backend.begin_forward(fb.attention_meta())
        for _ in range(layers):
            outs.append(
                backend.forward(
                    *qkv, k_cache, v_cache, fb.out_cache_loc, fb.kv_indices, fb.attn_mask, fb.q_index, D**-0.5
                )
            )
    return outs


CASES = [
    (ForwardMode.EXTEND, [3, 0, 5], [4, 2, 1], "prefill", True),
    (ForwardMode.DECODE, [3, 6], [1, 1], "decode", True),
    (ForwardMode.TARGET_VERIFY, [2, 5], [3, 4], "masked_prefill", False),
]


@pytest.mark.parametrize("mode,prefix,extend,kernel,causal", CASES, ids=[c[0].value for c in CASES])
def test_kernel_choice_plan_and_output(mode, prefix, extend, kernel, causal):
    fb, k_cache, v_cache, qkv = _batch(mode, prefix, extend)
    assert fb.kv_indices.is_inference() and fb.attn_mask.is_inference()  # what the engine passes
    fi = make_flashinfer_standin()
    backend = FlashInferAttentionBackend("cpu", flashinfer=fi)
    got = _run(backend, fb, k_cache.clone(), v_cache.clone(), qkv)
    ref = _run(TorchAttentionBackend(), fb, k_cache.clone(), v_cache.clone(), qkv, layers=1)[0]
    for out in got:
        assert torch.allclose(out, ref, atol=1e-5)
    wrappers = {"decode": backend._decode, "prefill": backend._prefill, "masked_prefill": backend._masked_prefill}
    used = wrappers.pop(kernel)
    assert [c[0] for c in used.calls] == ["plan", "run", "run"]  # one plan serves both layers
    assert all(w.calls == [] for w in wrappers.values())
    _, args, kw = used.calls[0]
    lens = [p + e for p, e in zip(prefix, extend, strict=True)]
    kv_indptr = args[0] if kernel == "decode" else args[1]
    assert kv_indptr.tolist() == [sum(lens[:i]) for i in range(len(lens) + 1)]
    if kernel != "decode":
        assert args[0].tolist() == [sum(extend[:i]) for i in range(len(extend) + 1)]  # qo_indptr
        assert kw.get("causal", False) == causal
        assert (kw.get("custom_mask") is None) == causal  # the O(Q x K) mask only for tree verification
        if not causal:
            assert kw["custom_mask"].numel() == sum(e * n for e, n in zip(extend, lens, strict=True))


def test_each_forward_replans_and_foreign_metadata_is_refused():
    fi = make_flashinfer_standin()
    backend = FlashInferAttentionBackend("cpu", flashinfer=fi)
    fb1, kc, vc, qkv1 = _batch(ForwardMode.EXTEND, [2, 1], [3, 2])
    _run(backend, fb1, kc, vc, qkv1)
    fb2, _, _, qkv2 = _batch(ForwardMode.EXTEND, [2, 1], [3, 2])  # same shapes, new forward
    _run(backend, fb2, kc, vc, qkv2)
    assert [c[0] for c in backend._prefill.calls].count("plan") == 2
    with pytest.raises(RuntimeError, match="begin_forward"), torch.inference_mode():
        backend.forward(*qkv1, kc, vc, fb1.out_cache_loc, fb1.kv_indices, fb1.attn_mask, fb1.q_index, 0.25)


def test_warmup_runs_every_kernel_once():
    fi = make_flashinfer_standin()
    backend = FlashInferAttentionBackend("cpu", flashinfer=fi)
    assert backend.warmup(HQ, HKV, D, D, torch.float32, "cpu") == [
        "decode:decode",
        "extend:prefill",
        "tree:masked_prefill",
    ]
    causal = [kw for name, _, kw in backend._prefill.calls if name == "plan"]
    masked = [kw for name, _, kw in backend._masked_prefill.calls if name == "plan"]
    assert [kw.get("causal", False) for kw in causal] == [True] and "custom_mask" not in causal[0]
    assert len(masked) == 1 and masked[0]["custom_mask"] is not None and "causal" not in masked[0]


@pytest.mark.parametrize("sm", [90, 100, 120])
def test_hopper_warm_up_keeps_custom_masks_off_fa3(sm):
    """issue 33 item 1: flashinfer fixes a prefill wrapper's "auto" backend at its first plan; the warm-up's
    causal extend comes first and, on sm90 with FA3 head dims (64 here), fixes FA3, which refuses the tree's
    custom mask. Causal and masked plans use separate wrappers, the masked one pinned to FA2; then a second
    round, as serving interleaves them."""
    backend = FlashInferAttentionBackend("cpu", flashinfer=make_flashinfer_standin(sm=sm))
    for _ in range(2):
        assert backend.warmup(HQ, HKV, 64, 64, torch.float32, "cpu")[2] == "tree:masked_prefill"
    assert backend._prefill.backend == ("fa3" if sm == 90 else "fa2")
    assert backend._masked_prefill.backend == "fa2"
    fb, k_cache, v_cache, qkv = _batch(ForwardMode.TARGET_VERIFY, [2, 5], [3, 4], d=64)
    got = _run(backend, fb, k_cache.clone(), v_cache.clone(), qkv, layers=1)[0]
    ref = _run(TorchAttentionBackend(), fb, k_cache.clone(), v_cache.clone(), qkv, layers=1)[0]
    assert torch.allclose(got, ref, atol=1e-5)


def test_standin_refuses_a_custom_mask_on_a_wrapper_fixed_to_fa3():
    """The stand-in reproduces the library's failure that one shared wrapper met on Hopper."""
    fi = make_flashinfer_standin(sm=90)
    wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(torch.empty(8, dtype=torch.uint8), kv_layout="NHD")
    fb, k_cache, v_cache, (q, _, _) = _batch(ForwardMode.TARGET_VERIFY, [2, 5], [3, 4], d=64)
    for mode in ("extend", "tree"):
        meta = fb.attention_meta()
        if mode == "extend":
            meta = dataclasses.replace(meta, causal=True)
        _, args, kw = plan_arguments(meta, HQ, HKV, 64, 64, torch.float32, 0.125)
        wrapper.plan(*args, **kw)
    assert wrapper.backend == "fa3"
    with pytest.raises(RuntimeError, match="operation not supported"):
        wrapper.run(q, (k_cache.unsqueeze(1), v_cache.unsqueeze(1)))
