"""Architecture name (config.json ``architectures[0]``) -> model class, imported on demand."""

from __future__ import annotations

import importlib

_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "ddtree_serve.model_executor.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "ddtree_serve.model_executor.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "ddtree_serve.model_executor.models.llama:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "ddtree_serve.model_executor.models.llama:Qwen3ForCausalLM",
    "DeepseekV3ForCausalLM": "ddtree_serve.model_executor.models.deepseek_v3:DeepseekV3ForCausalLM",
    "KimiK25ForConditionalGeneration": "ddtree_serve.model_executor.models.kimi_k25:KimiK25ForConditionalGeneration",
    "DFlashDraftModel": "ddtree_serve.model_executor.models.dflash:DFlashDraftModel",
    # z-lab's DFlash2 reaches the DFlash class, which refuses its candidate selector with the reason
    "DFlash2DraftModel": "ddtree_serve.model_executor.models.dflash:DFlashDraftModel",
    # the simulated device (ddtree_serve/sim/): modelled forwards for host-side measurements at GPU scale
    "DDTreeSimulatedTarget": "ddtree_serve.model_executor.models.simulated:SimulatedTarget",
    "DDTreeSimulatedDrafter": "ddtree_serve.model_executor.models.simulated:SimulatedDrafter",
}


def supported_architectures() -> list[str]:
    return sorted(_ARCHITECTURES)


def get_model_class(architecture: str) -> type:
    target = _ARCHITECTURES.get(architecture)
    if target is None:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(supported_architectures())}"
        )
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)
