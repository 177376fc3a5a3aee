"""The start-up guard for Kimi tokenizers (ddtree_serve/server/startup.py ``check_kimi_tokenizer``): with a Kimi parser
selected, the markers the parsers rely on must be single tokens with the ids the checkpoint declares. The
stand-in Kimi tokenizer passes; broken copies of it (a marker split into several tokens, special ids shifted
against tokenizer_config.json, an eos id that is not ``<|im_end|>``'s) fail with a message naming the token
and transformers #45356, and ``ddtree-serve serve`` exits with it before any process starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ddtree_serve.server.config import ServerConfig
from ddtree_serve.server.startup import (
    KIMI_MARKERS,
    check_kimi_tokenizer,
    declared_eos_ids,
    declared_token_ids,
)
from tests.server.conftest import REPO, free_port
from tests.server.kimi_tokenizer_files import STANDIN_SOURCE, special_token_ids, write_kimi_tokenizer

VOCAB = 512
IDS = special_token_ids(VOCAB)


def _checkpoint(path: Path, eos: int = IDS["<|im_end|>"]) -> Path:
    """A tokenizer-only Kimi checkpoint directory (stand-in tokenizer, config.json declaring ``eos``)."""
    path.mkdir(parents=True, exist_ok=True)
    write_kimi_tokenizer(path, VOCAB)
    (path / "config.json").write_text(json.dumps({"model_type": "kimi_k25", "text_config": {"eos_token_id": eos}}))
    return path


def _split_think(path: Path) -> Path:
    """``</think>`` no longer a special token: it encodes to several byte-level tokens."""
    src = path / STANDIN_SOURCE.name
    text = src.read_text()
    assert '"</think>", ' in text
    src.write_text(text.replace('"</think>", ', '"</thinking>", ', 1))
    return path


def _shift_declared(path: Path) -> Path:
    """tokenizer_config.json declares every special token one id higher than the vocabulary numbers it."""
    cfg_file = path / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["added_tokens_decoder"] = {str(i + 1): {"content": tok, "special": True} for tok, i in IDS.items()}
    cfg_file.write_text(json.dumps(cfg))
    return path


def _load(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), trust_remote_code=True)


def _config(path: Path, **parsers: str) -> ServerConfig:
    return ServerConfig.from_flat({"model_path": str(path), **parsers})


def test_standin_passes(tmp_path) -> None:
    path = _checkpoint(tmp_path / "good")
    tok = _load(path)
    declared = declared_token_ids(str(path), tok)
    assert {m: declared[m] for m in KIMI_MARKERS} == {m: IDS[m] for m in KIMI_MARKERS}
    assert declared_eos_ids(str(path)) == {IDS["<|im_end|>"]}
    for parsers in ({"tool_call_parser": "kimi_k2"}, {"reasoning_parser": "kimi_k2"}):
        check_kimi_tokenizer(_config(path, **parsers), tok)


@pytest.mark.parametrize(("breaks", "words"), [
    (_split_think, "encodes '</think>' to "),
    (_shift_declared, f"encodes '<think>' to token {IDS['<think>']}, but the checkpoint declares it as "
                      f"{IDS['<think>'] + 1}"),
    (lambda p: _checkpoint(p, eos=IDS["<|im_end|>"] + 1),
     f"encodes '<|im_end|>' to token {IDS['<|im_end|>']}, but the model's eos ids are [{IDS['<|im_end|>'] + 1}]"),
])
def test_broken_copies_fail_naming_the_token(tmp_path, breaks, words) -> None:
    path = breaks(_checkpoint(tmp_path / "broken"))
    tok = _load(path)
    with pytest.raises(ValueError) as e:
        check_kimi_tokenizer(_config(path, tool_call_parser="kimi_k2"), tok)
    assert words in str(e.value) and "transformers#45356" in str(e.value) and "5.4.0-5.5.3" in str(e.value)
    check_kimi_tokenizer(_config(path, tool_call_parser="hermes"), tok)  # no Kimi parser: not checked


def test_serve_exits_with_the_message(tmp_path) -> None:
    """Before any process starts or weight loads: the checkpoint has no weights at all."""
    path = _split_think(_checkpoint(tmp_path / "split"))
    res = subprocess.run([sys.executable, "-m", "ddtree_serve.server.cli.main", "serve", "--model-path", str(path), "--device",
                          "cpu", "--reasoning-parser", "kimi_k2", "--port", str(free_port())],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2, res.stderr[-3000:]
    assert "error: the tokenizer of" in res.stderr and "'</think>'" in res.stderr, res.stderr[-3000:]
    assert "transformers#45356" in res.stderr and "Traceback" not in res.stderr, res.stderr[-3000:]
