"""GPU check (benchmarks/gpu_check.sh, its "fp8 KV cache" part): the fp8 MLA KV cache
(``--kv-cache-dtype fp8_e4m3``, ddtree_serve/kernels/kv_quant.py) on CUDA with the tiny Kimi INT4 checkpoint and the
Triton backends (tests/model_executor/test_fp8_kv.py checks the same path on CPU under the interpreter):
greedy tokens are identical eager and with CUDA graphs, plain and DDTree (scripted drafts around the plain
tokens: accepted depth >= 2 paths over the fp8 cache), and the cache really is float8."""

from __future__ import annotations

import pytest
import torch

from ddtree_serve.kernels.kv_quant import FP8_KV_DTYPE
from ddtree_serve.model_executor.sampling_params import SamplingParams
from ddtree_serve.server.engine import Engine
from tests.model_executor.tiny_deepseek import VOCAB, write_tiny_deepseek
from tests.speculative.drafter_utils import write_random_drafter
from tests.speculative.scripted_drafts import greedy_script, install

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = [[3, 17, 42, 99, 7], [11, 200, 300, 12], [5, 6, 7]]


def test_fp8_kv_greedy_eager_graphs_plain_ddtree_agree(tmp_path, backend_report):
    path = str(write_tiny_deepseek(tmp_path / "k", int4=True, kimi=True, moe_intermediate_size=64).path)
    drafter = write_random_drafter(path, tmp_path / "d", num_layers=1, block_size=4)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs: list[list[list[int]]] = []
    for graphs in (0, 4):
        for spec in ({}, dict(speculative_algorithm="ddtree", draft_model_path=drafter, ddtree_budget=8)):
            eng = Engine(path, device="cuda", dtype="float32", max_total_tokens=512, attention_backend="triton",
                         moe_backend="triton", kv_cache_dtype="fp8_e4m3", cuda_graph_max_bs=graphs, **spec)
            log = install(eng, greedy_script({tuple(p): t for p, t in zip(PROMPTS, outs[0], strict=True)},
                                             VOCAB)) if spec else None
            try:
                assert eng.scheduler.runner.kv.k[0].dtype == FP8_KV_DTYPE
                if graphs:  # warm-up captured every graph and froze the runner (ddtree_serve/server/warmup.py)
                    assert eng.scheduler.runner.graphs.frozen and eng.scheduler.runner.graphs.captures > 0
                outs.append([o.token_ids for o in eng.generate(input_ids=PROMPTS, sampling_params=sp)])
            finally:
                eng.shutdown()
            if log is not None:
                log.assert_accepted()
    assert all(o == outs[0] for o in outs), outs
    backend_report.append("fp8 KV (tiny Kimi, float32, Triton MLA/MoE): eager == CUDA graphs, plain == ddtree")
