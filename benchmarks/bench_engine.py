"""Decode throughput of our Engine vs transformers ``generate`` on the default model, same run, same
dtype: batch 1 and 8, float32 and bfloat16. Prints a table with ratios; writes JSON. No speculation.

    python benchmarks/bench_engine.py [--max-tokens 64] [--dtypes float32,bfloat16] [--out bench_out/engine.json]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import CHAT_PROMPTS, chat_ids, machine, print_table, write_json  # noqa: E402
from ddtree_serve.model_executor.default_model import ensure_default_model  # noqa: E402
from ddtree_serve.server.engine import Engine, SamplingParams  # noqa: E402


def bench_hf(model, ids: list[list[int]], n: int, pad_id: int) -> float:
    width = max(map(len, ids))
    batch = torch.tensor([[pad_id] * (width - len(x)) + x for x in ids])
    mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(x) for x in ids])[:, None]).long()
    t = time.perf_counter()
    with torch.no_grad():
        model.generate(batch, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                       pad_token_id=pad_id)
    return len(ids) * n / (time.perf_counter() - t)


def bench_ours(engine: Engine, ids: list[list[int]], n: int) -> float:
    t = time.perf_counter()
    outs = engine.generate(input_ids=ids, sampling_params=SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    assert all(len(o.token_ids) == n for o in outs)
    return len(ids) * n / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--out", default="bench_out/engine.json")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = ensure_default_model()
    tok = AutoTokenizer.from_pretrained(path)
    prompts = chat_ids(tok, CHAT_PROMPTS)
    rows = []
    for dtype in args.dtypes.split(","):
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
        engine = Engine(path, dtype=dtype, max_total_tokens=8192)
        bench_ours(engine, prompts[:1], 4)  # warm-up
        bench_hf(hf, prompts[:1], 4, tok.pad_token_id or 0)
        for bs in (int(b) for b in args.batch_sizes.split(",")):
            ids = (prompts * ((bs + len(prompts) - 1) // len(prompts)))[:bs]
            print(f"[bench] dtype={dtype} batch={bs} ...", flush=True)
            ours = bench_ours(engine, ids, args.max_tokens)
            ref = bench_hf(hf, ids, args.max_tokens, tok.pad_token_id or 0)
            rows.append({"dtype": dtype, "batch": bs, "ours_tok_s": ours, "hf_tok_s": ref, "ratio": ours / ref})
        engine.shutdown()
        del hf
    print_table(rows, ["dtype", "batch", "ours_tok_s", "hf_tok_s", "ratio"])
    write_json(args.out, {"machine": machine(), "max_tokens": args.max_tokens, "rows": rows})


if __name__ == "__main__":
    main()
