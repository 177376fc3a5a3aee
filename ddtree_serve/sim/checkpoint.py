"""Writes the simulated device's checkpoints (ddtree_serve/model_executor/models/simulated.py) in the Hugging Face
layout the engine loads: a config.json and one placeholder safetensors file per model."""

from __future__ import annotations

import json
import string
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import save_file

from ddtree_serve.sim.machines import DeviceCostModel


def write_char_tokenizer(path: str | Path, vocab: int) -> None:
    """A character-level tokenizer of ``vocab`` ids in the Hugging Face layout (what a structured-output request
    needs: xgrammar reads its vocabulary): id 0 is the mask token, ``vocab - 1`` the EOS, ids 1.. the printable
    ASCII characters (lower case first), the rest placeholders. The simulated models' outputs do not depend on it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = string.ascii_lowercase + string.ascii_uppercase + string.digits + string.punctuation + " \n"
    names = ["<mask>"] + [chars[i - 1] if i - 1 < len(chars) else f"<x{i}>" for i in range(1, vocab - 1)] + ["</s>"]
    tok = Tokenizer(models.WordLevel({n: i for i, n in enumerate(names)}, unk_token="<mask>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")  # one token per character
    tok.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>").save_pretrained(str(path))


def write_simulated_pair(root: str | Path, vocab: int = 512, accept_prob: float = 0.8, block_size: int = 16,
                         cost: DeviceCostModel = DeviceCostModel(), max_context: int = 32768, seed: int = 0,
                         draft_top_prob: float | None = None, tokenizer: bool = False) -> tuple[str, str]:
    """A simulated target and drafter under ``root`` (``target/``, ``drafter/``): returns their paths.
    ``accept_prob``: the drafter's per-depth chance of ranking the target's token first; ``draft_top_prob``:
    the probability it gives that token (None: ``accept_prob``, calibrated); ``cost``: the modelled device
    (both models run on its one timeline); ``tokenizer``: the target gets ``write_char_tokenizer``'s."""
    root = Path(root)
    common = dict(vocab_size=vocab, hidden_size=vocab, num_hidden_layers=1, num_attention_heads=1,
                  num_key_value_heads=1, max_position_embeddings=max_context, eos_token_id=vocab - 1,
                  torch_dtype="float32", simulated_device=asdict(cost))
    paths = []
    for name, extra in (("target", dict(architectures=["DDTreeSimulatedTarget"])),
                        ("drafter", dict(architectures=["DDTreeSimulatedDrafter"], block_size=block_size,
                                         accept_prob=accept_prob, seed=seed, draft_top_prob=draft_top_prob,
                                         dflash_config=dict(mask_token_id=0)))):
        d = root / name
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text(json.dumps({**common, **extra}, indent=1))
        save_file({"dummy": torch.zeros(1)}, str(d / "model.safetensors"))
        if tokenizer and name == "target":
            write_char_tokenizer(d, vocab)
        paths.append(str(d))
    return paths[0], paths[1]
