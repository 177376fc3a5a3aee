"""Drafter evaluation (issue 49, item 3): offline chain and DDTree tau of one or more DFlash drafters on a
held-out chat prompt set that training never saw, beside the speed of the default server configuration
against plain decoding, all in one run.

The held-out set is ``benchmarks/data/heldout_chat.jsonl``: 48 single-turn chat prompts written for this
benchmark (writing, roleplay, reasoning, math, coding, extraction, STEM, humanities, everyday advice; the
categories interleaved, so ``--prompts N`` takes a spread). ``--train-data DIR`` checks it against a training
data directory (``self_prompts.jsonl`` and the user message of every ``feat/train_*.pt`` record's prompt,
whitespace- and case-insensitive): ``overlaps`` must be 0 to call the set held out (``contained`` also counts
held-out prompts found inside a longer training prompt).

1. Offline tau: the target (float32, our ModelRunner) answers every prompt greedily (EOS or ``--max-tokens``)
   with its hidden states captured at each drafter's target layers (``speculative/train/datagen.py``); the
   records are cached under ``bench_out/drafter_records/`` keyed by model, layer ids, token limit and prompts,
   so a rerun skips generation. Chain and DDTree@``--budget`` tau per drafter and per category come from
   ``speculative/train/evaluate.py`` (the exact simulation the trainer reports).
2. Speed: the default server's speculative configuration (``ddtree``, auto budget up to 64, draft sources
   dflash + suffix; one engine per drafter, ``auto:<drafter>``) against plain decoding (``none``) and an A/A
   control (``none-aa``, a second plain engine: its ratio to none is the noise), greedy, EOS ends a request, at
   each ``--batch-sizes``, in INTERLEAVED rounds (``bench_spec.run_rounds``: every engine runs each call in
   turn, the order rotated). A round serves ``--round-prompts`` distinct held-out prompts (round k starts
   where round k-1 stopped, cycling); before every round every engine forgets its suffix index of recent
   outputs and its prefix cache, so no engine ever drafts from its own earlier answer to the same prompt.
   ``vs_none``: median over rounds of the paired per-round ratio to none; ``aa`` / ``tol``: the A/A control's
   median ratio and twice the standard error of that median (``bench_spec.auto_summary``): the noise band
   (``aa_all``: every round's A/A ratio). ``tau_verify``: tokens per verify step of the speculative engine
   ((accepted drafts + verify steps) / verify steps; auto's plain steps, ``plain_share``, are not in it);
   ``suffix_share``: the share of accepted drafts the suffix source proposed; ``same``: the least share of a
   round's requests whose tokens equal plain decoding's (greedy is lossless up to float rounding).
   The drafting cost beside it: median ms per timed step up to the drafter's logits (suffix lookup, plan, drafter
   forward), of the tree build and of the verify forward, and the drafting share of that step time (what a
   deeper drafter pays for its tau).

    python benchmarks/bench_drafter.py [--drafters shipped,/path/to/drafter] [--prompts 48] [--max-tokens 128]
        [--budget 16] [--batch-sizes 1,8] [--rounds 3] [--round-prompts 8] [--skip-speed] [--train-data DIR]
        [--threads 1] [--draft-windows none,64,16] [--out bench_out/drafter.json]

``--draft-windows``: the offline tau again with each drafter's context capped at the last N tokens before each
block (``--speculative-dflash-draft-window-size N``; rows ``drafter@N``; ``none``: no cap).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.bench_copy import forget_outputs  # noqa: E402
from benchmarks.bench_spec import CONTROL, auto_summary, build_engine, run_rounds, summarise_cell  # noqa: E402
from benchmarks.common import chat_ids, machine, print_table, write_json  # noqa: E402
from ddtree_serve.model_executor.models.dflash import DFlashDraftModel  # noqa: E402
from ddtree_serve.server.engine import Engine, SamplingParams  # noqa: E402

HELDOUT = Path(__file__).resolve().parent / "data" / "heldout_chat.jsonl"
TARGETS = {"tau_ddtree": 3.0, "tau_chain": 2.2, "speed_b1": 1.3, "speed_b8": 1.0}  # issue 49's aims
_SENTINEL = "\u2063HELDOUT\u2063"


def load_heldout(path: str | Path = HELDOUT, n: int | None = None) -> list[dict]:
    """The first ``n`` (all: None) ``{"category", "prompt"}`` rows of the held-out set."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return rows[:n] if n else rows


