"""How well the drafter's path probabilities predict acceptance, per pop rank: for a fixed DDTree budget, the
mean drafter probability Q of the d-th node popped and how often verification accepted it (the DDTree
objective says the two agree for a calibrated drafter). tests/speculative/test_budget_closed_loop.py
simulates drafts with the Q column of this table.

    python benchmarks/bench_acceptance.py [--budget 64] [--batch-size 1] [--prompts 16] [--max-tokens 64]
        [--temperature 0] [--out bench_out/acceptance.json]

Measurement only: the module's ``verify_tree`` is wrapped to read each step's tree and accepted path.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import ddtree_serve.speculative.spec_worker as spec_worker  # noqa: E402
from benchmarks.common import CHAT_PROMPTS, chat_ids, machine, print_table, write_json  # noqa: E402
from ddtree_serve.server.engine import Engine, SamplingParams  # noqa: E402


class RankStats:
    """Per pop rank (slot - 1): summed Q, accepted count and nodes seen."""

    def __init__(self, budget: int):
        self.q, self.accepted, self.nodes = np.zeros(budget), np.zeros(budget), np.zeros(budget)

    def add(self, tree, res) -> None:
        n = tree.num_nodes.cpu().numpy()  # [bs]
        q = np.exp(tree.node_logws.float().cpu().numpy())  # [bs, D]
        index, length = res.accept_index.cpu().numpy(), res.accept_length.cpu().numpy()  # [bs, S], [bs]
        for b in range(len(n)):
            self.q[: n[b]] += q[b, 1 : n[b] + 1]
            self.nodes[: n[b]] += 1
            self.accepted[index[b, 1 : length[b] + 1] - 1] += 1

    def rows(self) -> list[dict]:
        seen = np.maximum(self.nodes, 1)
        return [{"rank": r + 1, "nodes": int(self.nodes[r]), "mean_q": float(self.q[r] / seen[r]),
                 "accepted": float(self.accepted[r] / seen[r])} for r in range(len(self.q)) if self.nodes[r]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--out", default="bench_out/acceptance.json")
    args = ap.parse_args()
    print(f"[bench] {machine()}", flush=True)
    engine = Engine("default", speculative_algorithm="ddtree", ddtree_budget=args.budget)
    ids = (chat_ids(engine.tokenizer, CHAT_PROMPTS) * args.prompts)[: args.prompts]
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=0, ignore_eos=True)
    stats = RankStats(args.budget)
    verify = spec_worker.verify_tree

    def observed(tree, *a, **k):
        res = verify(tree, *a, **k)
        stats.add(tree, res)
        return res

    engine.generate(input_ids=ids[:1], sampling_params=params)  # warm-up, not counted
    spec_worker.verify_tree = observed
    t = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(ids), args.batch_size):
            engine.generate(input_ids=ids[i : i + args.batch_size], sampling_params=params)
            print(f"[bench] {min(i + args.batch_size, len(ids))}/{len(ids)} prompts", flush=True)
    spec_worker.verify_tree = verify
    rows = stats.rows()
    print_table(rows, ["rank", "nodes", "mean_q", "accepted"])
    q, acc = sum(r["mean_q"] for r in rows), sum(r["accepted"] for r in rows)
    print(f"[bench] expected accepted (sum Q) {q:.3f}, accepted {acc:.3f}, ratio {acc / max(q, 1e-12):.3f}")
    write_json(args.out, {"machine": machine(), "args": vars(args), "rows": rows, "seconds": time.perf_counter() - t})


if __name__ == "__main__":
    main()
