"""The simulated device's logits exchange and row work (ddtree_serve/sim/machines.py) charge what the sampler does
under vocabulary-parallel TP: every row's (max, id) pair; once a row samples, every row's sharded draw (16,424
bytes in 13 collectives); logprob rows gathered whole; drafter rows their shard's top-64 (772 bytes in 3
collectives); each rank's row work on its V / tp columns. And the simulated target forward learns its sampled and
logprob rows from the batch's ``RowKinds``."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from ddtree_serve.model_executor.forward_batch import RowKinds
from ddtree_serve.model_executor.models.simulated import _kind_rows
from ddtree_serve.model_executor.sampling_params import SamplingParams
from ddtree_serve.sim.machines import MACHINES

PCIE = MACHINES["rtx-pro-6000"]
GATHERED = replace(PCIE, vocab_parallel=False)
ROW = 163840 * 4  # a float32 row of Kimi's vocabulary


def _bytes_s(m, n_bytes: float, collectives: int) -> float:  # noqa: ANN001
    return collectives * m.link_us * 1e-6 + (m.gpus - 1) / m.gpus * n_bytes / (m.link_gbps * 1e9)


def test_target_exchange_by_row_kind() -> None:
    n = 128 * 17
    assert PCIE.logits_bytes_per_row("seeded") == 16424 and PCIE.logits_bytes_per_row("draft") == 772
    greedy = PCIE.target_s(n, 0, n)
    assert PCIE.logits_exchange_s(n) == pytest.approx(_bytes_s(PCIE, n * 16, 1))
    # one sampled row: every row runs the sharded draw (draw_tokens on CUDA reads back no row selection)
    assert PCIE.target_s(n, 0, n, seeded_rows=1) - greedy == pytest.approx(_bytes_s(PCIE, n * 16424, 13))
    assert PCIE.target_s(n, 0, n, seeded_rows=n) == PCIE.target_s(n, 0, n, seeded_rows=1)
    assert PCIE.target_s(n, 0, n, logprob_rows=3) - greedy == pytest.approx(_bytes_s(PCIE, 3 * ROW, 1))
    # gathered logits: every row whole in one collective, whatever its kind
    assert GATHERED.logits_exchange_s(n, n, n) == GATHERED.logits_exchange_s(n) == pytest.approx(
        _bytes_s(GATHERED, n * ROW, 1))
    assert GATHERED.target_s(n, 0, n) - PCIE.target_s(n, 0, n, seeded_rows=1) > 0.02  # PCIe: 2 GB vs 36 MB


def test_row_work_is_the_shards() -> None:
    assert PCIE.row_s(1000) == pytest.approx(1000 * PCIE.logits_row_us * 1e-6 / 8)
    assert GATHERED.row_s(1000) == pytest.approx(1000 * PCIE.logits_row_us * 1e-6)


def test_drafter_rows_send_their_top_k() -> None:
    rows = 128 * 15
    extra = PCIE.draft_s(128 * 16, rows) - PCIE.draft_s(128 * 16, 0)
    assert extra == pytest.approx(_bytes_s(PCIE, rows * 772, 3) + PCIE.row_s(rows))
    extra_g = GATHERED.draft_s(128 * 16, rows) - GATHERED.draft_s(128 * 16, 0)
    assert extra_g == pytest.approx(_bytes_s(GATHERED, rows * ROW, 1) + GATHERED.row_s(rows))


def test_forward_rows_by_kind() -> None:
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, seed=1),
              SamplingParams(temperature=0.7, top_k=1, logprobs=2), SamplingParams(temperature=1.0, logprobs=0)]
    kinds = RowKinds.of(params)
    assert kinds.sampled == (False, True, False, True) and kinds.logprobs == (False, False, True, True)
    assert RowKinds.of(None) is None
    verify = SimpleNamespace(row_kinds=kinds, logits_indices=None, extend_lens=torch.tensor([5, 3, 2, 7]))
    assert _kind_rows(verify) == (3 + 7, 2 + 7)  # a request's rows: its tree's
    prefill = SimpleNamespace(row_kinds=kinds, logits_indices=torch.tensor([4, 7, 9, 16]),
                              extend_lens=torch.tensor([5, 3, 2, 7]))
    assert _kind_rows(prefill) == (2, 2)  # one selected row each
    assert _kind_rows(SimpleNamespace(row_kinds=None)) == (0, 0)
