"""A DFlash drafter whose KV heads do not split over the TP ranks runs unsharded (models/dflash.py
``drafter_group``): at K2.6's TP=8 a drafter with fewer than 8 KV heads would not even construct sharded.
(The TP=2 run of such a drafter, 1 KV head over 2 gloo ranks, is in tests/parallel/test_tp_faults.py.)"""

from __future__ import annotations

import pytest

from ddtree_serve.model_executor.model_config import ModelConfig
from ddtree_serve.model_executor.models.dflash import DFlashDraftModel, drafter_group
from ddtree_serve.model_executor.parallel_state import TPGroup
from tests.speculative.drafter_utils import write_random_drafter


@pytest.mark.parametrize("kv_heads,tp_size,sharded", [(1, 8, False), (4, 8, False), (8, 8, True), (2, 2, True),
                                                      (1, 2, False), (1, 1, True)])
def test_drafter_group(kv_heads, tp_size, sharded) -> None:
    tp = TPGroup(rank=tp_size - 1, size=tp_size)
    group = drafter_group({"num_attention_heads": 32, "num_key_value_heads": kv_heads}, tp)
    assert (group is tp) == sharded and (sharded or group.size == 1)


def test_drafter_with_fewer_kv_heads_than_ranks_loads_at_tp8(tiny_llama_factory, tmp_path) -> None:
    target = tiny_llama_factory("llama")
    path = write_random_drafter(target, tmp_path / "d", num_layers=1, block_size=4, num_key_value_heads=1)
    cfg = ModelConfig.load(path, "float32")
    tp8 = TPGroup(rank=7, size=8)
    with pytest.raises(ValueError, match="smaller than tp_size"):  # sharded, it cannot be built
        DFlashDraftModel(cfg, tp8)
    model = DFlashDraftModel(cfg, drafter_group(cfg.hf, tp8))  # every rank: the whole drafter
    layout = model.kv_cache_layout()
    assert layout.kv_heads == 1 and model.layers[0].self_attn.local_heads == 4


def test_drafter_warm_up_skips_decode() -> None:
    """The drafter's warm-up (spec_worker: ``kinds=("tree",)``) runs the custom-mask prefill alone: a group
    size of 32 query heads per KV head (an unsharded drafter) never reaches flashinfer's decode kernel."""
    import torch

    from ddtree_serve.kernels.attention_flashinfer import FlashInferAttentionBackend
    from tests.kernels.flashinfer_standin import make_flashinfer_standin

    backend = FlashInferAttentionBackend("cpu", flashinfer=make_flashinfer_standin())
    assert backend.warmup(32, 1, 16, 16, torch.float32, "cpu", ("tree",)) == ["tree:masked_prefill"]
