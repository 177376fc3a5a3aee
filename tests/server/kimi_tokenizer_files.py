"""Write a Kimi-style tiktoken tokenizer (our stand-in, see ``tokenization_kimi_standin.py``) into a tiny
checkpoint, and a tiny Kimi K2.6 checkpoint that uses it.

Files written next to the model (the layout of a Kimi K2.x checkpoint):

- ``tiktoken.model``: byte-level BPE ranks, ``base64(token bytes) rank`` per line: the 256 single bytes,
  then merges learned from a short English text, so common words are one to three tokens;
- ``tokenization_kimi_standin.py``: the remote-code tokenizer class ``TikTokenTokenizer``;
- ``tokenizer_config.json``: ``auto_map`` to that class, bos/eos (eos ``<|im_end|>``) and a chat
  template of our own in Kimi's turn format, with ``thinking`` on by default (off: the generation prompt
  ends with ``<think></think>``) and tools declared as JSON in a system block.
"""

from __future__ import annotations

import base64
import json
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

from tests.server.tokenization_kimi_standin import PAT_STR, special_tokens

STANDIN_SOURCE = Path(__file__).with_name("tokenization_kimi_standin.py")
STANDIN_MODULE = STANDIN_SOURCE.stem

TRAINING_TEXT = """\
Hello! You are a helpful assistant. The user asks a question and the assistant answers it clearly.
What is the weather like today in Paris? It is sunny and warm, with a light wind from the west.
Please write a short story about a cat who lives in a small house near the river. The cat likes to
sleep in the sun, and in the evening it walks along the water and watches the boats go by.
Can you call the function get_weather with the city name? The tool returns the temperature and the
forecast for the next three days. Think step by step before you answer, then give the final result.
The capital of France is Paris; the capital of Germany is Berlin. Numbers: 1, 2, 3, 10, 42, 100.
def add(a, b):
    return a + b
Thank you for your help. I would like to know more about this, and about that, and about the other
things you said. Let me think about the problem: first we read the input, then we compute the answer.
"""

CHAT_TEMPLATE = (
    "{%- if tools -%}"
    "<|im_system|>tools<|im_middle|>{{ tools | tojson }}<|im_end|>"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}<|im_user|>user<|im_middle|>"
    "{%- elif m.role == 'assistant' -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- else -%}<|im_system|>{{ m.role }}<|im_middle|>"
    "{%- endif -%}"
    "{%- if m.content is string -%}{{ m.content }}"
    "{%- elif m.content -%}{%- for p in m.content if p.type == 'text' -%}{{ p.text }}{%- endfor -%}"
    "{%- endif -%}"
    "{%- if m.role == 'assistant' and m.tool_calls -%}<|tool_calls_section_begin|>"
    "{%- for c in m.tool_calls -%}<|tool_call_begin|>{{ c.id }}<|tool_call_argument_begin|>"
    "{%- if c.function.arguments is string -%}{{ c.function.arguments }}"
    "{%- else -%}{{ c.function.arguments | tojson }}{%- endif -%}<|tool_call_end|>"
    "{%- endfor -%}<|tool_calls_section_end|>"
    "{%- endif -%}"
    "<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if thinking is defined and not thinking -%}<think></think>{%- endif -%}"
    "{%- endif -%}"
)


