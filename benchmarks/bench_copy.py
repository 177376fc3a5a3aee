"""Copy-heavy decoding with suffix drafts: tokens/s of plain decoding (``plain``), DDTree with DFlash drafts only
(``dflash``), suffix drafts only (``suffix``) and both merged (``both``, the default configuration), next to
transformers' generate with prompt lookup decoding (``hf-pld``, ``prompt_lookup_num_tokens=10``) and plain
transformers generate (``hf``), all on the default model in float32, greedy, in one run, on three prompt sets
chat-templated with the model's tokenizer: ``copy`` (repeat a code block / JSON / YAML / paragraph verbatim or
with a small edit), ``agent`` (multi-turn: a tool message returned a file listing / an API response / a source
file, and the user asks to quote it back or edit it) and ``chat`` (``common.CHAT_PROMPTS``).

Every configuration has its own engine (transformers: one model for both rows), built once, warmed up alike and
kept the whole run. Each (set, batch size) cell runs ``--rounds`` INTERLEAVED rounds: a round serves every
prompt of the set (cycled to a multiple of the batch size) in calls of ``batch`` requests, every configuration
runs each call in turn, the order rotated call by call, so that the machine's drift hits all alike. tokens/s =
generated tokens / wall seconds of whole generate calls (prefill included; EOS ends a request). ``vs_plain``:
median over rounds of the round's tokens/s over plain's in the same round (paired). ``tau`` = (accepted +
verify steps) / verify steps; ``budget``: mean tree nodes per verify step (0: auto chose plain steps);
``suffix_share``: the share of accepted draft tokens the suffix source proposed. Transformers' prompt lookup
takes one sequence at a time: at batch 8 ``hf-pld`` runs the call's prompts ONE AFTER ANOTHER (``mode``
sequential); ``hf`` runs them as one left-padded batch. Greedy is lossless: every ddtree configuration's token
ids must equal plain's (a warning line if not; ``same``: the least share of a round's requests equal to
plain's, shown for hf too, whose float32 kernels differ from ours). Before every call the suffix source's
shared index of recent outputs is emptied, else from round 2 on it would hold the answer to the very same
prompt (``--keep-suffix-cache`` keeps it); the engines' prefix cache is off likewise (``--prefix-cache``).
Last, the issue's aims: on copy at batch 1 both >= 1.3x plain and >= hf-pld; on chat both >= 0.95x plain.

    python benchmarks/bench_copy.py [--configs plain,dflash,suffix,both,both@16,hf-pld,hf] [--sets copy,agent,chat]
        [--batch-sizes 1,8] [--rounds 3] [--max-tokens 96] [--kv-tokens 16384] [--threads N]
        [--keep-suffix-cache] [--prefix-cache] [--out bench_out/copy.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import CHAT_PROMPTS, machine, print_table, write_json  # noqa: E402
from ddtree_serve.server.engine import Engine, SamplingParams  # noqa: E402

_DDTREE = {"speculative_algorithm": "ddtree", "ddtree_budget": "auto"}
ENGINE_KW = {"plain": {"speculative_algorithm": "none"},
             "dflash": {**_DDTREE, "draft_model_path": "default", "draft_sources": "dflash"},
             "suffix": {**_DDTREE, "draft_sources": "suffix"},
             "both": {**_DDTREE, "draft_model_path": "default", "draft_sources": "dflash,suffix"}}
HF_CONFIGS = ("hf-pld", "hf")
ALL_CONFIGS = (*ENGINE_KW, *HF_CONFIGS)
DEFAULT = "both"
PLD_TOKENS = 10

_CODE = '''def load_config(path: str) -> dict:
    """Read a TOML file and fill in the defaults."""
    with open(path, "rb") as f:
        data = tomllib.load(f)
    data.setdefault("host", "127.0.0.1")
    data.setdefault("port", 8080)
    data.setdefault("workers", 4)
    if data["port"] < 1024:
        raise ValueError(f"port {data['port']} needs root")
    return data


def total_size(paths: list[str]) -> int:
    total = 0
    for p in paths:
        total += os.path.getsize(p)
    return total
'''
_JSON = json.dumps({"id": 4172, "name": "Ada Lovelace", "email": "ada@example.org", "roles": ["admin", "editor"],
                    "address": {"street": "12 St James Square", "city": "London", "postcode": "SW1Y 4JH"},
                    "active": True, "last_login": "2024-03-18T09:41:27Z", "quota_mb": 2048}, indent=2)
_YAML = ("server:\n  host: 0.0.0.0\n  port: 8443\n  tls:\n    cert: /etc/ssl/certs/api.pem\n"
         "    key: /etc/ssl/private/api.key\ndatabase:\n  url: postgres://app@db.internal:5432/orders\n"
         "  pool_size: 20\n  timeout_s: 30\nlogging:\n  level: info\n  format: json\n")
_PARAGRAPH = ("The river runs through the old town, past the mill and under the stone bridge. In spring the river "
              "rises and floods the meadows, and the children of the town watch the river carry branches and "
              "leaves down to the sea. In summer the river is slow and warm, and the fishermen sit on its banks "
              "from dawn until the light fades.")
COPY_PROMPTS = [
    f"Repeat this code exactly:\n```python\n{_CODE}```",
    f"Repeat this JSON exactly:\n```json\n{_JSON}\n```",
    f"Copy this paragraph, replacing 'the river' with 'the canal':\n{_PARAGRAPH}",
    f"Here is a config file:\n```yaml\n{_YAML}```\nWrite the same file with the port changed to 9443.",
    f"Rewrite this code with the variable `total` renamed to `acc`; change nothing else:\n```python\n{_CODE}```",
]
_LISTING = "\n".join(f"{s:>8}  2024-05-{d:02d}  {p}" for s, d, p in [
    (1204, 2, "README.md"), (389, 2, "pyproject.toml"), (15872, 9, "src/app/main.py"),
    (7310, 9, "src/app/routes.py"), (2291, 11, "src/app/models.py"), (988, 11, "src/app/config.py"),
    (4410, 14, "tests/test_routes.py"), (1733, 14, "tests/test_models.py"), (256, 15, ".github/workflows/ci.yml")])


def _tool_turn(user: str, call: str, result: str, ask: str) -> list[dict]:
    return [{"role": "user", "content": user},
            {"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
            {"role": "tool", "content": result},
            {"role": "user", "content": ask}]


AGENT_CONVERSATIONS = [
    _tool_turn("What files are in the project?", '{"name": "list_dir", "arguments": {"path": ".", "long": true}}',
               f"```\n{_LISTING}\n```", "Copy the file listing above into your answer exactly."),
    _tool_turn("Look up user 4172.", '{"name": "http_get", "arguments": {"url": "/api/users/4172"}}', _JSON,
               "Repeat the JSON response above exactly, in a json code block."),
    _tool_turn("Open src/app/config.py.", '{"name": "read_file", "arguments": {"path": "src/app/config.py"}}',
               _CODE, "Change the default port to 9090 and show me the whole file."),
]


def engine_kw(label: str) -> dict | None:
    """Engine arguments of a configuration: a name of ENGINE_KW, or ``<ddtree config>@<budget>`` for a fixed
    tree budget instead of auto (``both@16``); None for anything else."""
    name, _, budget = label.partition("@")
    if name not in ENGINE_KW or (budget and (name == "plain" or not budget.isdigit() or int(budget) < 1)):
        return None
    return {**ENGINE_KW[name], "ddtree_budget": int(budget)} if budget else ENGINE_KW[name]


def conversations(name: str) -> list[list[dict]]:
    """The chat messages of prompt set ``name`` (copy, agent or chat)."""
    if name not in ("copy", "agent", "chat"):
        raise ValueError(f"unknown prompt set {name!r} (copy, agent, chat)")
    single = COPY_PROMPTS if name == "copy" else CHAT_PROMPTS
    return AGENT_CONVERSATIONS if name == "agent" else [[{"role": "user", "content": p}] for p in single]


def prompt_sets(tokenizer, names: list[str]) -> dict[str, list[list[int]]]:
    """Set name -> its prompts' token ids (chat template with the generation prompt)."""
    def ids(msgs: list[dict]) -> list[int]:
        out = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    return {name: [ids(m) for m in conversations(name)] for name in names}


