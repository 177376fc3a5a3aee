"""Structured outputs under speculation on the default model: constrained decode tokens/s and tau (tokens
per verify step) for no speculation, DFlash and DDTree, each speculative one with and without drafter-side
grammar masking (``SpecWorker.mask_drafts``: masked drafter logits + pruning of rejected tree nodes; the
target-side masks that keep verification exact are always on), greedy, on chat prompts asking for JSON
under a few JSON schemas. Every output is checked against its schema. Table + JSON.

    python benchmarks/bench_structured.py [--budget 16] [--batch-sizes 1,4] [--max-tokens 96]
        [--temperature 0] [--out bench_out/structured.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import chat_ids, machine, print_table, write_json  # noqa: E402
from ddtree_serve.server.engine import Engine, SamplingParams  # noqa: E402

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                      "email": {"type": "string", "maxLength": 40}},
     "required": ["name", "age", "email"]},
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                      "temperature_c": {"type": "integer"},
                                      "conditions": {"enum": ["sunny", "cloudy", "rain", "snow"]}},
     "required": ["city", "temperature_c", "conditions"]},
    {"type": "object", "properties": {"title": {"type": "string", "maxLength": 40},
                                      "steps": {"type": "array", "items": {"type": "string", "maxLength": 40},
                                                "maxItems": 3}},
     "required": ["title", "steps"]},
    {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 60},
                                      "confidence": {"type": "number"}}, "required": ["answer", "confidence"]},
]
PROMPTS = [
    "Give me a JSON record for a fictional person with a name, age and email.",
    "Report today's weather in Paris as JSON.",
    "Write a short recipe for tea as JSON with a title and steps.",
    "What is the capital of Italy? Answer as JSON with your confidence.",
]


def run(engine: Engine, ids: list[list[int]], params: list[SamplingParams], schemas: list[dict]) -> dict:
    import jsonschema_rs

    spec = engine.scheduler.spec
    t = time.perf_counter()
    outs = engine.generate(input_ids=ids, sampling_params=params)
    wall = time.perf_counter() - t
    gen = sum(len(o.token_ids) for o in outs)
    valid = 0
    for o, s in zip(outs, schemas, strict=True):
        try:
            jsonschema_rs.validate(s, json.loads(o.text))
            valid += 1
        except (ValueError, jsonschema_rs.ValidationError):
            pass
    row = {"tok_s": gen / wall, "generated": gen, "valid": f"{valid}/{len(outs)}"}
    if spec is not None:
        steps = sum(o.spec_verify_steps for o in outs)
        row["tau"] = sum(len(o.token_ids) - 1 for o in outs) / max(steps, 1)  # the first token is the prefill's
        row["mean_budget"] = sum(o.spec_budget_sum for o in outs) / max(steps, 1)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", type=int, default=16, help="fixed DDTree budget")
    ap.add_argument("--batch-sizes", default="1,4")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", default="bench_out/structured.json")
    args = ap.parse_args()
    rows = []
    base: dict[int, float] = {}
    for alg in ("none", "dflash", "ddtree"):
        kw = {} if alg == "none" else {"speculative_algorithm": alg, "draft_model_path": "default",
                                       "ddtree_budget": args.budget}
        engine = Engine("default", dtype=args.dtype, max_total_tokens=16384, **kw)
        ids_all = chat_ids(engine.tokenizer, PROMPTS)
        warm = SamplingParams(temperature=0, max_tokens=4, json_schema=json.dumps(SCHEMAS[0]))
        engine.generate(input_ids=ids_all[:1], sampling_params=warm)  # compiles the grammar cache's first entry
        for bs in (int(b) for b in args.batch_sizes.split(",")):
            idx = [i % len(PROMPTS) for i in range(bs)]
            ids = [ids_all[i] for i in idx]
            schemas = [SCHEMAS[i] for i in idx]
            params = [SamplingParams(temperature=args.temperature, seed=i, max_tokens=args.max_tokens,
                                     json_schema=json.dumps(s)) for i, s in enumerate(schemas)]
            for mask in ((True,) if alg == "none" else (True, False)):
                if engine.scheduler.spec is not None:
                    engine.scheduler.spec.mask_drafts = mask
                print(f"[bench] {alg} batch={bs} mask_drafts={mask} ...", flush=True)
                row = {"algorithm": alg, "batch": bs, "mask_drafts": mask if alg != "none" else None}
                row.update(run(engine, ids, params, schemas))
                if alg == "none":
                    base[bs] = row["tok_s"]
                row["speedup"] = row["tok_s"] / base[bs] if bs in base else None
                rows.append(row)
        engine.shutdown()
    print_table(rows, ["algorithm", "batch", "mask_drafts", "tau", "tok_s", "speedup", "mean_budget", "generated",
                       "valid"])
    write_json(args.out, {"machine": machine(), "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