def train_byte_bpe(text: str, n_merges: int) -> list[bytes]:
    """The tokens of a byte-level BPE: 256 single bytes, then ``n_merges`` learned merges, in rank order.

    Words are the pieces of ``PAT_STR``; each step merges the most frequent adjacent pair (ties: the
    smallest bytes), like any BPE trainer. Raises ValueError when the text runs out of pairs."""
    import regex

    tokens = [bytes([b]) for b in range(256)]
    words: Counter[tuple[bytes, ...]] = Counter(
        tuple(bytes([b]) for b in w.encode("utf-8")) for w in regex.findall(PAT_STR, text))
    seen = set(tokens)
    while len(tokens) < 256 + n_merges:
        pairs: Counter[tuple[bytes, bytes]] = Counter()
        for w, n in words.items():
            for a, b in zip(w, w[1:], strict=False):
                pairs[(a, b)] += n
        candidates = [(n, p) for p, n in pairs.items() if p[0] + p[1] not in seen]
        if not candidates:
            raise ValueError(f"the training text gives only {len(tokens) - 256} merges, {n_merges} asked")
        best = min(candidates, key=lambda c: (-c[0], c[1]))[1]
        merged = best[0] + best[1]
        tokens.append(merged)
        seen.add(merged)
        words = Counter({_merge(w, best, merged): n for w, n in words.items()})
    return tokens


def _merge(word: tuple[bytes, ...], pair: tuple[bytes, bytes], merged: bytes) -> tuple[bytes, ...]:
    out: list[bytes] = []
    i = 0
    while i < len(word):
        if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
            out.append(merged)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def special_token_ids(vocab_size: int, media: bool = False) -> dict[str, int]:
    """Ids of the special tokens in a tokenizer of ``vocab_size`` tokens in all (they come last); ``media``:
    with the image markers (``write_kimi_tokenizer(..., media=True)``)."""
    specials = special_tokens(media)
    first = vocab_size - len(specials)
    return {tok: first + i for i, tok in enumerate(specials)}


def write_kimi_tokenizer(path: Path, vocab_size: int, media: bool = False) -> None:
    """Write the stand-in tokenizer (``vocab_size`` tokens including the special ones) into ``path``,
    replacing any other tokenizer files there."""
    path = Path(path)
    n_regular = vocab_size - len(special_tokens(media))
    if n_regular < 256:
        raise ValueError(f"vocab_size must be at least {256 + len(special_tokens(media))}")
    for stale in ("tokenizer.json", "special_tokens_map.json", "chat_template.jinja", "tokenizer.model"):
        (path / stale).unlink(missing_ok=True)
    tokens = train_byte_bpe(TRAINING_TEXT, n_regular - 256)
    (path / "tiktoken.model").write_text(
        "".join(f"{base64.b64encode(t).decode('ascii')} {rank}\n" for rank, t in enumerate(tokens)))
    shutil.copyfile(STANDIN_SOURCE, path / STANDIN_SOURCE.name)
    config: dict[str, Any] = {
        "tokenizer_class": "TikTokenTokenizer",
        "auto_map": {"AutoTokenizer": [f"{STANDIN_MODULE}.TikTokenTokenizer", None]},
        "bos_token": "[BOS]", "eos_token": "<|im_end|>", "model_max_length": 4096,
        "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE, "media_tokens": media,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def write_tiny_kimi(path: Path, vocab_size: int = 512, vision: bool = False, **overrides: Any) -> Any:
    """A tiny random Kimi K2.6 checkpoint (``tests/model_executor/tiny_deepseek.py``, INT4 experts) whose
    model vocabulary is ``vocab_size``, with the stand-in tokenizer and eos ``<|im_end|>`` in config.json
    and generation_config.json; ``vision``: with a tiny MoonViT tower whose placeholder is ``<|media_pad|>``.
    Returns the ``TinyCheckpoint``."""
    from tests.model_executor.tiny_deepseek import write_tiny_deepseek

    ids = special_token_ids(vocab_size, media=vision)
    bos, eos = ids["[BOS]"], ids["<|im_end|>"]
    tiny = write_tiny_deepseek(path, int4=True, kimi=True, vocab_size=vocab_size, bos_token_id=bos,
                               eos_token_id=eos, vision=vision,
                               media_token_id=ids["<|media_pad|>"] if vision else None, **overrides)
    write_kimi_tokenizer(Path(path), vocab_size, media=vision)
    (Path(path) / "generation_config.json").write_text(
        json.dumps({"bos_token_id": bos, "eos_token_id": eos}, indent=2))
    return tiny
