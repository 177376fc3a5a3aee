"""Cost of prompt scoring (``prompt_logprobs``) inside a prefill step, for the other request in the batch:
two 400-token prompts prefilled in one step, the second one scored (``prompt_logprobs=1``) or not. The
difference is the vocabulary projection + log-softmax over the scored prompt's rows; the unscored request
waits for it because it shares the step. Default model, float32, no speculation.

    python benchmarks/bench_prompt_logprobs.py [--prompt-len 400] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddtree_serve.model_executor.default_model import ensure_default_model  # noqa: E402
from ddtree_serve.server.engine import Engine, SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt-len", type=int, default=400)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    n = args.prompt_len
    engine = Engine(
        ensure_default_model(),
        dtype="float32",
        max_total_tokens=8 * n,
        chunked_prefill_size=2 * n,
        speculative_algorithm="none",
    )
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randint(100, 40000, (n,), generator=gen).tolist() for _ in range(2))
    plain = SamplingParams(temperature=0, max_tokens=1)
    variants = {
        "neither scored": plain,
        "second scored": SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1),
    }

    def run(p: SamplingParams) -> float:
        t = time.perf_counter()
        engine.generate(input_ids=[a, b], sampling_params=[plain, p])
        return time.perf_counter() - t

    times: dict[str, list[float]] = {k: [] for k in variants}
    for p in variants.values():
        run(p)  # warm-up
    for _ in range(args.repeats):
        for k, p in variants.items():  # interleaved: machine load drifts affect both alike
            times[k].append(run(p))
    for k, v in times.items():
        print(
            f"{k:15s} prefill step of 2 x {n} tokens: median {statistics.median(v):.3f} s, min {min(v):.3f} s"
        )
    engine.shutdown()


if __name__ == "__main__":
    main()
