"""The shipped DFlash drafter (arXiv 2602.06036) of the default model SmolLM2-135M-Instruct.

It lives inside the package (``ddtree_serve/model_executor/drafters/smollm2-135m-dflash``: z-lab-format config.json,
bf16 model.safetensors, README.md model card) so a wheel install serves it offline.
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_DRAFTER_NAME = "smollm2-135m-dflash"


def default_drafter_path() -> str:
    """Directory of the default model's drafter; raises if the package was installed without it."""
    path = Path(__file__).resolve().parent / "drafters" / DEFAULT_DRAFTER_NAME
    if not (path / "config.json").exists() or not (path / "model.safetensors").exists():
        raise FileNotFoundError(f"the default drafter is missing from the installation: {path}")
    return str(path)
