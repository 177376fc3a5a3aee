"""benchmarks/bench_drafter.py (issue 49 item 3): the held-out chat set is well formed, the overlap check
finds a held-out prompt hidden in a training data directory (self-written prompts and shard prompt tokens),
and a tiny run writes offline tau per drafter and category beside the speed rows and the aims."""

from __future__ import annotations

import json

import torch

from benchmarks.bench_drafter import (
    load_heldout,
    main,
    overlap_report,
    prompt_key,
    training_prompts,
    user_message,
)
from benchmarks.common import chat_ids


def test_heldout_set_is_diverse_single_turn_chat() -> None:
    rows = load_heldout()
    assert len(rows) == 48
    assert all(set(r) == {"category", "prompt"} and 5 <= len(r["prompt"].split()) <= 40 for r in rows)
    assert len({prompt_key(r["prompt"]) for r in rows}) == len(rows)  # no duplicates
    cats = [r["category"] for r in rows]
    assert len(set(cats)) >= 8 and len(set(cats[:9])) == 9  # interleaved: the first nine span every category


def test_overlap_check_reads_self_prompts_and_shards(tmp_path, default_model_path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_path)
    held = [r["prompt"] for r in load_heldout(n=6)]
    (tmp_path / "feat").mkdir()
    (tmp_path / "self_prompts.jsonl").write_text(json.dumps({"prompt": "  " + held[0].upper() + " "}) + "\n"
                                                 + json.dumps({"prompt": "Something else entirely."}) + "\n")
    ids = chat_ids(tok, [held[3], "Please answer this: " + held[4]])
    assert user_message(tok, ids[0]) == held[3]
    recs = [{"tokens": torch.tensor(i + [1, 2, 3], dtype=torch.int32), "prompt_len": len(i)} for i in ids]
    torch.save(recs, tmp_path / "feat" / "train_00000.pt")
    torch.save([{"tokens": torch.tensor(chat_ids(tok, [held[5]])[0]), "prompt_len": 5}],
               tmp_path / "feat" / "eval_00000.pt")  # the trainer's own held-out shard is not training data
    rep = overlap_report(held, training_prompts(tmp_path, tok))
    assert rep["train_prompts"] == 4 and rep["overlaps"] == 2 and rep["contained"] == 1
    assert rep["overlapping"] == [held[0], held[3], held[4]] and rep["held_out"] is False
    assert overlap_report(held[1:3], training_prompts(tmp_path, tok))["held_out"] is True


def test_bench_drafter_tiny_run(tmp_path, default_model_path) -> None:
    threads = torch.get_num_threads()
    try:  # the bench sets torch's threads (--threads 1) for the process: later tests must not inherit it
        out = main(["--prompts", "3", "--max-tokens", "16", "--rounds", "1", "--batch-sizes", "1,2",
                    "--round-prompts", "2", "--out", str(tmp_path / "drafter.json")])
    finally:
        torch.set_num_threads(threads)
    saved = json.loads((tmp_path / "drafter.json").read_text())
    assert saved["prompts"] == 3 and list(saved["drafters"]) == ["shipped"]
    (tau,) = saved["offline"]
    assert tau["tau_chain"] >= 1.0 and tau["tau_ddtree"] >= 1.0 and tau["tokens"] > 0
    assert set(tau["per_category"]) == {"writing", "roleplay", "reasoning"}
    assert all(c["tau_ddtree"] >= 1.0 for c in tau["per_category"].values())
    assert [(s["drafter"], s["batch"]) for s in saved["speed"]] == [("shipped", 1), ("shipped", 2)]
    for s in saved["speed"]:
        assert s["rounds"] == 1 and s["plain_tok_s"] > 0 and s["tok_s"] > 0 and s["vs_none"] > 0 and s["aa"] > 0
        assert s["verify_steps"] == 0 or s["tau_verify"] >= 1.0
        assert 0.0 <= s["same"] <= 1.0 and 0.0 <= s["suffix_share"] <= 1.0
    assert any(s["verify_steps"] > 0 for s in saved["speed"])  # the default server speculated
    for s in saved["speed"]:  # the drafting cost beside the gain (draft_ms is 0 when every step was suffix-only)
        assert 0.0 <= s["draft_share"] < 1.0 and s["draft_ms"] >= 0.0
        assert s["verify_steps"] == 0 or (s["verify_fwd_ms"] > 0 and s["draft_share"] > 0)
    assert {a["aim"] for a in saved["aims"]} == {"DDTree tau", "chain tau", "batch 1 vs plain"}
    assert out["offline"][0]["tau_ddtree"] == tau["tau_ddtree"]
    records = list((tmp_path / "drafter_records").glob("*.pt"))
    assert len(records) == 1  # cached: a rerun skips generation
    recs = torch.load(records[0])
    assert len(recs) == 3 and all(r["feats"].shape[0] == r["tokens"].numel() for r in recs)
