"""Sharded loading: each TP rank's parameters equal the matching slices of the full tensors, and sharded
parameters are read through lazy slices (no rank reads a sharded tensor whole). No process group is needed:
building a model and loading weights run no collective. Expert parallelism: each rank holds its block of
whole experts and never reads another rank's expert tensors."""

from __future__ import annotations

import re

import pytest
import torch

from ddtree_serve.model_executor.layers.embedding import VocabParallelEmbedding
from ddtree_serve.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
from ddtree_serve.model_executor.layers.moe_experts import FusedExperts
from ddtree_serve.model_executor.model_config import ModelConfig
from ddtree_serve.model_executor.model_registry import get_model_class
from ddtree_serve.model_executor.parallel_state import TPGroup
from ddtree_serve.model_executor.weight_loader import SafetensorsSlice, iter_weights
from tests.model_executor.tiny_deepseek import write_tiny_deepseek


def _load(path: str, tp: TPGroup, lazy: bool) -> torch.nn.Module:
    cfg = ModelConfig.load(path, "float32", "cpu")
    model = get_model_class(cfg.architecture)(cfg, tp)
    model.load_weights(iter_weights(path, skip_prefixes=getattr(model, "skip_weight_prefixes", ()), lazy=lazy))
    return model


def _expected(module: torch.nn.Module, name: str, full: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """The slice of the TP=1 parameter ``full`` that rank ``tp.rank`` must hold."""
    if isinstance(module, ColumnParallelLinear):
        parts = torch.split(full, module.full_sizes, dim=0)
        return torch.cat([p.narrow(0, s, n) for p, s, n in zip(parts, module.part_starts, module.out_sizes,
                                                                strict=True)], dim=0)
    if isinstance(module, RowParallelLinear) and name == "weight":
        return full.narrow(1, module.in_start, module.in_local)
    if isinstance(module, VocabParallelEmbedding):
        out = torch.zeros(module.shard, full.shape[1])
        rows = full[module.start:module.end]
        out[: rows.shape[0]] = rows
        return out
    if isinstance(module, FusedExperts) and tp.expert_parallel:
        return full.narrow(0, module.expert_start, module.num_local)
    if isinstance(module, FusedExperts):
        r, n = tp.rank, module.inter
        if name == "w2":
            return full.narrow(-1, r * n, n)
        half = full.shape[1] // 2
        return torch.cat([full.narrow(1, r * n, n), full.narrow(1, half + r * n, n)], dim=1)
    return full


def _check(path: str, monkeypatch, expert_parallel: bool = False) -> None:
    ref = _load(path, TPGroup(), lazy=False)
    ref_params = dict(ref.named_parameters())
    whole_reads: list[str] = []
    sliced: list[str] = []
    orig_full, orig_narrow = SafetensorsSlice.full, SafetensorsSlice.narrow

    def spy(self):
        whole_reads.append(self.name)
        return orig_full(self)

    def spy_narrow(self, dim, start, length):
        sliced.append(self.name)
        return orig_narrow(self, dim, start, length)

    monkeypatch.setattr(SafetensorsSlice, "full", spy)
    monkeypatch.setattr(SafetensorsSlice, "narrow", spy_narrow)
    for rank in range(2):
        tp = TPGroup(rank, 2, expert_parallel=expert_parallel)
        sliced.clear()
        model = _load(path, tp, lazy=True)
        if expert_parallel:  # only this rank's experts were read
            start, count = tp.partition(ref.config.hf["n_routed_experts"])
            read = {int(m.group(1)) for n in sliced if (m := re.search(r"\.experts\.(\d+)\.", n))}
            assert read == set(range(start, start + count)), (rank, sorted(read))
        modules = dict(model.named_modules())
        sharded = set()
        for pname, p in model.named_parameters():
            mod_name, _, leaf = pname.rpartition(".")
            mod = modules[mod_name]
            exp = _expected(mod, leaf, ref_params[pname].data, tp)
            if exp.shape != ref_params[pname].shape:
                sharded.add(pname)
            torch.testing.assert_close(p.data, exp, rtol=0, atol=0, msg=f"rank {rank}: {pname}")
        assert sharded, "nothing was sharded"
    whole = [n for n in whole_reads if not n.endswith("weight_shape")]
    for n in whole:  # only replicated tensors (norms, router, latent projections, fc) are read whole
        assert not any(k in n for k in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                        "down_proj", "embed_tokens", "lm_head", "kv_b_proj", "q_b_proj",
                                        "weight_packed", "weight_scale")), f"read whole: {n}"


def test_tiny_kimi_int4_rank_slices(tmp_path, monkeypatch) -> None:
    ckpt = write_tiny_deepseek(tmp_path / "kimi", int4=True, kimi=True)
    _check(str(ckpt.path), monkeypatch)


def test_tiny_kimi_int4_expert_parallel_rank_slices(tmp_path, monkeypatch) -> None:
    ckpt = write_tiny_deepseek(tmp_path / "kimi", int4=True, kimi=True)
    _check(str(ckpt.path), monkeypatch, expert_parallel=True)


def test_default_model_rank_slices_uneven_heads(monkeypatch) -> None:
    """SmolLM2: 9 query heads over 3 KV heads split 6 + 3 at TP=2; tied embeddings."""
    from ddtree_serve.model_executor.default_model import ensure_default_model

    path = ensure_default_model()
    _check(path, monkeypatch)
    cfg = ModelConfig.load(path, "float32", "cpu")
    heads = [get_model_class(cfg.architecture)(cfg, TPGroup(r, 2)).layers[0].self_attn.local_heads for r in (0, 1)]
    assert heads == [6, 3]


def test_partition_is_balanced() -> None:
    assert [TPGroup(r, 4).partition(10) for r in range(4)] == [(0, 3), (3, 3), (6, 2), (8, 2)]
    with pytest.raises(ValueError):
        TPGroup(0, 4).partition(3)
