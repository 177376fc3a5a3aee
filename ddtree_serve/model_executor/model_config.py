"""Model configuration read from a Hugging Face directory (config.json + generation_config.json)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


def rope_parameters(cfg: dict[str, Any]) -> dict[str, Any]:
    """Merge both spellings: transformers 5 ``rope_parameters`` or legacy ``rope_scaling`` + ``rope_theta``."""
    params: dict[str, Any] = {}
    scaling = cfg.get("rope_scaling") or {}
    params.update(scaling)
    params.update(cfg.get("rope_parameters") or {})
    if "rope_theta" not in params:
        params["rope_theta"] = cfg.get("rope_theta", 10000.0)
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params["type"]
    params.setdefault("rope_type", "default")
    return params


@dataclass(frozen=True)
class ModelConfig:
    path: str
    hf: dict[str, Any]  # the language model's config (text_config for multimodal wrappers)
    architecture: str
    eos_token_ids: tuple[int, ...]
    dtype: torch.dtype
    int4_experts: str = "dequant"  # INT4 routed experts: "dequant" at load | "packed" (INT4-resident)
    attention_backend: str = "auto"  # resolved by kernel_backends.py: MLA torch | triton; MHA auto | torch | flashinfer
    moe_backend: str = "torch"  # routed experts' kernels: "torch" | "triton"
    kv_cache_dtype: torch.dtype | None = None  # the KV cache's dtype (--kv-cache-dtype); None = ``dtype``
    vision: bool = True  # load a vision tower the checkpoint has (False: --max-images-per-request 0, text only)
    deterministic_inference: bool = False  # batch-invariant kernels (ddtree_serve/kernels/batch_invariant.py)
    video: bool = False  # size the tower's activation reserve for video chunks too (--max-videos-per-request > 0)

    @property
    def kv_dtype(self) -> torch.dtype:
        """The target's KV cache dtype: ``dtype`` unless ``--kv-cache-dtype`` chose bfloat16 or fp8_e4m3."""
        return self.kv_cache_dtype or self.dtype

    @property
    def num_layers(self) -> int:
        return int(self.hf["num_hidden_layers"])

    @property
    def hidden_size(self) -> int:
        return int(self.hf["hidden_size"])

    @property
    def vocab_size(self) -> int:
        return int(self.hf["vocab_size"])

    @property
    def max_context_len(self) -> int:
        return int(self.hf.get("max_position_embeddings", 4096))

    @classmethod
    def load(cls, path: str, dtype: str = "auto", device: str = "cpu", int4_experts: str = "auto",
             attention_backend: str = "auto", moe_backend: str = "auto", kv_cache_dtype: str = "auto",
             vision: bool = True, deterministic_inference: bool = False, video: bool = False) -> ModelConfig:
        """``int4_experts``: "auto" keeps INT4 experts packed on CUDA (a dense copy would not fit) and
        dequantizes them at load on CPU (dense GEMMs are faster there). ``attention_backend`` /
        ``moe_backend``: see ddtree_serve/model_executor/kernel_backends.py. ``kv_cache_dtype``: auto | bfloat16 |
        fp8_e4m3 (ddtree_serve/kernels/kv_quant.py; fp8 is wired for MLA models only, a ValueError otherwise).
        ``deterministic_inference``: batch-invariant kernels on the forward path (``--enable-deterministic-inference``,
        ddtree_serve/kernels/batch_invariant.py); MHA and MLA models, on the torch attention and MoE backends."""
        if int4_experts not in ("auto", "packed", "dequant"):
            raise ValueError(f"int4_experts must be auto, packed or dequant, got {int4_experts!r}")
        if int4_experts == "auto":
            int4_experts = "packed" if str(device).startswith("cuda") else "dequant"
        p = Path(path)
        if not (p / "config.json").exists():
            raise ValueError(f"model_path {path!r} is not a model directory (no config.json)")
        full = json.loads((p / "config.json").read_text())
        archs = full.get("architectures") or []
        if not archs:
            raise ValueError(f"model_path {path!r}: config.json names no architectures")
        hf = dict(full.get("text_config") or full)
        hf.setdefault("architectures", archs)
        eos: list[int] = []
        gen_path = p / "generation_config.json"
        for src in ([json.loads(gen_path.read_text())] if gen_path.exists() else []) + [hf, full]:
            e = src.get("eos_token_id")
            if e is not None:
                eos.extend(e if isinstance(e, list) else [e])
                break
        from ddtree_serve.kernels.kv_quant import is_fp8, resolve_kv_cache_dtype
        from ddtree_serve.model_executor.kernel_backends import (
            invariant_attention_backend,
            invariant_moe_backend,
            is_mla,
            resolve_kernel_backends,
        )

        dt = resolve_dtype(dtype, device)
        kv_dt = resolve_kv_cache_dtype(kv_cache_dtype, dt)
        if is_fp8(kv_dt) and not is_mla(hf):
            raise ValueError(f"--kv-cache-dtype fp8_e4m3 is wired for MLA models (DeepSeek-V3, Kimi K2.x) only; "
                             f"{archs[0]} has an MHA cache: use auto or bfloat16")
        attention_backend, moe_backend = resolve_kernel_backends(hf, attention_backend, moe_backend, device, dt,
                                                                 kv_dtype=kv_dt)
        if deterministic_inference:
            attention_backend = invariant_attention_backend(hf, attention_backend)
            moe_backend = invariant_moe_backend(hf, moe_backend)
        return cls(path=str(p), hf=hf, architecture=archs[0], eos_token_ids=tuple(dict.fromkeys(eos)),
                   dtype=dt, int4_experts=int4_experts,
                   attention_backend=attention_backend, moe_backend=moe_backend,
                   kv_cache_dtype=kv_dt if kv_dt != dt else None, vision=vision,
                   deterministic_inference=deterministic_inference, video=video)


def cpu_has_native_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def resolve_dtype(dtype: str, device: str = "cpu") -> torch.dtype:
    if dtype == "float32":
        return torch.float32
    if dtype == "bfloat16":
        return torch.bfloat16
    if dtype == "float16":
        return torch.float16
    if dtype == "auto":
        if str(device).startswith("cuda") or cpu_has_native_bf16():
            return torch.bfloat16
        return torch.float32
    raise ValueError(f"dtype must be 'auto', 'float32', 'bfloat16' or 'float16', got {dtype!r}")