def calls_of(n_prompts: int, bs: int) -> list[list[int]]:
    """A round's calls: prompt indices, the set cycled to a multiple of ``bs`` (at least one full batch)."""
    n = -(-max(n_prompts, bs) // bs) * bs
    order = [i % n_prompts for i in range(n)]
    return [order[i:i + bs] for i in range(0, n, bs)]


def forget_outputs(engine: Engine) -> None:
    """Empty the suffix source's shared index of recent outputs (no-op without one)."""
    prop = getattr(getattr(engine.scheduler, "spec", None), "suffix", None)
    if prop is not None and getattr(prop, "shared", None) is not None:
        prop.shared = type(prop.shared)(prop.config)


def by_source(out) -> dict[str, int]:
    """Accepted draft tokens by source (``spec_accepted_by_source``, else from ``spec_accepted_suffix``)."""
    d = getattr(out, "spec_accepted_by_source", None)
    if d is None and hasattr(out, "spec_accepted_suffix"):
        d = {"dflash": out.spec_accepted_tokens - out.spec_accepted_suffix, "suffix": out.spec_accepted_suffix}
    return dict(d or {})


def run_engine(engine: Engine, ids: list[list[int]], n: int, reset: bool) -> tuple[list[list[int]], dict]:
    """One generate call: the requests' token ids and raw counters."""
    if reset:
        forget_outputs(engine)
    t = time.perf_counter()
    outs = engine.generate(input_ids=ids, sampling_params=SamplingParams(temperature=0, max_tokens=n))
    raw: dict = {"generated": sum(len(o.token_ids) for o in outs), "wall_s": time.perf_counter() - t}
    if engine.scheduler.spec is not None:
        raw.update(steps=sum(o.spec_verify_steps for o in outs), accepted=sum(o.spec_accepted_tokens for o in outs),
                   budget_sum=sum(o.spec_budget_sum for o in outs),
                   by_source=dict(sum((Counter(by_source(o)) for o in outs), Counter())))
    return [list(o.token_ids) for o in outs], raw


def run_hf(model, ids: list[list[int]], n: int, pad: int, eos: set[int], pld: bool) -> tuple[list[list[int]], dict]:
    """transformers generate: with prompt lookup one prompt at a time, else one left-padded batch."""
    toks: list[list[int]] = []
    t = time.perf_counter()
    for group in ([x] for x in ids) if pld else [ids]:
        width = max(map(len, group))
        batch = torch.tensor([[pad] * (width - len(x)) + x for x in group])
        mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(x) for x in group])[:, None]).long()
        kw = {"prompt_lookup_num_tokens": PLD_TOKENS} if pld else {}
        with torch.no_grad():
            out = model.generate(batch, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=pad, **kw)
        for row in out[:, width:].tolist():
            end = next((i + 1 for i, tok in enumerate(row) if tok in eos), len(row))
            toks.append(row[:end])
    return toks, {"generated": sum(map(len, toks)), "wall_s": time.perf_counter() - t}


