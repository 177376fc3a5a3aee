"""Capacity planning from config.json alone (no weights): memory per TP rank for a DeepSeek-V3 / Kimi K2.x
target (or a Llama-family one), the KV cache it leaves, and the DDTree budget x batch that fits.

Model of the memory of one rank (GiB = 2^30 bytes; ``--gpu-memory-gb`` is read as GiB):
- weights as the CUDA path holds them: BF16 everywhere except modules the checkpoint's compressed-tensors
  ``quantization_config`` quantizes (Kimi: the routed experts), counted packed (int32 words) + BF16 group
  scales. TP sharding as our layers do it: vocab-parallel embedding/lm_head, heads split for q_b/kv_b/o,
  q_a/kv_a/norms replicated, dense and expert intermediate dims split; the MoE router is held in float32.
- KV pool and workspace: the server's own functions (model_executor/memory.py) with a device of
  ``gpu_memory`` GiB of which ``weights + drafter + overhead_gib`` (CUDA context, NCCL, graphs) are in use:
  the step workspace (``verify_workspace``: ``max_running_requests x (budget + 1)`` verify tokens plus the
  drafted rows unless ``verify_workspace_gb`` states it) is reserved, and the KV pool is
  ``mem_fraction x total - in use - workspace`` (``size_kv_pool``), at most ``(max_running_requests + 1) x
  context`` tokens, exactly as ``ddtree-serve serve`` sizes it on that device.
- KV per token: MLA caches only the latent, ``layers * (kv_lora_rank + qk_rope_head_dim)`` values, the
  same on every rank; otherwise ``2 * layers * kv_heads_per_rank * head_dim``. BF16 unless told;
  ``kv_cache_dtype="fp8_e4m3"`` (MLA): 1 byte per value plus 8 bytes of scales per layer (Kimi K2.6: 61 x 584
  = 35,624 B against 70,272 B in BF16), from the server's ``KVCacheLayout.bytes_per_token``. An
  optional drafter (z-lab DFlash config) is counted replicated on every rank, its KV per token included.
- budget table: a DDTree request at context ``C`` and budget ``B`` holds ``C + B + 1`` KV slots during
  verify; the workspace verifies ``max_verify_tokens // (B + 1)`` requests per step uncapped; batch = the
  smaller of the two bounds.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kernels.kv_quant import is_fp8, resolve_kv_cache_dtype
from model_executor.kv_cache import KVCacheLayout
from model_executor.memory import GIB, size_kv_pool, verify_workspace
from model_executor.quantization import Int4Config, packed_nbytes

__all__ = ["GIB", "BudgetRow", "Plan", "make_plan", "weight_bytes", "kv_bytes_per_token"]
BUDGETS = (8, 16, 32, 64, 128, 256, 512, 1024)


@dataclass(frozen=True)
class BudgetRow:
    budget: int  # non-root tree nodes per request
    max_batch: int  # requests per verify step at the planned context length
    kv_bound: int
    workspace_bound: int

    @property
    def verify_tokens(self) -> int:
        return self.max_batch * (self.budget + 1)


@dataclass(frozen=True)
class Plan:
    architecture: str
    tp_size: int
    gpu_memory_gib: float
    mem_fraction: float
    context_len: int
    weight_bytes_per_rank: int
    weight_breakdown: dict[str, int]  # per rank
    draft_bytes_per_rank: int
    kv_bytes_per_token: int  # per rank, target + drafter
    kv_tokens: int  # KV slots that fit per rank (0 if the weights do not fit)
    workspace_bytes: int  # the step workspace reserved before the KV pool
    max_verify_tokens: int  # tree nodes one verify step may hold (the speculative worker's cap)
    max_running_requests: int
    budget: int  # the configured DDTree budget the workspace is sized for
    rows: tuple[BudgetRow, ...] = field(default_factory=tuple)
    kv_cache_dtype: str = "bfloat16"  # the target cache's dtype (--kv-cache-dtype; auto = bfloat16 on CUDA)

    @property
    def best(self) -> BudgetRow | None:
        """The row with the most verify tokens (budget x batch); ties go to the larger budget."""
        ok = [r for r in self.rows if r.max_batch > 0]
        return max(ok, key=lambda r: (r.budget * r.max_batch, r.budget)) if ok else None

    def table(self) -> str:
        g = lambda b: f"{b / GIB:8.2f} GiB"  # noqa: E731
        lines = [f"{self.architecture} at TP {self.tp_size}, {self.gpu_memory_gib:g} GiB per GPU, "
                 f"mem_fraction {self.mem_fraction:g}, context {self.context_len}",
                 f"  weights per rank      {g(self.weight_bytes_per_rank)}"]
        lines += [f"    {k:<19} {g(v)}" for k, v in self.weight_breakdown.items()]
        if self.draft_bytes_per_rank:
            lines.append(f"  drafter per rank      {g(self.draft_bytes_per_rank)}")
        lines += [f"  KV bytes per token    {self.kv_bytes_per_token:>8} B ({self.kv_bytes_per_token / 1024:.1f} KiB, "
                  f"{self.kv_cache_dtype})",
                  f"  KV token capacity     {self.kv_tokens:>8}",
                  f"  verify workspace      {g(self.workspace_bytes)} (budget {self.budget} x "
                  f"{self.max_running_requests} requests)",
                  f"  max verify tokens     {self.max_verify_tokens:>8}",
                  "  budget  max_batch  (kv bound, workspace bound)  verify tokens"]
        lines += [f"  {r.budget:>6}  {r.max_batch:>9}  ({r.kv_bound:>8}, {r.workspace_bound:>8})  {r.verify_tokens:>13}"
                  for r in self.rows]
        b = self.best
        if b:
            lines.append(f"  largest budget x batch: {b.budget} x {b.max_batch}")
        elif self.kv_tokens:
            lines.append(f"  no request of {self.context_len} tokens fits: the KV pool holds {self.kv_tokens} tokens")
        else:
            lines.append("  does not fit: weights and workspace exceed the static memory pool")
        return "\n".join(lines)


def _load(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    return json.loads((p / "config.json" if p.is_dir() else p).read_text())


def _shard(n: int, tp: int) -> int:
    return -(-n // tp)


def weight_bytes(full: dict[str, Any], tp: int, dtype_bytes: int = 2, expert_parallel: bool = False) -> dict[str, int]:
    """Per-rank weight bytes by part for a HF config.json dict (wrapper or text config). Routed experts:
    every expert's ``1/tp`` slice (TP-MoE), or the largest rank's block of whole experts (``expert_parallel``)."""
    cfg = full.get("text_config") or full
    quant = Int4Config.from_hf(full.get("quantization_config") or cfg.get("quantization_config"))
    h, v, n_layers = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    b = dtype_bytes
    heads = cfg["num_attention_heads"]
    out = {"embed+lm_head": _shard(v, tp) * h * b * (1 if cfg.get("tie_word_embeddings") else 2) + h * b}
    if "kv_lora_rank" in cfg:
        ql, kl, rope = cfg.get("q_lora_rank"), cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
        qk, vd = cfg["qk_nope_head_dim"] + rope, cfg["v_head_dim"]
        hr = heads // tp
        attn = (h * ql + ql + ql * hr * qk if ql else h * hr * qk) + h * (kl + rope) + kl
        attn += kl * hr * (cfg["qk_nope_head_dim"] + vd) + hr * vd * h + 2 * h
    else:
        hd = cfg.get("head_dim") or h // heads
        kvh = max(1, cfg.get("num_key_value_heads", heads) // tp)
        attn = h * (heads // tp + 2 * kvh) * hd + heads // tp * hd * h + 2 * h
    out["attention+norms"] = attn * b * n_layers
    n_dense = min(n_layers, cfg.get("first_k_dense_replace", n_layers) if cfg.get("n_routed_experts") else n_layers)
    out["dense mlp"] = n_dense * 3 * h * _shard(cfg["intermediate_size"], tp) * b
    if cfg.get("n_routed_experts"):
        e, mi = cfg["n_routed_experts"], _shard(cfg["moe_intermediate_size"], tp)
        if expert_parallel:  # whole experts, balanced blocks: the first ranks hold one extra when uneven
            e, mi = _shard(e, tp), cfg["moe_intermediate_size"]
        n_moe = n_layers - n_dense
        expert_q = quant is not None and quant.is_quantized("model.layers.1.mlp.experts.0.gate_proj")
        if expert_q:
            gs = quant.group_size
            per_expert = 2 * packed_nbytes(mi, h, gs) + packed_nbytes(h, mi, gs)
        else:
            per_expert = 3 * h * mi * b
        out["routed experts"] = n_moe * e * per_expert
        out["shared experts"] = n_moe * 3 * h * _shard(cfg["moe_intermediate_size"] * cfg.get("n_shared_experts", 0),
                                                        tp) * b
        out["router (fp32)"] = n_moe * cfg["n_routed_experts"] * (h + 1) * 4
    return out


def kv_bytes_per_token(full: dict[str, Any], tp: int, kv_dtype_bytes: int = 2, kv_cache_dtype: str | None = None
                       ) -> int:
    """Target KV bytes per token on one rank. ``kv_cache_dtype`` (``--kv-cache-dtype``: auto = bfloat16 on
    CUDA, bfloat16, fp8_e4m3) sizes it with the server's own ``KVCacheLayout.bytes_per_token`` (fp8: 1 byte
    per value plus two float32 scales per layer); None: ``kv_dtype_bytes`` per value."""
    cfg = full.get("text_config") or full
    mla = "kv_lora_rank" in cfg
    if kv_cache_dtype is not None:
        dtype = resolve_kv_cache_dtype(kv_cache_dtype, torch.bfloat16)
        if is_fp8(dtype) and not mla:
            raise ValueError("--kv-cache-dtype fp8_e4m3 is wired for MLA models (DeepSeek-V3, Kimi K2.x) only")
    if mla:
        layout = KVCacheLayout(cfg["num_hidden_layers"], 1, cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"], 0)
    else:
        heads = cfg["num_attention_heads"]
        hd = cfg.get("head_dim") or cfg["hidden_size"] // heads
        kvh = max(1, cfg.get("num_key_value_heads", heads) // tp)
        layout = KVCacheLayout(cfg["num_hidden_layers"], kvh, hd, hd)
    if kv_cache_dtype is not None:
        return layout.bytes_per_token(dtype)
    return layout.num_layers * layout.kv_heads * (layout.k_dim + layout.v_dim) * kv_dtype_bytes


def _drafter(draft: dict[str, Any] | None) -> tuple[int, int]:
    """(weight bytes, KV bytes per context token) of a DFlash drafter, replicated; embed/lm_head are shared."""
    if not draft:
        return 0, 0
    h, n = draft["hidden_size"], draft["num_hidden_layers"]
    heads = draft["num_attention_heads"]
    hd = draft.get("head_dim") or h // heads
    kvh = draft.get("num_key_value_heads", heads)
    per_layer = h * (heads + 2 * kvh) * hd + heads * hd * h + 3 * h * draft["intermediate_size"] + 2 * h + 2 * hd
    n_ctx = len((draft.get("dflash_config") or {}).get("target_layer_ids") or [1])
    return 2 * (n * per_layer + n_ctx * h * h + 2 * h), 2 * n * kvh * hd * 2


def make_plan(model_path: str | Path, tp_size: int = 8, gpu_memory_gb: float = 96.0, mem_fraction: float = 0.88,
              context_len: int = 8192, overhead_gib: float = 2.0, kv_dtype_bytes: int = 2,
              kv_cache_dtype: str | None = None,
              draft_model_path: str | Path | None = None, budgets: tuple[int, ...] = BUDGETS,
              expert_parallel: bool = False, max_running_requests: int = 64, budget: int = 16,
              block_size: int | None = None, verify_workspace_gb: float | None = None) -> Plan:
    """Plan one TP rank of ``model_path`` (a directory with config.json, or the file itself).
    ``block_size``: the drafter block (default: the drafter config's, else 8). ``kv_cache_dtype``: auto |
    bfloat16 | fp8_e4m3 (``--kv-cache-dtype``; None: ``kv_dtype_bytes`` per value)."""
    if tp_size < 1 or not 0 < mem_fraction < 1 or gpu_memory_gb <= 0 or context_len < 1:
        raise ValueError("need tp_size >= 1, 0 < mem_fraction < 1, gpu_memory_gb > 0, context_len >= 1")
    full = _load(model_path)
    cfg = full.get("text_config") or full
    parts = weight_bytes(full, tp_size, expert_parallel=expert_parallel)
    weights = sum(parts.values())
    draft = _load(draft_model_path) if draft_model_path else None
    d_w, d_kv = _drafter(draft)
    block = block_size or int((draft or {}).get("block_size") or 8)
    kv_tok = kv_bytes_per_token(full, tp_size, kv_dtype_bytes, kv_cache_dtype) + d_kv
    total = int(gpu_memory_gb * GIB)
    used = weights + d_w + int(overhead_gib * GIB)
    ws = verify_workspace(cfg["vocab_size"], max_running_requests, budget, block, verify_workspace_gb)
    try:
        kv_tokens = size_kv_pool("cuda", kv_tok, ws.bytes, (max_running_requests + 1) * context_len,
                                 mem_fraction_static=mem_fraction, probe=lambda _dev: (total, used)).tokens
    except ValueError:  # the weights (or the workspace) leave no KV pool
        kv_tokens = 0
    rows = []
    for bgt in budgets:
        kv_b = kv_tokens // (context_len + bgt + 1)
        ws_b = ws.max_verify_tokens // (bgt + 1)
        rows.append(BudgetRow(bgt, min(kv_b, ws_b), kv_b, ws_b))
    return Plan(architecture=full["architectures"][0], tp_size=tp_size, gpu_memory_gib=gpu_memory_gb,
                mem_fraction=mem_fraction, context_len=context_len, weight_bytes_per_rank=weights,
                weight_breakdown=parts, draft_bytes_per_rank=d_w, kv_bytes_per_token=kv_tok, kv_tokens=kv_tokens,
                workspace_bytes=ws.bytes, max_verify_tokens=ws.max_verify_tokens,
                max_running_requests=max_running_requests, budget=budget, rows=tuple(rows),
                kv_cache_dtype="fp8_e4m3" if kv_cache_dtype == "fp8_e4m3" else "bfloat16")
