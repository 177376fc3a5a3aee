"""The shipped DFlash drafter (arXiv 2602.06036) of the default model SmolLM2-135M-Instruct.

It lives inside the package (``ddtree_serve/model_executor/drafters/smollm2-135m-dflash-v2``: z-lab-format
config.json, bf16 model.safetensors, README.md model card) so a wheel install serves it offline. The drafter it
replaced stays in the package and loads by path (``previous_drafter_path()``, ``--speculative-draft-model-path``).
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_DRAFTER_NAME = "smollm2-135m-dflash-v2"
PREVIOUS_DRAFTER_NAME = "smollm2-135m-dflash"  # the default until issue 49's fine-tune (its model card says why)


def _drafter_dir(name: str, what: str) -> str:
    path = Path(__file__).resolve().parent / "drafters" / name
    if not (path / "config.json").exists() or not (path / "model.safetensors").exists():
        raise FileNotFoundError(f"the {what} drafter is missing from the installation: {path}")
    return str(path)


def default_drafter_path() -> str:
    """Directory of the default model's drafter; raises if the package was installed without it."""
    return _drafter_dir(DEFAULT_DRAFTER_NAME, "default")


def previous_drafter_path() -> str:
    """Directory of the drafter the default replaced (still loadable: ``--speculative-draft-model-path``)."""
    return _drafter_dir(PREVIOUS_DRAFTER_NAME, "previous")