def prompt_key(text: str) -> str:
    """Whitespace- and case-insensitive identity of a prompt."""
    return " ".join(text.split()).lower()


def resolve_drafters(spec: str) -> dict[str, str]:
    """``label -> drafter directory``: ``shipped`` is the default model's drafter, any other item a path (its
    label the directory name)."""
    from ddtree_serve.model_executor.default_drafter import default_drafter_path

    out = {}
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        path = str(default_drafter_path()) if item == "shipped" else item
        if not (Path(path) / "config.json").is_file():
            raise SystemExit(f"drafter {item!r}: no config.json in {path}")
        out["shipped" if item == "shipped" else Path(path).resolve().name] = path
    return out


def user_message(tokenizer, prompt_ids: list[int]) -> str:
    """The user's text inside a chat-templated single-turn prompt (the whole decoded text if the template's
    frame around it does not match)."""
    frame = tokenizer.apply_chat_template([{"role": "user", "content": _SENTINEL}], add_generation_prompt=True,
                                          tokenize=False)
    head, _, tail = frame.partition(_SENTINEL)
    text = tokenizer.decode(prompt_ids)
    if text.startswith(head) and text.endswith(tail):
        return text[len(head):len(text) - len(tail)]
    return text


def training_prompts(data_dir: str | Path, tokenizer) -> list[str]:
    """Every prompt of a training data directory: ``self_prompts.jsonl`` and the user message of each
    ``feat/train_*.pt`` record (memory-mapped: the features are never read)."""
    root = Path(data_dir)
    found = []
    if (root / "self_prompts.jsonl").exists():
        found += [json.loads(line)["prompt"] for line in (root / "self_prompts.jsonl").read_text().splitlines()
                  if line.strip()]
    for shard in sorted((root / "feat").glob("train_*.pt")):
        for rec in torch.load(shard, mmap=True):
            found.append(user_message(tokenizer, rec["tokens"][:int(rec["prompt_len"])].tolist()))
    return found


def overlap_report(heldout: list[str], train: list[str]) -> dict:
    """``overlaps``: held-out prompts equal to a training prompt; ``contained``: found inside a longer one."""
    keys = {prompt_key(t) for t in train}
    exact = [h for h in heldout if prompt_key(h) in keys]
    inside = [h for h in heldout if h not in exact and any(prompt_key(h) in k for k in keys)]
    return {"train_prompts": len(keys), "overlaps": len(exact), "contained": len(inside),
            "overlapping": exact + inside, "held_out": not exact}


def heldout_records(model_path: str, ids: list[list[int]], layer_ids: tuple[int, ...], max_tokens: int,
                    cache_dir: Path) -> list[dict]:
    """Greedy target responses with features at ``layer_ids`` (cached: same model, layers, limit, prompts)."""
    from ddtree_serve.model_executor.model_config import ModelConfig
    from ddtree_serve.speculative.train.datagen import generate_batch, make_runner

    key = hashlib.sha1(json.dumps([Path(model_path).name, list(layer_ids), max_tokens, ids]).encode()).hexdigest()
    path = cache_dir / f"{Path(model_path).name}-{'_'.join(map(str, layer_ids))}-{key[:12]}.pt"
    if path.exists():
        print(f"[bench] records: {path} (cached)", flush=True)
        return torch.load(path)
    t = time.perf_counter()
    runner = make_runner(model_path, len(ids) * (max_tokens + max(map(len, ids)) + 16))
    eos = set(ModelConfig.load(model_path).eos_token_ids)
    seqs, feats = generate_batch(runner, ids, [0.0] * len(ids), max_tokens, eos, layer_ids, torch.Generator())
    recs = [{"tokens": torch.tensor(s, dtype=torch.int32), "prompt_len": len(p), "temperature": 0.0,
             "feats": f.to(torch.bfloat16)} for s, p, f in zip(seqs, ids, feats, strict=True)]
    cache_dir.mkdir(parents=True, exist_ok=True)
    torch.save(recs, path)
    n_tok = sum(len(s) - len(p) for s, p in zip(seqs, ids, strict=True))
    print(f"[bench] records: {len(recs)} greedy responses, {n_tok} tokens in {time.perf_counter() - t:.0f} s -> {path}", flush=True)
    return recs


