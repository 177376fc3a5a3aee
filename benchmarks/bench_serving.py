"""Load generator for a running ddtree-serve (or any OpenAI-compatible) server.

    python benchmarks/bench_serving.py --base-url http://127.0.0.1:30000 --concurrency 1,4,16 \
        --num-prompts 32 --max-tokens 64 --output bench_serving.json --plot bench_serving.png

For each concurrency level it sends ``--num-prompts`` streaming requests (at most ``concurrency`` in flight,
arrivals Poisson at ``--request-rate`` per second, or all at once with ``inf``) and reports request and
output-token throughput, TTFT, TPOT (time per output token after the first), inter-chunk latency
percentiles, and the mean speculative acceptance length from the responses' ``spec_stats``. Prints a table,
writes JSON, and plots throughput and latency against concurrency (PNG).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import sse_events  # noqa: E402

BUILTIN_PROMPTS = [
    "Explain why the sky is blue in two sentences.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "List three uses of a paperclip.",
    "What is the capital of Australia, and why was it chosen?",
    "Summarise the plot of Romeo and Juliet.",
    "Translate 'good morning, how are you?' into French and German.",
    "Give me a haiku about autumn leaves.",
    "How does a hash table handle collisions?",
]


@dataclass
class ReqResult:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int = 0
    chunk_gaps: list[float] = field(default_factory=list)
    acceptance_length: float = 0.0
    error: str = ""


def load_prompts(spec: str, n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    if spec == "builtin":
        base = BUILTIN_PROMPTS
    elif spec.startswith("random:"):
        words = "the of and to in is it that was for on are with as his they be at one have this from".split()
        length = int(spec.split(":", 1)[1])
        base = [" ".join(rng.choice(words) for _ in range(length)) for _ in range(max(n, 1))]
    elif spec.startswith("file:"):  # JSONL with {"prompt": ...} per line, or plain text lines
        base = []
        for line in Path(spec[5:]).read_text().splitlines():
            if line.strip():
                base.append(json.loads(line)["prompt"] if line.lstrip().startswith("{") else line)
    else:
        raise SystemExit(f"unknown prompt set {spec!r} (builtin | random:N | file:PATH)")
    return [base[i % len(base)] for i in range(n)]


async def one_request(client: httpx.AsyncClient, args: argparse.Namespace, model: str, prompt: str) -> ReqResult:
    if args.endpoint == "chat":
        url, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}]}
    else:
        url, body = "/v1/completions", {"prompt": prompt}
    body.update(model=model, max_tokens=args.max_tokens, temperature=args.temperature, stream=True,
                stream_options={"include_usage": True}, ignore_eos=args.ignore_eos)
    t0 = time.perf_counter()
    res = ReqResult(ok=False)
    last = None
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for data in sse_events(r):
                if "error" in data:
                    res.error = data["error"]["message"]
                    return res
                now = time.perf_counter()
                has_text = any((c.get("delta", {}).get("content") or c.get("delta", {}).get("reasoning_content")
                                or c.get("text")) for c in data.get("choices", []))
                if has_text:
                    if last is None:
                        res.ttft = now - t0
                    else:
                        res.chunk_gaps.append(now - last)
                    last = now
                if data.get("usage"):
                    res.output_tokens = data["usage"]["completion_tokens"]
                    res.prompt_tokens = data["usage"]["prompt_tokens"]
                    res.acceptance_length = (data.get("spec_stats") or {}).get("acceptance_length", 0.0)
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.e2e = time.perf_counter() - t0
    res.ok = True
    return res


def pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


async def run_level(args: argparse.Namespace, model: str, prompts: list[str], concurrency: int) -> dict:
    sem = asyncio.Semaphore(concurrency)
    rng = random.Random(args.seed)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, timeout=args.timeout, limits=limits) as client:

        async def bounded(p: str) -> ReqResult:
            async with sem:
                return await one_request(client, args, model, p)

        t0 = time.perf_counter()
        tasks = []
        for p in prompts:
            tasks.append(asyncio.create_task(bounded(p)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    gaps = [g for r in ok for g in r.chunk_gaps]
    accept = [r.acceptance_length for r in ok if r.acceptance_length > 0]
    return {
        "concurrency": concurrency, "requests": len(results), "completed": len(ok),
        "errors": [r.error for r in results if not r.ok][:5], "duration_s": duration,
        "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
        "total_output_tokens": out_tokens, "total_prompt_tokens": sum(r.prompt_tokens for r in ok),
        "ttft_ms": {f"p{q}": 1000 * pct([r.ttft for r in ok], q) for q in (50, 90, 99)},
        "tpot_ms": {f"p{q}": 1000 * pct(tpot, q) for q in (50, 90, 99)},
        "itl_ms": {f"p{q}": 1000 * pct(gaps, q) for q in (50, 90, 99)},
        "mean_ttft_ms": 1000 * statistics.fmean([r.ttft for r in ok]) if ok else 0.0,
        "mean_acceptance_length": statistics.fmean(accept) if accept else 0.0,
    }


def plot(levels: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = [lv["concurrency"] for lv in levels]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    a1.plot(c, [lv["output_throughput"] for lv in levels], "o-")
    a1.set(xlabel="concurrency", ylabel="output tokens/s", title="Throughput", xscale="log")
    for key, label in (("ttft_ms", "TTFT p50"), ("tpot_ms", "TPOT p50")):
        a2.plot(c, [lv[key]["p50"] for lv in levels], "o-", label=label)
    a2.plot(c, [lv["tpot_ms"]["p99"] for lv in levels], "x--", label="TPOT p99")
    a2.set(xlabel="concurrency", ylabel="ms", title="Latency", xscale="log", yscale="log")
    a2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:30000")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--model", default=None, help="default: the first of /v1/models")
    ap.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    ap.add_argument("--concurrency", default="1,4,16", help="comma-separated levels")
    ap.add_argument("--num-prompts", type=int, default=16, help="requests per level")
    ap.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second")
    ap.add_argument("--prompts", default="builtin", help="builtin | random:N (N words) | file:PATH (JSONL/text)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output", default="bench_serving.json")
    ap.add_argument("--plot", default="bench_serving.png")
    args = ap.parse_args(argv)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = args.model or httpx.get(f"{args.base_url}/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
    prompts = load_prompts(args.prompts, args.num_prompts, args.seed)
    levels = []
    print(f"{'conc':>5} {'req/s':>7} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9} "
          f"{'ITL p50':>8} {'tau':>5} {'ok':>5}")
    for conc in [int(x) for x in args.concurrency.split(",")]:
        lv = asyncio.run(run_level(args, model, prompts, conc))
        levels.append(lv)
        print(f"{conc:>5} {lv['request_throughput']:>7.2f} {lv['output_throughput']:>8.1f} "
              f"{lv['ttft_ms']['p50']:>9.0f} {lv['ttft_ms']['p99']:>9.0f} {lv['tpot_ms']['p50']:>9.0f} "
              f"{lv['tpot_ms']['p99']:>9.0f} {lv['itl_ms']['p50']:>8.0f} {lv['mean_acceptance_length']:>5.2f} "
              f"{lv['completed']:>2}/{lv['requests']}", flush=True)
    report = {"config": {k: v for k, v in vars(args).items() if k != "api_key"}, "model": model, "levels": levels}
    report["config"]["request_rate"] = str(args.request_rate)
    Path(args.output).write_text(json.dumps(report, indent=2))
    if args.plot:
        plot(levels, args.plot)
    print(f"wrote {args.output}" + (f" and {args.plot}" if args.plot else ""))


if __name__ == "__main__":
    main()
