"""Our Llama-family models against transformers' own classes (fp32): logits of extend, decode and
tree-verify forwards."""

from __future__ import annotations

import pytest
import torch

from ddtree_serve.model_executor.forward_batch import ForwardMode, build_forward_batch
from ddtree_serve.model_executor.model_config import ModelConfig
from ddtree_serve.model_executor.model_runner import ModelRunner


def _runner(path: str) -> ModelRunner:
    cfg = ModelConfig.load(path, "float32")
    return ModelRunner(cfg, max_total_tokens=2048, max_reqs=4, max_context=512)


def _extend_logits(r: ModelRunner, ids: list[int], req: int = 0, prefix: int = 0) -> torch.Tensor:
    n = len(ids) - prefix
    slots = r.slots.place(torch.tensor([req]), torch.tensor([prefix]), torch.tensor([n]))
    fb = build_forward_batch(ForwardMode.EXTEND, torch.tensor(ids[prefix:]), torch.arange(prefix, len(ids)), slots,
                             r.slots.table, torch.tensor([req]), torch.tensor([prefix]), torch.tensor([n]))
    return r.logits(r.forward(fb).hidden)


def _hf_logits(path: str, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        return m(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_checkpoints_match_transformers(tiny_llama_factory, arch):
    path = tiny_llama_factory(arch)
    ids = torch.randint(0, 256, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = _hf_logits(path, ids)
    r = _runner(path)
    ours = _extend_logits(r, ids)
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4)


def test_chunked_extend_and_decode_match(tiny_llama_factory):
    path = tiny_llama_factory("llama")
    ids = torch.randint(0, 256, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    ref = _hf_logits(path, ids)
    r = _runner(path)
    a = _extend_logits(r, ids[:12])  # request 0: first chunk
    b = _extend_logits(r, ids[:25], prefix=12)  # second chunk over the cached prefix
    outs = [a, b]
    for p in range(25, 30):  # decode one token at a time
        outs.append(_extend_logits(r, ids[:p + 1], prefix=p))
    torch.testing.assert_close(torch.cat(outs), ref, atol=2e-4, rtol=1e-4)


def test_tree_verify_mask_matches_causal_paths(tiny_llama_factory):
    """A tree of two branches: each node's logits equal a causal forward of its root-to-node path."""
    path = tiny_llama_factory("qwen3")
    r = _runner(path)
    prompt = [5, 9, 33, 70, 2]
    _extend_logits(r, prompt)
    # tree nodes: 0 root(tok 11) ; 1 (tok 12, parent 0) ; 2 (tok 13, parent 0) ; 3 (tok 14, parent 1)
    toks, parents, depth = [11, 12, 13, 14], [-1, 0, 0, 1], [0, 1, 1, 2]
    mask = torch.zeros(1, 4, 4, dtype=torch.bool)
    for i in range(4):
        j = i
        while j >= 0:
            mask[0, i, j] = True
            j = parents[j]
    slots = r.slots.place(torch.tensor([0]), torch.tensor([5]), torch.tensor([4]))
    fb = build_forward_batch(ForwardMode.TARGET_VERIFY, torch.tensor(toks), torch.tensor([5 + d for d in depth]),
                             slots, r.slots.table, torch.tensor([0]), torch.tensor([5]), torch.tensor([4]),
                             tree_mask=mask)
    tree_logits = r.logits(r.forward(fb).hidden)
    for node, seq in [(0, [11]), (1, [11, 12]), (2, [11, 13]), (3, [11, 12, 14])]:
        ref = _hf_logits(path, prompt + seq)[-1]
        torch.testing.assert_close(tree_logits[node], ref, atol=2e-4, rtol=1e-4)


def test_default_model_matches_transformers(default_model_path):
    ids = [1, 504, 3458, 282, 4649, 314, 216, 30, 23, 30, 9175, 28, 253, 1789, 2]
    ref = _hf_logits(default_model_path, ids)
    ours = _extend_logits(_runner(default_model_path), ids)
    torch.testing.assert_close(ours, ref, atol=1e-3, rtol=1e-3)
