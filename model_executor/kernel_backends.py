"""Resolve ``attention_backend`` / ``moe_backend`` (CLI ``--attention-backend`` / ``--moe-backend``) for one
model on one device, once, at ``ModelConfig.load``.

What is wired (anything else is a ValueError naming the alternatives):

=================  ===============================================  ==========================================
model              attention_backend                                moe_backend
=================  ===============================================  ==========================================
MLA (DeepSeek-V3,  ``torch`` (reference) | ``triton``                ``torch`` (reference) | ``triton``
Kimi K2.x)         (kernels/triton_mla.py); auto: triton on CUDA    (kernels/triton_moe.py, dense or INT4);
                                                                    auto: triton on CUDA
MHA (Llama, Qwen)  ``torch`` | ``flashinfer`` | auto (flashinfer     ``torch`` / auto only (no routed experts)
                   on CUDA when it imports: kernels/attention_select)
=================  ===============================================  ==========================================

``auto`` takes the reference when ``DDTREE_KERNELS=torch`` or Triton does not import. Triton on a CPU
device runs only in Triton's interpreter (``TRITON_INTERPRET=1``, how tests check the kernels); asking for it
on CPU without the interpreter is an error.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from kernels.dispatch import kernels_forced_to_torch
from kernels.triton_utils import interpreting

BACKEND_CHOICES = ("auto", "torch", "triton", "flashinfer")


def is_mla(hf: dict[str, Any]) -> bool:
    return bool(hf.get("kv_lora_rank"))


def has_routed_experts(hf: dict[str, Any]) -> bool:
    return bool(hf.get("n_routed_experts"))


def _triton_usable(cuda: bool) -> bool:
    return importlib.util.find_spec("triton") is not None and (cuda or interpreting())


def resolve_kernel_backends(hf: dict[str, Any], attention: str, moe: str, device: str) -> tuple[str, str]:
    """-> (attention_backend, moe_backend) with "auto" resolved, except MHA attention's "auto", which
    the model runner resolves (flashinfer probe) as before."""
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
        attention = ("triton" if fast else "torch") if attention == "auto" else attention
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
