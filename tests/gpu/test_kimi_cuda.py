"""GPU check (run by benchmarks/gpu_check.sh on a lent GPU): the tiny Kimi INT4 checkpoint on CUDA with
INT4-resident experts (the CUDA default) against the CPU dequantize-at-load path, float32 on both devices
(greedy tokens of a random tiny model; GEMM kernels differ, so a near-tie could flip a token: the check
allows none), and greedy DDTree on CUDA equal to plain greedy on CUDA (lossless). float32 is deliberate:
flashinfer attention is 16-bit only, so the drafter's attention must select the torch reference here
(ddtree_serve/kernels/attention_select.py) instead of crashing in flashinfer."""

from __future__ import annotations

import pytest
import torch

from ddtree_serve.kernels.attention import TorchAttentionBackend
from ddtree_serve.model_executor.sampling_params import SamplingParams
from ddtree_serve.server.engine import Engine
from tests.model_executor.tiny_deepseek import VOCAB, write_tiny_deepseek
from tests.speculative.drafter_utils import write_random_drafter
from tests.speculative.scripted_drafts import greedy_script, install

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


PROMPTS = [[3, 17, 42, 99, 7], [11, 200, 300, 12]]


def _greedy(path: str, device: str, ref: list[list[int]] | None = None, **kw) -> list[list[int]]:
    """Greedy tokens; ``ref`` (plain greedy tokens): the scripted draft source drafts around them
    (tests/speculative/scripted_drafts.py) and the engine must accept depth >= 2 paths."""
    eng = Engine(path, device=device, dtype="float32", max_total_tokens=256, **kw)
    log = install(eng, greedy_script({tuple(p): t for p, t in zip(PROMPTS, ref, strict=True)}, VOCAB)) \
        if ref is not None else None
    try:
        sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        outs = eng.generate(input_ids=PROMPTS, sampling_params=sp)
        if log is not None:
            log.assert_accepted()
        assert kw.get("int4_experts") or eng.scheduler.model_config.int4_experts == (
            "packed" if device == "cuda" else "dequant"
        )
        if eng.scheduler.spec is not None:  # float32: the drafter's attention is the torch reference
            assert isinstance(eng.scheduler.spec.draft_backend, TorchAttentionBackend)
        return [o.token_ids for o in outs]
    finally:
        eng.shutdown()


def test_tiny_kimi_packed_int4_on_cuda_matches_cpu(tmp_path, backend_report):
    path = str(write_tiny_deepseek(tmp_path / "k", int4=True, kimi=True, moe_intermediate_size=64).path)
    drafter = write_random_drafter(path, tmp_path / "d", num_layers=1, block_size=4)
    ref = _greedy(path, "cpu")
    assert _greedy(path, "cuda") == ref
    assert (
        _greedy(path, "cuda", ref, speculative_algorithm="ddtree", draft_model_path=drafter, ddtree_budget=8)
        == ref
    )
    backend_report.append(
        "tiny Kimi float32: MLA + packed INT4 on CUDA == CPU; drafter attention: torch (float32)"
    )
