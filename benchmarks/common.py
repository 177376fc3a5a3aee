"""Helpers shared by the benchmarks: prompts, tables, JSON output."""

from __future__ import annotations

import json
import platform
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import torch

CHAT_PROMPTS = [
    "Explain what a hash table is in two sentences.",
    "Write a Python function that reverses a string.",
    "What causes the seasons on Earth?",
    "Give me three tips for writing clear emails.",
    "Summarise the plot of Romeo and Juliet.",
    "How do I convert Celsius to Fahrenheit?",
    "List five fruits that are high in vitamin C.",
    "What is the difference between a list and a tuple in Python?",
]


def chat_ids(tokenizer, prompts: list[str]) -> list[list[int]]:
    out = []
    for p in prompts:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def machine() -> dict:
    return {"platform": platform.platform(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "cuda": torch.cuda.is_available(), "cpu_bf16": cpu_bf16(), "time": time.strftime("%Y-%m-%d %H:%M:%S")}


def cpu_bf16() -> str:
    """The CPU's bfloat16 support as the kernel reports it (``/proc/cpuinfo`` flags amx_bf16, avx512_bf16)
    and the vector ISA torch dispatches to (``torch.backends.cpu.get_cpu_capability``)."""
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    have = [f for f in ("amx_bf16", "avx512_bf16") if f in flags] or ["no bf16 flags"]
    return f"{' '.join(have)}; torch ISA {torch.backends.cpu.get_cpu_capability()}"


def print_table(rows: list[dict], cols: list[str]) -> None:
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in cols}
    print("  ".join(c.rjust(widths[c]) for c in cols))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).rjust(widths[c]) for c in cols), flush=True)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"
    return "-" if v is None else str(v)


def write_json(path: str, payload: dict) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(payload, indent=2))
    print(f"wrote {p}")


async def sse_events(response: Any) -> AsyncIterator[dict]:
    """The JSON events of an OpenAI-style server-sent-event stream (an httpx streaming response); blank
    separator lines and the final ``data: [DONE]`` are skipped."""
    async for line in response.aiter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])
