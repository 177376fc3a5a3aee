"""Resolve ``attention_backend`` / ``moe_backend`` (CLI ``--attention-backend`` / ``--moe-backend``) for one
model on one device, once, at ``ModelConfig.load``.

What is wired (anything else is a ValueError naming the alternatives):

=================  ===============================================  ==========================================
model              attention_backend                                moe_backend
=================  ===============================================  ==========================================
MLA (DeepSeek-V3,  ``torch`` (reference) | ``triton``                ``torch`` (reference) | ``triton``
Kimi K2.x)         (ddtree_serve/kernels/triton_mla.py); auto: triton on CUDA    (ddtree_serve/kernels/triton_moe.py, dense or INT4);
                                                                    auto: triton on CUDA
MHA (Llama, Qwen)  ``torch`` | ``flashinfer`` | auto (flashinfer     ``torch`` / auto only (no routed experts)
                   on CUDA when it imports: ddtree_serve/kernels/attention_select)
=================  ===============================================  ==========================================

``--enable-deterministic-inference`` (``invariant_attention_backend``, ``invariant_moe_backend``): MHA attention
resolves to torch (its batch-invariant path); MLA attention and the routed experts keep torch or triton, each
running its batch-invariant variant (docs/DESIGN.md 4.18); flashinfer is refused.

``auto`` takes the reference when ``DDTREE_KERNELS=torch`` or Triton does not import. Triton on a CPU
device runs only in Triton's interpreter (``TRITON_INTERPRET=1``, how tests check the kernels); asking for it
on CPU without the interpreter is an error. MLA on a CUDA device: the Triton kernel must fit the device's
shared memory at the model's latent width and dtype with its smallest tiles (ddtree_serve/kernels/triton_mla_plan.py;
it shrinks its tiles to fit, e.g. float32 on sm120, and logs that); if even those do not fit, ``auto``
takes the reference with a log line and ``triton`` is a startup error.

An fp8 KV cache (``--kv-cache-dtype fp8_e4m3``, ddtree_serve/kernels/kv_quant.py) is read by both MLA backends (the Triton
kernels dequantize each key tile); on CUDA the Triton kernels need fp8 conversions in hardware (compute
capability 8.9 or newer): below that ``auto`` takes the reference with a log line and ``triton`` is a
startup error. MHA models reject fp8 at ``ModelConfig.load`` (no backend of theirs reads it).
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Any

import torch

from ddtree_serve.kernels.dispatch import kernels_forced_to_torch
from ddtree_serve.kernels.kv_quant import is_fp8
from ddtree_serve.kernels.triton_mla_plan import device_arch, device_smem_limit, smallest_tiles_fit
from ddtree_serve.kernels.triton_utils import interpreting

logger = logging.getLogger(__name__)

BACKEND_CHOICES = ("auto", "torch", "triton", "flashinfer")


def is_mla(hf: dict[str, Any]) -> bool:
    return bool(hf.get("kv_lora_rank"))


def has_routed_experts(hf: dict[str, Any]) -> bool:
    return bool(hf.get("n_routed_experts"))


def _triton_usable(cuda: bool) -> bool:
    return importlib.util.find_spec("triton") is not None and (cuda or interpreting())


FP8_MIN_ARCH = 89  # Triton converts float8e4nv in hardware from sm89 (Ada) on


def _mla_unfit(hf: dict[str, Any], dtype: torch.dtype | None, device: str, smem_limit: int | None,
               kv_dtype: torch.dtype | None = None, arch: int | None = None) -> str:
    """Why the Triton MLA kernel cannot run this model on ``device`` ("" when it can or nothing is known).
    ``kv_dtype``: the cache's dtype when it differs from ``dtype`` (fp8); ``arch``: major * 10 + minor
    (default: probed on CUDA)."""
    dev = torch.device(device)
    if smem_limit is None and torch.cuda.is_available():
        smem_limit = device_smem_limit(dev.type, dev.index)
    if kv_dtype is not None and is_fp8(kv_dtype):
        if arch is None and torch.cuda.is_available():
            arch = device_arch(dev.type, dev.index)
        if arch is not None and arch < FP8_MIN_ARCH:
            return f"the Triton MLA kernel reads an fp8 KV cache on compute capability >= 8.9 only (this GPU: sm{arch})"
    if smem_limit is None or dtype is None:
        return ""
    lat, rope = int(hf["kv_lora_rank"]), int(hf.get("qk_rope_head_dim", 64))
    if smallest_tiles_fit(lat, rope, dtype, smem_limit, kv_dtype):
        return ""
    return (
        f"the Triton MLA kernel's smallest tiles (16 heads x 16 keys of latent {lat} + rope {rope} in {dtype}, "
        f"cache {kv_dtype or dtype}) need more than this GPU's {smem_limit} B of shared memory"
    )


def invariant_attention_backend(hf: dict[str, Any], attention: str) -> str:
    """The attention backend under ``--enable-deterministic-inference`` given the resolved one: MHA models run
    the batch-invariant attention (ddtree_serve/kernels/attention_invariant.py, standing in for the torch
    reference: "torch"; flashinfer chosen explicitly is a ValueError); MLA models keep theirs, "torch" running
    ddtree_serve/kernels/mla_invariant.py and "triton" the Triton kernels' invariant mode
    (ddtree_serve/kernels/triton_mla_invariant.py)."""
    if is_mla(hf):
        return attention
    if attention == "flashinfer":
        raise ValueError("--enable-deterministic-inference runs its own batch-invariant attention; "
                         "attention_backend must be auto or torch")
    return "torch"


def invariant_moe_backend(hf: dict[str, Any], moe: str) -> str:
    """The routed experts' backend under ``--enable-deterministic-inference``: the resolved one, "torch" running
    ``FusedExperts.forward_invariant`` (layers/moe_experts.py) and "triton" ``fused_moe(invariant=True)``
    (ddtree_serve/kernels/triton_moe.py: each token's rows combined in slot order)."""
    return moe


def resolve_kernel_backends(
    hf: dict[str, Any],
    attention: str,
    moe: str,
    device: str,
    dtype: torch.dtype | None = None,
    smem_limit: int | None = None,
    kv_dtype: torch.dtype | None = None,
    arch: int | None = None,
) -> tuple[str, str]:
    """-> (attention_backend, moe_backend) with "auto" resolved, except MHA attention's "auto", which
    the model runner resolves (flashinfer probe) as before. ``dtype``: the model's; ``kv_dtype``: the KV
    cache's (default ``dtype``); ``smem_limit``: the device's opt-in shared memory per block and ``arch`` its
    compute capability (default: probed on CUDA)."""
    for name, value in (("attention_backend", attention), ("moe_backend", moe)):
        if value not in BACKEND_CHOICES:
            raise ValueError(f"{name} must be one of {', '.join(BACKEND_CHOICES)}; got {value!r}")
    cuda = str(device).startswith("cuda")
    fast = cuda and not kernels_forced_to_torch() and _triton_usable(cuda)
    mla, moe_model = is_mla(hf), has_routed_experts(hf)
    if mla:
        if attention == "flashinfer":
            raise ValueError(
                "attention_backend 'flashinfer' is not wired for MLA models; use torch or triton"
            )
        auto = attention == "auto"
        attention = ("triton" if fast else "torch") if auto else attention
        unfit = _mla_unfit(hf, dtype, device, smem_limit, kv_dtype, arch) if attention == "triton" and cuda else ""
        if unfit and not auto:
            raise ValueError(f"attention_backend 'triton': {unfit}; use torch")
        if unfit:
            logger.info("MLA attention: the torch reference, because %s", unfit)
            attention = "torch"
    elif attention == "triton":
        raise ValueError("attention_backend 'triton' is wired for MLA models only; use torch or flashinfer")
    if moe == "flashinfer":
        raise ValueError("moe_backend 'flashinfer' is not wired; use torch or triton")
    if moe == "triton" and not moe_model:
        raise ValueError("moe_backend 'triton' needs a model with routed experts")
    moe = ("triton" if fast and moe_model else "torch") if moe == "auto" else moe
    if "triton" in (attention, moe) and not _triton_usable(cuda):
        raise ValueError(
            "the triton backends need the triton package and a CUDA device (on CPU only under "
            "Triton's interpreter, TRITON_INTERPRET=1)"
        )
    return attention, moe