def load_drafter(path: str) -> DFlashDraftModel:
    from ddtree_serve.model_executor.model_config import ModelConfig
    from ddtree_serve.model_executor.weight_loader import iter_weights

    model = DFlashDraftModel(ModelConfig.load(path, "float32"))
    model.load_weights(iter_weights(path))
    return model.eval()


def offline_tau(model, embed: torch.Tensor, head: torch.Tensor, recs: list[dict], cats: list[str],
                budget: int) -> dict:
    """Chain and DDTree tau over all records and per category. Per-category runs are exact; the totals
    combine them by their counts (tau = emitted tokens / steps, so steps = tokens / tau)."""
    from ddtree_serve.speculative.train.evaluate import offline_acceptance

    out: dict = {"per_category": {}}
    totals = {"chain": [0.0, 0.0], "ddtree": [0.0, 0.0]}
    for cat in dict.fromkeys(cats):
        sub = [r for r, c in zip(recs, cats, strict=True) if c == cat]
        res = offline_acceptance(model, embed, head, sub, budget)
        tokens = sum(max(int(r["tokens"].numel()) - int(r["prompt_len"]) - 1, 0) for r in sub
                     if int(r["tokens"].numel()) - int(r["prompt_len"]) >= 2)
        out["per_category"][cat] = {"prompts": len(sub), "tokens": tokens, "tau_chain": res["tau_chain"],
                                    "tau_ddtree": res["tau_ddtree"]}
        for mode in totals:
            if res[f"tau_{mode}"] > 0:
                totals[mode][0] += tokens
                totals[mode][1] += tokens / res[f"tau_{mode}"]
    for mode, (tok, steps) in totals.items():
        out[f"tau_{mode}"] = tok / steps if steps else 0.0
    out["tokens"] = sum(c["tokens"] for c in out["per_category"].values())
    return out


def fresh(engine: Engine) -> None:
    """Forget the suffix index of recent outputs and the prefix cache (the engine is idle between calls)."""
    forget_outputs(engine)
    tree = getattr(getattr(engine.scheduler, "kv", None), "tree", None)
    if tree is not None:
        tree.reset()


class Counted:
    """An engine whose ``generate`` also sums its outputs' verify steps and accepted draft tokens:
    ``bench_spec.run``'s tau divides every token after the first by the verify steps, which under the auto
    budget counts the tokens of plain steps too (tens at batch 8)."""

    def __init__(self, engine: Engine):
        self.engine, self.steps, self.accepted, self.suffix = engine, 0, 0, 0
        self.outputs: list[list[int]] = []  # token ids of every request since the last reset, in order

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    def generate(self, *args, **kwargs):
        outs = self.engine.generate(*args, **kwargs)
        self.steps += sum(o.spec_verify_steps for o in outs)
        self.accepted += sum(o.spec_accepted_tokens for o in outs)
        self.suffix += sum(o.spec_accepted_suffix for o in outs)
        self.outputs += [list(o.token_ids) for o in outs]
        return outs


