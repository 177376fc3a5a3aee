"""Multi-turn chat benchmark: time to first token and throughput as conversations grow (prefix caching).

    # against a running server (or several, comma-separated: conversations are spread over them)
    python benchmarks/bench_multiturn.py --base-url http://127.0.0.1:30000 --label cache
    # start the server itself, once per configuration: the prefix cache on (the default) and off
    python benchmarks/bench_multiturn.py --launch --server-args "--max-total-tokens 32768" \
        --configs "cache=;no-cache=--disable-radix-cache" --output bench_multiturn.json

``--conversations`` conversations run concurrently; each sends ``--turns`` streaming chat requests one
after another, and every turn is the previous turn's whole history, the assistant's reply and a new user
message appended, after a long system prompt shared by all conversations (``--system-words`` words), so
from the second turn on most of each prompt was computed before. Per configuration it reports TTFT of
the first turns and of the later ones (p50 / p90), end-to-end output-token and request throughput, the
prompt tokens sent, and the prompt tokens the server reports cached
(``usage.prompt_tokens_details.cached_tokens``, where the server returns it). Replies are greedy with EOS
ignored, so every configuration generates the same number of tokens. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import machine, print_table, sse_events, write_json  # noqa: E402

TOPICS = ["hash tables", "the seasons", "email etiquette", "Romeo and Juliet", "unit conversion", "vitamin C",
          "Python tuples", "photosynthesis", "the water cycle", "binary search", "volcanoes", "jazz history"]
WORDS = ("the of and to in is it that was for on are with as his they be at one have this from by hot word but "
         "what some we can out other were all there when up use your how said an each she which do their time if "
         "will way about many then them write would like so these her long make thing see him two has look").split()


@dataclass
class TurnResult:
    conversation: int
    turn: int
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int | None = None
    error: str = ""


def system_prompt(words: int, seed: int) -> str:
    rng = random.Random(seed)
    body = " ".join(rng.choice(WORDS) for _ in range(words))
    return f"You are a careful assistant. Follow these house rules, which are long on purpose: {body}."


def user_turn(conversation: int, turn: int) -> str:
    topic = TOPICS[(conversation + turn) % len(TOPICS)]
    return f"Conversation {conversation}, question {turn + 1}: tell me one more thing about {topic}."


async def one_turn(client: httpx.AsyncClient, base: str, model: str, messages: list[dict], max_tokens: int,
                   conversation: int, turn: int) -> tuple[TurnResult, str]:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    res = TurnResult(conversation, turn, ok=False)
    text: list[str] = []
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", base + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res, ""
            async for data in sse_events(r):
                if "error" in data:
                    res.error = data["error"]["message"]
                    return res, ""
                for choice in data.get("choices", []):
                    piece = choice.get("delta", {}).get("content") or ""
                    if piece and not text:  # the first content (the role-only first chunk has none)
                        res.ttft = time.perf_counter() - t0
                    if piece:
                        text.append(piece)
                usage = data.get("usage")
                if usage:
                    res.prompt_tokens, res.completion_tokens = usage["prompt_tokens"], usage["completion_tokens"]
                    details = usage.get("prompt_tokens_details") or {}
                    res.cached_tokens = details.get("cached_tokens")
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
        return res, ""
    res.e2e = time.perf_counter() - t0
    res.ok = True
    return res, "".join(text)


async def conversation(client: httpx.AsyncClient, base: str, model: str, args: argparse.Namespace, i: int,
                       system: str) -> list[TurnResult]:
    messages = [{"role": "system", "content": system}]
    out = []
    for turn in range(args.turns):
        messages.append({"role": "user", "content": user_turn(i, turn)})
        res, reply = await one_turn(client, base, model, messages, args.max_tokens, i, turn)
        out.append(res)
        if not res.ok:
            break
        messages.append({"role": "assistant", "content": reply})
    return out


async def run_config(args: argparse.Namespace, bases: list[str]) -> tuple[list[TurnResult], float]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.conversations + 4)
    system = system_prompt(args.system_words, args.seed)
    async with httpx.AsyncClient(headers=headers, timeout=args.timeout, limits=limits) as client:
        model = args.model or (await client.get(bases[0] + "/v1/models")).json()["data"][0]["id"]
        warm = [{"role": "user", "content": "Hi."}]  # one short request per server: first-call costs out
        for base in bases:
            await one_turn(client, base, model, warm, 2, -1, 0)
        t0 = time.perf_counter()
        convs = await asyncio.gather(*(conversation(client, bases[i % len(bases)], model, args, i, system)
                                       for i in range(args.conversations)))
        duration = time.perf_counter() - t0
    return [r for c in convs for r in c], duration


def pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def summarise(label: str, results: list[TurnResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    first = [1000 * r.ttft for r in ok if r.turn == 0]
    later = [1000 * r.ttft for r in ok if r.turn > 0]
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    prompt = sum(r.prompt_tokens for r in ok)
    return {
        "label": label, "turns": len(results), "completed": len(ok),
        "errors": [r.error for r in results if not r.ok][:5], "duration_s": duration,
        "ttft_first_turn_ms": {"p50": pct(first, 50), "p90": pct(first, 90),
                               "mean": statistics.fmean(first) if first else 0.0},
        "ttft_later_turns_ms": {"p50": pct(later, 50), "p90": pct(later, 90),
                                "mean": statistics.fmean(later) if later else 0.0},
        "output_throughput": sum(r.completion_tokens for r in ok) / duration,
        "request_throughput": len(ok) / duration,
        "prompt_tokens": prompt,
        "cached_tokens": sum(cached) if cached else None,  # None: the server does not report it
        "cached_fraction": sum(cached) / prompt if cached and prompt else None,
        "per_turn": [asdict(r) for r in results],
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(server_args: list[str], log: Path, timeout: float) -> tuple[subprocess.Popen, str]:
    """Start ``ddtree-serve serve`` (this checkout's) on a free port; return it once /health says ok."""
    port = free_port()
    cmd = [sys.executable, "-m", "ddtree_serve.server.cli.main", "serve", "--port", str(port), *server_args]
    print("$", " ".join(shlex.quote(c) for c in cmd), flush=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=Path(__file__).resolve().parents[1], stdout=out, stderr=subprocess.STDOUT,
                                env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}; see {log}:\n{log.read_text()[-2000:]}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(1)
    stop(proc)
    raise SystemExit(f"server not healthy after {timeout:.0f}s; see {log}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def parse_configs(spec: str) -> list[tuple[str, list[str]]]:
    """``"label=ARGS;label=ARGS"`` -> [(label, extra server args)]."""
    out = []
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        label, _, extra = part.partition("=")
        out.append((label.strip(), shlex.split(extra)))
    if not out:
        raise SystemExit("--configs names no configuration")
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:30000", help="running server(s), comma-separated")
    ap.add_argument("--label", default="server", help="the configuration's name (with --base-url)")
    ap.add_argument("--launch", action="store_true", help="start the server per configuration (--configs)")
    ap.add_argument("--server-args", default="", help="extra `ddtree-serve serve` flags for every launch")
    ap.add_argument("--configs", default="cache=;no-cache=--disable-radix-cache",
                    help="with --launch: 'label=FLAGS;label=FLAGS' (FLAGS added to --server-args)")
    ap.add_argument("--launch-timeout", type=float, default=900.0)
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--model", default=None, help="default: the first of /v1/models")
    ap.add_argument("--conversations", type=int, default=8, help="concurrent conversations")
    ap.add_argument("--turns", type=int, default=4, help="turns per conversation")
    ap.add_argument("--system-words", type=int, default=400, help="length of the shared system prompt")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens per assistant reply (EOS ignored)")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output", default="bench_multiturn.json")
    args = ap.parse_args(argv)
    rows = []
    if args.launch:
        for label, extra in parse_configs(args.configs):
            log = Path(args.output).with_name(f"{Path(args.output).stem}_{label}.log")  # beside the JSON
            log.parent.mkdir(parents=True, exist_ok=True)
            proc, base = launch([*shlex.split(args.server_args), *extra], log, args.launch_timeout)
            try:
                rows.append(summarise(label, *asyncio.run(run_config(args, [base]))))
            finally:
                stop(proc)
    else:
        rows.append(summarise(args.label, *asyncio.run(run_config(args, args.base_url.split(",")))))
    table = [{"config": r["label"], "ok": f"{r['completed']}/{r['turns']}",
              "TTFT1 p50 ms": r["ttft_first_turn_ms"]["p50"], "TTFT2+ p50 ms": r["ttft_later_turns_ms"]["p50"],
              "TTFT2+ p90 ms": r["ttft_later_turns_ms"]["p90"], "out tok/s": r["output_throughput"],
              "req/s": r["request_throughput"], "prompt tok": r["prompt_tokens"],
              "cached": "-" if r["cached_fraction"] is None else f"{100 * r['cached_fraction']:.0f}%"}
             for r in rows]
    print_table(table, list(table[0]))
    for r in rows:
        if r["errors"]:
            print(f"{r['label']}: errors {r['errors']}")
    config = {k: v for k, v in vars(args).items() if k != "api_key"}
    write_json(args.output, {"config": config, "machine": machine(), "results": rows})


if __name__ == "__main__":
    main()
