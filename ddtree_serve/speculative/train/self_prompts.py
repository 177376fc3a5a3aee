"""Chat prompts written by the target itself (Magpie, Xu et al. 2024, arXiv 2406.08464).

An instruction-tuned model given only the chat template up to the start of a user turn writes a user
message from its own instruction-tuning distribution. That is the broadest offline prompt source there is
for a drafter: no dataset download, and the prompts look like what users of that model ask. The target then
answers them (``datagen``) exactly as it answers any other prompt.

Generated messages are filtered (the turn must end with an end-of-turn token; 3-80 words; printable text;
no template markup) and deduplicated. They are cached, one JSON object per line, so a rerun continues
where the previous one stopped and returns the same prompts.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from pathlib import Path

import torch
from tqdm import tqdm

from ddtree_serve.model_executor.model_runner import ModelRunner
from ddtree_serve.speculative.train.datagen import generate_batch

_SENTINEL = "\u2063USER-TURN\u2063"


def user_turn_prefix(tokenizer) -> list[int]:
    """Token ids of the chat template (default system prompt included) up to where the user's words start."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": _SENTINEL}], tokenize=False)
    if _SENTINEL not in text:
        raise ValueError("the chat template does not render the user's message verbatim; cannot self-prompt")
    return tokenizer.encode(text[:text.index(_SENTINEL)], add_special_tokens=False)


def acceptable(text: str) -> bool:
    """A usable user message: 3-80 words, printable, no chat-template markup."""
    words = text.split()
    return (3 <= len(words) <= 80 and "<|" not in text and "|>" not in text
            and all(c.isprintable() or c in "\n\t" for c in text))


def _key(text: str) -> str:
    """Whitespace- and case-insensitive identity of a message (for deduplication and exclusion)."""
    return " ".join(text.split()).lower()


def self_written_prompts(runner: ModelRunner, tokenizer, n: int, cache: str | Path, seed: int = 0,
                         temperature: float = 1.0, max_tokens: int = 64, batch: int = 48,
                         exclude: Iterable[str] = (), max_rounds: int | None = None) -> list[list[dict[str, str]]]:
    """``n`` single-turn chats whose user message the target wrote itself (cached in ``cache``, JSONL).

    Each round samples ``batch`` user turns at ``temperature`` from the template prefix; a turn counts
    only when it ends with an end-of-turn token within ``max_tokens`` and passes ``acceptable``.
    ``exclude`` lists messages never to return (held-out evaluation prompts)."""
    cache = Path(cache)
    found: list[str] = []
    if cache.exists():
        found = [json.loads(line)["prompt"] for line in cache.read_text().splitlines() if line.strip()]
    seen = {_key(e) for e in exclude} | {_key(p) for p in found}
    prefix = user_turn_prefix(tokenizer)
    stops = set(runner.config.eos_token_ids)  # the end-of-turn ids the engine stops on
    bar = tqdm(total=n, initial=min(len(found), n), desc="self-prompts", unit="prompt", mininterval=5.0)
    rounds, t0 = 0, time.time()
    while len(found) < n and (max_rounds is None or rounds < max_rounds):
        gen = torch.Generator().manual_seed(seed * 1_000_003 + len(found) * 1_009 + rounds)
        seqs, _ = generate_batch(runner, [prefix] * batch, [temperature] * batch, max_tokens, stops, (), gen)
        rounds += 1
        new = []
        for s in seqs:
            body = s[len(prefix):]
            if not body or body[-1] not in stops:
                continue  # ran past max_tokens: an unfinished turn
            text = tokenizer.decode(body[:-1]).strip()
            if acceptable(text) and _key(text) not in seen:
                seen.add(_key(text))
                new.append(text)
        new = new[:n - len(found)]
        with cache.open("a") as fh:
            fh.writelines(json.dumps({"prompt": p}) + "\n" for p in new)
        found += new
        bar.update(len(new))
        bar.set_postfix(kept=f"{len(new)}/{batch}", elapsed=f"{time.time() - t0:.0f}s")
    bar.close()
    return [[{"role": "user", "content": p}] for p in found[:n]]
