"""The engine with flashinfer attention (through the recording stand-in, on CPU): plain decoding and DDTree
run their real forwards (built in inference mode: the issue-20 crash was at the first drafter forward)
through FlashInferAttentionBackend, plan causal kernels for extend/decode and the custom mask for tree
verification and drafter blocks only, and emit the same greedy tokens as the torch backend."""

from __future__ import annotations

import types

import torch

from ddtree_serve.kernels.attention_flashinfer import FlashInferAttentionBackend
from ddtree_serve.model_executor.model_runner import warm_up_attention
from ddtree_serve.model_executor.sampling_params import SamplingParams
from ddtree_serve.server.engine import Engine
from tests.kernels.flashinfer_standin import make_flashinfer_standin
from tests.speculative.drafter_utils import write_random_drafter
from tests.speculative.scripted_drafts import greedy_script, install

PROMPTS = [[3, 17, 42, 99, 7, 8], [11, 200, 31, 12]]


def _generate(path: str, standin: bool, refs: list[list[int]] | None = None, **kw
              ) -> tuple[list[list[int]], list[FlashInferAttentionBackend]]:
    """Greedy tokens of PROMPTS; ``refs`` (plain greedy tokens): the scripted draft source drafts around them
    (tests/speculative/scripted_drafts.py) and the engine must accept depth >= 2 paths."""
    eng = Engine(path, device="cpu", dtype="float32", max_total_tokens=512, **kw)
    backends = []
    log = None
    if refs is not None:
        vocab = eng.scheduler.runner.config.vocab_size
        log = install(eng, greedy_script({tuple(p): t for p, t in zip(PROMPTS, refs, strict=True)}, vocab))
    try:
        if standin:
            eng.scheduler.runner.backend = FlashInferAttentionBackend(
                "cpu", flashinfer=make_flashinfer_standin()
            )
            backends.append(eng.scheduler.runner.backend)
            if eng.scheduler.spec is not None:
                eng.scheduler.spec.draft_backend = FlashInferAttentionBackend(
                    "cpu", make_flashinfer_standin()
                )
                backends.append(eng.scheduler.spec.draft_backend)
        sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
        got = [o.token_ids for o in eng.generate(input_ids=PROMPTS, sampling_params=sp)]
        if log is not None:
            log.assert_accepted()
        return got, backends
    finally:
        eng.shutdown()


def _plans(backend: FlashInferAttentionBackend) -> list[str]:
    kinds = []
    for wrapper in (backend._prefill, backend._masked_prefill, backend._decode):
        for name, _, kw in wrapper.calls:
            if name == "plan":
                kind = (
                    wrapper.kind if wrapper.kind == "decode" else ("causal" if kw.get("causal") else "mask")
                )
                kinds.append(kind)
    return kinds


def test_plain_decoding_uses_causal_and_decode_kernels(tiny_llama_factory):
    path = tiny_llama_factory("llama")
    ref, _ = _generate(path, standin=False)
    got, (target,) = _generate(path, standin=True)
    assert got == ref
    assert set(_plans(target)) == {"causal", "decode"}  # no custom mask without a tree


def test_ddtree_uses_the_custom_mask_only_for_trees_and_blocks(tiny_llama_factory, tmp_path):
    path = tiny_llama_factory("llama")
    drafter = write_random_drafter(path, tmp_path / "d", num_layers=1, block_size=4)
    spec = dict(speculative_algorithm="ddtree", draft_model_path=drafter, ddtree_budget=8)
    ref, _ = _generate(path, standin=False)
    got, (target, draft) = _generate(path, standin=True, refs=ref, **spec)
    assert got == ref
    # prefill causal, tree verification masked; a step whose trees are all root-only (a request's last
    # token) is a plain decode step on the decode kernel
    assert {"causal", "mask"} <= set(_plans(target)) <= {"causal", "mask", "decode"}
    assert set(_plans(draft)) == {"mask"}  # drafter blocks see the context and themselves


def test_warm_up_runs_each_kernel_of_the_model_shape():
    backend = FlashInferAttentionBackend("cpu", flashinfer=make_flashinfer_standin())
    model = types.SimpleNamespace(
        layers=[types.SimpleNamespace(self_attn=types.SimpleNamespace(local_heads=4))]
    )
    layout = types.SimpleNamespace(kv_heads=2, k_dim=16, v_dim=16)
    warm_up_attention(backend, layout, model, torch.float32, torch.device("cpu"))
    assert _plans(backend) == ["causal", "mask", "decode"]
    assert backend._prefill.calls[0][1][4:7] == (4, 2, 16)  # Hq, Hkv, head dim of the model
