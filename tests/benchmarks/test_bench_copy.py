"""bench_copy's pure parts: the prompt sets, the calls of a round, the raw counters and the verdict arithmetic on
hand-made rounds (the bench itself runs engines; none start here)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from benchmarks.bench_copy import (
    AGENT_CONVERSATIONS,
    COPY_PROMPTS,
    aims,
    by_source,
    calls_of,
    conversations,
    finish,
    merge,
    paired_ratio,
    prompt_sets,
    summarise,
)
from benchmarks.common import CHAT_PROMPTS


def _rows(tok_s: dict[str, dict[int, float]]) -> dict[str, list[dict]]:
    return {lab: [{"round": r, "tok_s": v} for r, v in sorted(by_round.items())] for lab, by_round in tok_s.items()}


def test_prompt_sets_are_chat_templated_and_sized(default_model_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_path)
    sets = prompt_sets(tok, ["copy", "agent", "chat"])
    assert [len(sets[k]) for k in ("copy", "agent", "chat")] == [len(COPY_PROMPTS), len(AGENT_CONVERSATIONS),
                                                                 len(CHAT_PROMPTS)]
    assert len(COPY_PROMPTS) >= 4 and len(AGENT_CONVERSATIONS) >= 2
    for name in ("copy", "agent"):  # short enough for a cheap prefill, long enough to have something to copy
        assert all(100 <= len(ids) <= 400 for ids in sets[name]), (name, [len(x) for x in sets[name]])
    assert len({tuple(x) for x in sets["copy"]}) == len(COPY_PROMPTS)  # distinct prompts
    text = tok.decode(sets["agent"][0])
    assert "<|im_start|>tool" in text and "src/app/main.py" in text and text.endswith("<|im_start|>assistant\n")
    for conv in AGENT_CONVERSATIONS:  # the tool result sits between the call and the user's ask
        assert [m["role"] for m in conv] == ["user", "assistant", "tool", "user"]
    with pytest.raises(ValueError):
        conversations("poetry")


def test_calls_cycle_the_set_to_whole_batches():
    assert calls_of(5, 1) == [[0], [1], [2], [3], [4]]
    assert calls_of(5, 8) == [[0, 1, 2, 3, 4, 0, 1, 2]]
    assert calls_of(3, 2) == [[0, 1], [2, 0]]
    assert calls_of(8, 8) == [list(range(8))]


def test_by_source_prefers_the_dict_and_falls_back_to_the_suffix_count():
    assert by_source(SimpleNamespace(spec_accepted_by_source={"dflash": 3, "suffix": 5})) == {"dflash": 3, "suffix": 5}
    assert by_source(SimpleNamespace(spec_accepted_tokens=10, spec_accepted_suffix=4)) == {"dflash": 6, "suffix": 4}
    assert by_source(SimpleNamespace()) == {}


def test_merge_and_finish_sum_calls_then_derive_the_row():
    a = {"generated": 30, "wall_s": 1.0, "steps": 10, "accepted": 20, "budget_sum": 80,
         "by_source": {"dflash": 5, "suffix": 15}}
    b = {"generated": 10, "wall_s": 1.0, "steps": 10, "accepted": 0, "budget_sum": 0, "by_source": {}}
    raw = merge(merge(None, a), b)
    raw = merge(raw, {"same": 1, "requests": 2})
    row = finish(raw)
    assert row["tok_s"] == pytest.approx(20.0)
    assert row["tau"] == pytest.approx((20 + 20) / 20)
    assert row["budget"] == pytest.approx(4.0)
    assert row["suffix_share"] == pytest.approx(0.75)
    assert row["same"] == pytest.approx(0.5)
    plain = finish({"generated": 8, "wall_s": 2.0})
    assert plain == {"tok_s": 4.0, "generated": 8, "wall_s": 2.0}


def test_paired_ratio_pairs_rounds_and_takes_the_median():
    """Round 1 is slow for everyone: paired ratios see through it, a ratio of medians would not."""
    rows = _rows({"plain": {0: 10.0, 1: 5.0, 2: 10.0}, "both": {0: 14.0, 1: 7.5, 2: 12.0}})
    assert paired_ratio(rows, "both") == pytest.approx(1.4)  # median of 1.4, 1.5, 1.2
    assert paired_ratio(rows, "plain") == 1.0
    assert paired_ratio(rows, "hf-pld") is None
    assert paired_ratio(rows, "plain", base="both") == pytest.approx(1 / 1.4)


def test_aims_check_copy_at_batch_1_and_chat_at_every_batch():
    rows_by_cell = {
        ("copy", 1): _rows({"plain": {0: 10.0, 1: 10.0}, "both": {0: 14.0, 1: 13.0}, "hf-pld": {0: 12.0, 1: 14.0}}),
        ("copy", 8): _rows({"plain": {0: 40.0}, "both": {0: 30.0}}),  # no bar at batch 8 on copy
        ("agent", 1): _rows({"plain": {0: 10.0}, "both": {0: 5.0}}),  # no bar on agent
        ("chat", 1): _rows({"plain": {0: 10.0, 1: 10.0}, "both": {0: 9.7, 1: 9.5}}),
        ("chat", 8): _rows({"plain": {0: 10.0}}),  # both did not run
    }
    got = {(a["set"], a["batch"], a["check"]): (a["value"], a["ok"]) for a in aims(rows_by_cell)}
    assert set(got) == {("copy", 1, "both/plain"), ("copy", 1, "both/hf-pld"), ("chat", 1, "both/plain"),
                        ("chat", 8, "both/plain")}
    assert got[("copy", 1, "both/plain")] == (pytest.approx(1.35), True)  # median of 1.4, 1.3
    value, ok = got[("copy", 1, "both/hf-pld")]  # median of 14/12, 13/14
    assert value == pytest.approx((14 / 12 + 13 / 14) / 2) and ok is True
    assert got[("chat", 1, "both/plain")] == (pytest.approx(0.96), True)
    assert got[("chat", 8, "both/plain")] == (None, None)
    rows_by_cell[("chat", 1)]["both"][0]["tok_s"] = 9.0  # median 0.925 < 0.95
    assert not next(a["ok"] for a in aims(rows_by_cell) if (a["set"], a["batch"]) == ("chat", 1))


def test_summary_marks_sequential_prompt_lookup_at_batch_8():
    rows_by_cell = {("copy", 8): _rows({"plain": {0: 40.0, 1: 50.0}, "hf-pld": {0: 20.0, 1: 30.0}})}
    for rs in rows_by_cell[("copy", 8)].values():
        for r in rs:
            r["generated"] = 768
    rows_by_cell[("copy", 8)]["hf-pld"][0]["same"] = 1.0
    rows_by_cell[("copy", 8)]["hf-pld"][1]["same"] = 0.875
    s = {r["config"]: r for r in summarise(rows_by_cell)}
    assert s["hf-pld"]["mode"] == "sequential" and s["plain"]["mode"] == "batched"
    assert s["hf-pld"]["tok_s"] == pytest.approx(25.0) and s["hf-pld"]["vs_plain"] == pytest.approx((0.5 + 0.6) / 2)
    assert s["hf-pld"]["same"] == 0.875 and "same" not in s["plain"]