def speed(drafters: dict[str, str], ids: list[list[int]], args: argparse.Namespace) -> tuple[list[dict], dict]:
    """Interleaved rounds of none, none-aa and each drafter's default-server engine: (a summary row per drafter
    and batch size, the raw rounds by batch size)."""
    def ns(path: str | None) -> argparse.Namespace:
        return argparse.Namespace(draft_model_path=path, dtype=args.dtype, kv_tokens=args.kv_tokens,
                                  max_budget=64, max_tokens=args.max_tokens)

    engines: dict[str, Counted] = {}
    for lab, alg, path in [("none", "none", None), (CONTROL, "none", None),
                           *((f"auto:{d}", "ddtree", p) for d, p in drafters.items())]:
        print(f"[bench] engine {lab}" + (f" ({path})" if path else ""), flush=True)
        engines[lab] = Counted(build_engine(alg, "auto" if alg == "ddtree" else 0, ns(path)))
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    rows_by_bs: dict[int, dict[str, list]] = {}
    t0 = time.perf_counter()
    for bs in (int(b) for b in args.batch_sizes.split(",")):
        size = min(max(args.round_prompts, bs), len(ids))
        rows: dict[str, list] = {}
        for rid in range(args.rounds):
            start = rid * size % len(ids)
            chunk = (ids[start:] + ids[:start])[:size]
            for e in engines.values():
                fresh(e)
            run_rounds(engines, lambda _r, c=chunk: c, lambda _r: params, bs, 1, rid, rows)
            for lab, e in engines.items():  # greedy is lossless: every engine's tokens equal plain's
                same = sum(a == b for a, b in zip(e.outputs, engines["none"].outputs, strict=True)) / len(e.outputs)
                rows[lab][-1].update(verify_steps=e.steps, accepted_drafts=e.accepted, accepted_suffix=e.suffix,
                                     same=same)
            for e in engines.values():
                e.steps, e.accepted, e.suffix, e.outputs = 0, 0, 0, []
            print(f"[bench] batch={bs} round {rid + 1}/{args.rounds} tok/s: "
                  + "  ".join(f"{k} {v[-1]['tok_s']:.1f}" for k, v in rows.items())
                  + f"  [{time.perf_counter() - t0:.0f} s]", flush=True)
        rows_by_bs[bs] = rows
    for e in engines.values():
        e.shutdown()
    out = []
    for bs, rows in rows_by_bs.items():
        plain = statistics.median(r["tok_s"] for r in rows["none"])
        for d in drafters:
            sub = {"none": rows["none"], CONTROL: rows[CONTROL], "auto": rows[f"auto:{d}"]}
            cell = summarise_cell(sub, bs, 0.0)
            auto = next(s for s in cell if s["config"] == "auto")
            verdict = auto_summary(cell, {(bs, 0.0): sub})[0]
            steps, drafts = (sum(r[k] for r in sub["auto"]) for k in ("verify_steps", "accepted_drafts"))
            out.append({"drafter": d, "batch": bs, "rounds": auto["rounds"], "plain_tok_s": plain,
                        "tok_s": auto["tok_s"], "vs_none": auto["vs_none"], "aa": verdict.get("aa"),
                        "tol": verdict["tol"], "aa_all": [round(r["tok_s"] / p["tok_s"], 3) for r, p in
                                                          zip(rows[CONTROL], rows["none"], strict=True)],
                        "tau_verify": (steps + drafts) / max(steps, 1), "verify_steps": steps,
                        "suffix_share": sum(r["accepted_suffix"] for r in sub["auto"]) / max(drafts, 1),
                        "plain_share": auto.get("plain_share"), "same": min(r["same"] for r in sub["auto"]),
                        **_step_cost(sub["auto"])})
    return out, {str(bs): rows for bs, rows in rows_by_bs.items()}


def _step_cost(rounds: list[dict]) -> dict:
    """The drafter's cost beside its gain (issue 49: size chosen by tau per CPU-second of drafting): median ms per
    timed step up to the drafter's logits (``draft_ms``: suffix lookup, step plan, drafter forward; 0 when every
    step drafted from the suffix index alone), of the tree
    (``build_ms``: top-K, pops, budget choice, tree) and of the verify forward, and ``draft_share`` =
    (draft + build) / (draft + build + verify forward)."""
    def med(key: str) -> float:
        vals = [r[key] for r in rounds if key in r]
        return statistics.median(vals) if vals else 0.0

    draft, build, verify = med("draft_ms"), med("build_ms"), med("verify_forward_ms")
    return {"draft_ms": draft, "build_ms": build, "verify_fwd_ms": verify,
            "draft_share": (draft + build) / max(draft + build + verify, 1e-9)}