def merge(a: dict | None, b: dict) -> dict:
    """Raw counters of two calls, summed (dicts key by key)."""
    if a is None:
        return b
    return {k: dict(Counter(a.get(k) or {}) + Counter(b.get(k) or {}))
            if isinstance(a.get(k), dict) or isinstance(b.get(k), dict) else a.get(k, 0) + b.get(k, 0)
            for k in a.keys() | b.keys()}


def finish(raw: dict) -> dict:
    """A round's row from its raw counters."""
    row = {"tok_s": raw["generated"] / raw["wall_s"], "generated": raw["generated"], "wall_s": raw["wall_s"]}
    if raw.get("steps"):
        row["tau"] = (raw["accepted"] + raw["steps"]) / raw["steps"]
        row["budget"] = raw["budget_sum"] / raw["steps"]
    total = sum(raw.get("by_source", {}).values())
    if total:
        row["suffix_share"] = raw["by_source"].get("suffix", 0) / total
    if raw.get("requests"):
        row["same"] = raw["same"] / raw["requests"]
    return row


def strip_eos(ids: list[int], eos: set[int]) -> list[int]:
    return ids[:-1] if ids and ids[-1] in eos else ids


def paired_ratio(rows: dict[str, list], label: str, base: str = "plain") -> float | None:
    """Median over the rounds both ran of ``label``'s tokens/s over ``base``'s in the same round."""
    if label not in rows or base not in rows:
        return None
    by_round = {r["round"]: r["tok_s"] for r in rows[base]}
    ratios = [r["tok_s"] / by_round[r["round"]] for r in rows[label] if r["round"] in by_round]
    return statistics.median(ratios) if ratios else None


