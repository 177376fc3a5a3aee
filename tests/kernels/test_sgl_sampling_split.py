"""sgl-kernel's sampled tree verification addresses probabilities with 32-bit row offsets, so
ddtree_serve/kernels/speculative.py splits each call over requests (rows x D x V <= 2^31). Tested against a recording
stand-in for the kernel that checks every chunk's limits and views, and computes like the kernel (global
``retrive_index`` rows written as given) with the torch reference; the reassembled outputs must equal
one unsplit reference call."""

from __future__ import annotations

import random

import pytest
import torch

from ddtree_serve.kernels.speculative import (
    SGL_SAMPLING_MAX_ELEMENTS,
    _call_sgl_sampling,
    sgl_sampling_chunks,
    tree_speculative_sampling_target_only,
)
from tests.kernels.tree_helpers import outputs, pack_trees, random_tree


def test_chunks_cover_the_batch_within_the_limit():
    bs, d, vocab = 128, 256, 163_840  # Kimi K2.6 at budget 255 and 128 requests
    assert bs * d * vocab > 2**32  # one call would wrap the kernel's uint32 offset
    chunks = sgl_sampling_chunks(bs, d, vocab)
    assert chunks[0][0] == 0 and chunks[-1][1] == bs
    assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:], strict=False))
    assert all((hi - lo) * d * vocab <= SGL_SAMPLING_MAX_ELEMENTS for lo, hi in chunks)
    assert len(chunks) == 3
    assert sgl_sampling_chunks(16, 12, 1000) == [(0, 16)]  # small batches stay one call
    with pytest.raises(ValueError, match="exceeds"):
        sgl_sampling_chunks(1, 2**16, 2**16)


class RecordingKernel:
    """Stand-in for sgl_kernel.tree_speculative_sampling_target_only (keyword call, in place)."""

    def __init__(self, max_elements: int) -> None:
        self.max_elements = max_elements
        self.calls: list[tuple[int, int]] = []

    def __call__(
        self,
        predicts,
        accept_index,
        accept_token_num,
        candidates,
        retrive_index,
        retrive_next_token,
        retrive_next_sibling,
        uniform_samples,
        uniform_samples_for_final_sampling,
        target_probs,
        draft_probs,
        threshold_single,
        threshold_acc,
        deterministic,
    ):
        n, d, vocab = target_probs.shape
        assert n * d * vocab <= self.max_elements
        for t in (accept_index, candidates, retrive_index, target_probs, draft_probs, uniform_samples):
            assert t.is_contiguous() and t.shape[0] == n
        lo = int(retrive_index[0, 0]) // d  # this chunk's first request in the whole batch
        self.calls.append((lo, lo + n))
        assert predicts.shape[0] >= (lo + n) * d  # the whole predicts: rows are global
        tree_speculative_sampling_target_only(
            predicts[lo * d : (lo + n) * d],
            accept_index,
            accept_token_num,
            candidates,
            retrive_index - lo * d,
            retrive_next_token,
            retrive_next_sibling,
            uniform_samples,
            uniform_samples_for_final_sampling,
            target_probs,
            draft_probs,
            threshold_single,
            threshold_acc,
            deterministic,
        )
        accept_index.copy_(torch.where(accept_index >= 0, accept_index + lo * d, accept_index))


def test_split_calls_reassemble_the_unsplit_result():
    bs, d, vocab = 7, 6, 50
    rng = random.Random(3)
    tree = pack_trees([random_tree(rng, rng.randint(1, d), 8) for _ in range(bs)], d)
    s = int(tree["depth"].max()) + 1
    g = torch.Generator().manual_seed(3)
    target = (torch.randn(bs, d, vocab, generator=g) * 2).softmax(-1)
    coins, final = torch.rand(bs, d, generator=g), torch.rand(bs, generator=g)
    args = {k: v for k, v in tree.items() if k != "depth"}

    def kwargs(out):
        return dict(
            **out,
            **args,
            uniform_samples=coins,
            uniform_samples_for_final_sampling=final,
            target_probs=target,
            draft_probs=torch.zeros_like(target),
            threshold_single=1.0,
            threshold_acc=1.0,
            deterministic=True,
        )

    ref = kwargs(outputs(bs, d, s))
    tree_speculative_sampling_target_only(**ref)
    got = kwargs(outputs(bs, d, s))
    kernel = RecordingKernel(max_elements=2 * d * vocab + 5)
    _call_sgl_sampling(got, kernel=kernel, max_elements=kernel.max_elements)
    assert kernel.calls == [(0, 2), (2, 4), (4, 6), (6, 7)]
    for name in ("predicts", "accept_index", "accept_token_num", "draft_probs"):
        assert torch.equal(got[name], ref[name]), name
