"""Chat prompts for drafter training (DFlash, arXiv 2602.06036: the drafter learns the target's own
responses, so only the prompts matter; the target regenerates every answer).

Sources: a JSONL file (one object per line with ``"prompt"``, ``"messages"`` or ``"text"``), or a built-in
offline set drawn from Debian packages when installed (``fortunes``, ``jargon-text``, ``python3.11-doc``)
plus templated everyday requests. The result is deterministic for a given seed.
"""

from __future__ import annotations

import gzip
import json
import random
import re
from pathlib import Path

FORTUNE_DIR = Path("/usr/share/games/fortunes")
JARGON_FILE = Path("/usr/share/doc/jargon-text/jargon.txt.gz")
PYDOC_DIR = Path("/usr/share/doc/python3.11/html/_sources/library")

_TOPICS = ["the ocean", "autumn", "a lighthouse", "coffee", "friendship", "the moon", "a lost key", "rain",
           "mountains", "a small robot", "time", "city lights", "a garden", "winter mornings", "trains",
           "the desert", "music", "a library", "birds", "the first day of school", "an old map", "bread"]
_ACTIVITIES = ["learning a new language", "running a first marathon", "saving money", "sleeping better",
               "writing clean code", "studying for exams", "cooking for friends", "starting a vegetable garden",
               "staying focused while working from home", "public speaking", "traveling on a budget",
               "keeping a houseplant alive", "learning to play the guitar", "making new friends in a new city"]
_CONCEPTS = ["photosynthesis", "gravity", "inflation", "a black hole", "machine learning", "the water cycle",
             "democracy", "recursion", "a prime number", "the internet", "vaccines", "compound interest",
             "climate change", "DNA", "a binary search", "electricity", "the immune system", "a neural network",
             "supply and demand", "the Pythagorean theorem", "an API", "a hash table", "evolution", "tides"]
_PEOPLE = ["my manager", "a neighbour", "my landlord", "a customer", "my teacher", "an old friend"]
_THINGS = ["a late delivery", "a meeting next week", "a broken heater", "a birthday party", "a project delay",
           "a thank-you for their help", "a request for a day off"]
_TEMPLATES = [
    "Write a short poem about {topic}.", "Write a haiku about {topic}.", "Give me three tips for {activity}.",
    "What is {concept}?", "Explain {concept} to a ten-year-old.", "Explain {concept} in two sentences.",
    "Write a short email to {person} about {thing}.", "Tell me a short story about {topic}.",
    "What are the pros and cons of {activity}?", "List five facts about {concept}.",
    "Describe {topic} in one paragraph.", "How do I get better at {activity}?",
]
_FORTUNE_TASKS = ["What does this saying mean?\n\n{q}", "Explain this quote in simple words: \"{q}\"",
                  "Is this funny? Explain the joke:\n\n{q}", "Write a short reply to this: {q}"]
_JARGON_TASKS = ["In hacker slang, what does \"{w}\" mean?", "What is meant by the computing term \"{w}\"?",
                 "Use the word \"{w}\" in a sentence and explain it."]
_PY_TASKS = ["How do I use Python's `{f}`? Give a short example.", "What does `{f}` do in Python?",
             "Write a small Python example that uses `{f}`."]


def _fortunes(rng: random.Random, n: int) -> list[str]:
    quotes: list[str] = []
    if FORTUNE_DIR.is_dir():
        for f in sorted(FORTUNE_DIR.iterdir()):
            if f.suffix or not f.is_file() or f.name in ("art", "ascii-art", "translate-me"):
                continue
            text = f.read_text(errors="ignore")
            quotes += [" ".join(q.split()) for q in text.split("\n%\n") if 20 < len(q) < 240]
    rng.shuffle(quotes)
    return [rng.choice(_FORTUNE_TASKS).format(q=q) for q in quotes[:n]]


def _jargon(rng: random.Random, n: int) -> list[str]:
    if not JARGON_FILE.exists():
        return []
    with gzip.open(JARGON_FILE, "rt", errors="ignore") as fh:
        words = re.findall(r"^   :([^:\n]{2,30}):", fh.read(), flags=re.M)
    rng.shuffle(words)
    return [rng.choice(_JARGON_TASKS).format(w=w) for w in words[:n]]


def _pydoc(rng: random.Random, n: int) -> list[str]:
    funcs: list[str] = []
    if PYDOC_DIR.is_dir():
        for f in sorted(PYDOC_DIR.glob("*.rst.txt")):
            mod = f.name.removesuffix(".rst.txt")
            for name in re.findall(r"^\.\. function:: ([A-Za-z_][\w.]*)\(", f.read_text(errors="ignore"), flags=re.M):
                funcs.append(name if "." in name or mod == "functions" else f"{mod}.{name}")
    rng.shuffle(funcs)
    return [rng.choice(_PY_TASKS).format(f=f) for f in funcs[:n]]


def _templated(rng: random.Random, n: int) -> list[str]:
    out = []
    for _ in range(n):
        t = rng.choice(_TEMPLATES)
        out.append(t.format(topic=rng.choice(_TOPICS), activity=rng.choice(_ACTIVITIES),
                            concept=rng.choice(_CONCEPTS), person=rng.choice(_PEOPLE), thing=rng.choice(_THINGS)))
    for _ in range(n // 4):
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        out.append(rng.choice([f"What is {a} plus {b}?", f"If I have {a} apples and buy {b} more, how many do I have?",
                               f"What is {a} times {b}? Show your work."]))
    return out


def builtin_prompts(n: int, seed: int = 0) -> list[list[dict[str, str]]]:
    """``n`` single-turn chats mixing fortunes, jargon, Python docs and templates (deduplicated)."""
    rng = random.Random(seed)
    share = max(n // 4, 1)
    pool = _fortunes(rng, share) + _jargon(rng, share) + _pydoc(rng, share)
    pool += _templated(rng, max(n - len(pool), share))
    pool = list(dict.fromkeys(pool))
    rng.shuffle(pool)
    return [[{"role": "user", "content": p}] for p in pool[:n]]


def load_jsonl_prompts(path: str, n: int | None = None) -> list[list[dict[str, str]]]:
    """Chats from a JSONL file: ``messages`` (a chat; a trailing assistant turn is dropped), ``prompt``
    or ``text`` (one user turn)."""
    chats = []
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        obj = json.loads(line)
        if "messages" in obj:
            msgs = [m for m in obj["messages"] if m.get("role") in ("system", "user", "assistant")]
            while msgs and msgs[-1]["role"] == "assistant":
                msgs.pop()
            if msgs:
                chats.append(msgs)
        elif obj.get("prompt") or obj.get("text"):
            chats.append([{"role": "user", "content": obj.get("prompt") or obj["text"]}])
        if n is not None and len(chats) >= n:
            break
    return chats