def verdicts(tau_rows: list[dict], speed_rows: list[dict]) -> list[dict]:
    """Per drafter: each issue-49 aim, its measured value and whether it is met."""
    out = []
    for t in tau_rows:
        d = t["drafter"]
        out += [{"drafter": d, "aim": "DDTree tau", "target": TARGETS["tau_ddtree"], "value": t["tau_ddtree"]},
                {"drafter": d, "aim": "chain tau", "target": TARGETS["tau_chain"], "value": t["tau_chain"]}]
        for s in speed_rows:
            if s["drafter"] == d and s["batch"] in (1, 8):
                out.append({"drafter": d, "aim": f"batch {s['batch']} vs plain",
                            "target": TARGETS[f"speed_b{s['batch']}"], "value": s["vs_none"], "tol": s["tol"]})
    for v in out:
        v["met"] = v["value"] >= v["target"]
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafters", default="shipped", help="comma-separated: 'shipped' or drafter directories")
    ap.add_argument("--heldout", default=str(HELDOUT))
    ap.add_argument("--prompts", type=int, default=0, help="the first N held-out prompts (0: all)")
    ap.add_argument("--max-tokens", type=int, default=128, help="response limit, offline and speed")
    ap.add_argument("--budget", type=int, default=16, help="DDTree budget of the offline tau")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--round-prompts", type=int, default=8, help="distinct prompts per round (at least a batch)")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--train-data", default=None, help="a training data dir to check the held-out set against")
    ap.add_argument("--dtype", default="auto", help="the engines' dtype (auto: the server's default)")
    ap.add_argument("--kv-tokens", type=int, default=8192, help="KV pool per engine")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: no spinning on a shared CPU)")
    ap.add_argument("--draft-windows", default="none",
                    help="comma-separated context caps for the offline tau ('none': the whole context)")
    ap.add_argument("--out", default="bench_out/drafter.json")
    args = ap.parse_args(argv)
    windows = [None if w.strip() == "none" else int(w) for w in args.draft_windows.split(",")]
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from ddtree_serve.model_executor.default_model import ensure_default_model
    from ddtree_serve.speculative.train.trainer import target_embed_and_head

    mach = machine()
    print(f"[bench] {mach}", flush=True)
    t0 = time.perf_counter()
    drafters = resolve_drafters(args.drafters)
    held = load_heldout(args.heldout, args.prompts)
    model_path = str(ensure_default_model())
    tok = AutoTokenizer.from_pretrained(model_path)
    ids = chat_ids(tok, [h["prompt"] for h in held])
    cats = [h["category"] for h in held]
    payload: dict = {"machine": mach, "args": vars(args), "drafters": drafters, "prompts": len(held)}
    if args.train_data:
        payload["overlap"] = overlap_report([h["prompt"] for h in held], training_prompts(args.train_data, tok))
        print(f"[bench] held-out vs {args.train_data}: {payload['overlap']}", flush=True)
    embed, head = target_embed_and_head(model_path)
    tau_rows = []
    for d, path in drafters.items():
        model = load_drafter(path)
        recs = heldout_records(model_path, ids, tuple(model.target_layer_ids), args.max_tokens,
                               Path(args.out).parent / "drafter_records")
        for w in windows:
            t = time.perf_counter()
            model.draft_window = w
            label = d if w is None else f"{d}@{w}"
            res = offline_tau(model, embed, head, recs, cats, args.budget)
            tau_rows.append({"drafter": label, "draft_window": w, "prompts": len(recs), **res})
            print(f"[bench] {label}: offline tau chain {res['tau_chain']:.3f}, ddtree@{args.budget} "
                  f"{res['tau_ddtree']:.3f} over {res['tokens']} tokens ({time.perf_counter() - t:.0f} s)", flush=True)
    payload["offline"] = tau_rows
    speed_rows: list[dict] = []
    if not args.skip_speed:
        speed_rows, payload["rounds"] = speed(drafters, ids, args)
    payload["speed"] = speed_rows
    payload["aims"] = verdicts(tau_rows, speed_rows)
    print(f"\noffline tau on {len(held)} held-out chat prompts (greedy, up to {args.max_tokens} tokens):")
    print_table(tau_rows, ["drafter", "prompts", "tokens", "tau_chain", "tau_ddtree"])
    print("\nper category (chain / DDTree):")
    cat_rows = [{"category": c, **{d["drafter"]: f"{d['per_category'][c]['tau_chain']:.2f} / "
                                                 f"{d['per_category'][c]['tau_ddtree']:.2f}" for d in tau_rows}}
                for c in dict.fromkeys(cats)]
    print_table(cat_rows, ["category", *(r["drafter"] for r in tau_rows)])
    if speed_rows:
        print("\nspeed: default server (ddtree, auto budget, dflash + suffix) vs plain, greedy:")
        print_table(speed_rows, ["drafter", "batch", "rounds", "plain_tok_s", "tok_s", "vs_none", "aa", "tol",
                                 "tau_verify", "verify_steps", "suffix_share", "plain_share", "same"])
        print("\ndrafting cost per timed step, plain steps included (median over rounds, ms; compare draft_share):")
        print_table(speed_rows, ["drafter", "batch", "draft_ms", "build_ms", "verify_fwd_ms", "draft_share"])
    print("\nissue 49 aims:")
    print_table(payload["aims"], ["drafter", "aim", "target", "value", "tol", "met"])
    payload["seconds"] = time.perf_counter() - t0
    print(f"[bench] {payload['seconds']:.0f} s")
    write_json(args.out, payload)
    return payload


if __name__ == "__main__":
    main()