def summarise(rows_by_cell: dict) -> list[dict]:
    """Per (set, batch, configuration): median tokens/s, tau and suffix share, paired ratio to plain."""
    out = []
    for (name, bs), rows in rows_by_cell.items():
        for lab, rs in rows.items():
            s = {"set": name, "batch": bs, "config": lab, "rounds": len(rs),
                 "mode": "sequential" if lab == "hf-pld" and bs > 1 else "batched",
                 "tok_s": statistics.median(r["tok_s"] for r in rs), "vs_plain": paired_ratio(rows, lab),
                 "generated": statistics.median(r["generated"] for r in rs)}
            for key in ("tau", "budget", "suffix_share", "same"):
                vals = [r[key] for r in rs if key in r]
                if vals:
                    s[key] = statistics.median(vals) if key != "same" else min(vals)
            out.append(s)
    return out


def aims(rows_by_cell: dict) -> list[dict]:
    """The issue's bars for the default configuration, as paired ratios: copy at batch 1 >= 1.3x plain and
    >= 1.0x hf-pld; chat at every batch >= 0.95x plain. ``ok`` None where a configuration did not run."""
    out = []
    for (name, bs), rows in rows_by_cell.items():
        checks = []
        if name == "copy" and bs == 1:
            checks = [("plain", 1.3), ("hf-pld", 1.0)]
        elif name == "chat":
            checks = [("plain", 0.95)]
        for base, bar in checks:
            v = paired_ratio(rows, DEFAULT, base)
            out.append({"set": name, "batch": bs, "check": f"{DEFAULT}/{base}", "bar": bar, "value": v,
                        "ok": None if v is None else v >= bar})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=",".join(ALL_CONFIGS), help="plain always runs (the ratios' base)")
    ap.add_argument("--sets", default="copy,agent,chat")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--kv-tokens", type=int, default=16384, help="KV pool per engine (several are alive at once)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--keep-suffix-cache", action="store_true",
                    help="keep the suffix source's shared index of recent outputs between calls")
    ap.add_argument("--prefix-cache", action="store_true", help="keep the engines' prefix (radix) cache on")
    ap.add_argument("--out", default="bench_out/copy.json")
    args = ap.parse_args()
    labels = ["plain"] + [c for c in dict.fromkeys(args.configs.split(",")) if c and c != "plain"]
    unknown = [c for c in labels if c not in ALL_CONFIGS and engine_kw(c) is None]
    if unknown:
        ap.error(f"unknown configs {unknown}; choose from {','.join(ALL_CONFIGS)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    mach = machine()
    print(f"[bench] {mach}", flush=True)
    t0 = time.perf_counter()
    n, reset = args.max_tokens, not args.keep_suffix_cache
    runners, engines = {}, []
    for lab in (c for c in labels if engine_kw(c) is not None):
        print(f"[bench] engine {lab}: {engine_kw(lab)}", flush=True)
        engine = Engine("default", dtype="float32", max_total_tokens=args.kv_tokens,
                        disable_radix_cache=not args.prefix_cache, **engine_kw(lab))
        engines.append(engine)
        runners[lab] = lambda ids, e=engine: run_engine(e, ids, n, reset)
    tokenizer = engines[0].tokenizer
    eos = set(engines[0].scheduler.eos_token_ids)
    if any(c in HF_CONFIGS for c in labels):
        import transformers

        from ddtree_serve.model_executor.default_model import ensure_default_model

        transformers.logging.set_verbosity_error()  # generation_config's sampling fields under do_sample=False
        hf = transformers.AutoModelForCausalLM.from_pretrained(ensure_default_model(), dtype=torch.float32).eval()
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos)
        for lab in (c for c in labels if c in HF_CONFIGS):
            runners[lab] = lambda ids, pld=lab == "hf-pld": run_hf(hf, ids, n, pad, eos, pld)
    warm = prompt_sets(tokenizer, ["chat"])["chat"][-1:]  # the same one request of --max-tokens for everyone
    for lab in labels:
        runners[lab](warm)
    sets = prompt_sets(tokenizer, args.sets.split(","))
    print("[bench] prompt tokens: " + "  ".join(f"{k} {min(map(len, v))}-{max(map(len, v))}" for k, v in sets.items()),
          flush=True)
    cells = [(name, int(b)) for name in sets for b in args.batch_sizes.split(",")]
    rows_by_cell: dict = {c: {} for c in cells}
    warned: set = set()
    for name, bs in cells:
        calls = calls_of(len(sets[name]), bs)
        for rnd in range(args.rounds):
            raw: dict[str, dict | None] = dict.fromkeys(labels)
            for j, idx in enumerate(calls):
                ids = [sets[name][i] for i in idx]
                rot = (rnd + j) % len(labels)
                got = {}
                for lab in labels[rot:] + labels[:rot]:
                    got[lab], r = runners[lab](ids)
                    raw[lab] = merge(raw[lab], r)
                for lab in labels[1:]:  # lossless: greedy ids equal plain's
                    same = [strip_eos(a, eos) == strip_eos(b, eos) for a, b in zip(got[lab], got["plain"], strict=True)]
                    raw[lab] = merge(raw[lab], {"same": sum(same), "requests": len(same)})
                    for i, ok in zip(idx, same, strict=True):
                        if not ok and engine_kw(lab) is not None and (name, bs, lab, i) not in warned:
                            warned.add((name, bs, lab, i))
                            print(f"[bench] WARNING: {lab} differs from plain on {name}[{i}] at batch {bs} "
                                  "(greedy should be lossless)", flush=True)
            for lab in labels:
                rows_by_cell[(name, bs)].setdefault(lab, []).append({**finish(raw[lab]), "round": rnd})
            last = "  ".join(f"{lab} {rows_by_cell[(name, bs)][lab][-1]['tok_s']:.1f}" for lab in labels)
            print(f"[bench] {name} batch={bs} round {rnd + 1}/{args.rounds} tok/s: {last}  "
                  f"[{time.perf_counter() - t0:.0f} s]", flush=True)
    for e in engines:
        e.shutdown()
    summary = summarise(rows_by_cell)
    print_table(summary, ["set", "batch", "config", "mode", "rounds", "tok_s", "vs_plain", "tau", "budget",
                          "suffix_share", "same", "generated"])
    checks = aims(rows_by_cell)
    if checks:
        print(f"\naims of the default configuration ({DEFAULT}; medians of per-round paired ratios):")
        print_table(checks, ["set", "batch", "check", "bar", "value", "ok"])
    print(f"[bench] {time.perf_counter() - t0:.0f} s")
    write_json(args.out, {"machine": mach, "args": vars(args), "summary": summary, "aims": checks,
                          "warnings": [list(w) for w in sorted(warned)],
                          "rounds": {f"{k},{b}": rows for (k, b), rows in rows_by_cell.items()},
                          "seconds": time.perf_counter() - t0})


if __name__ == "__main__":
    main()
