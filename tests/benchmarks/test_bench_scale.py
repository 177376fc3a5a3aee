"""benchmarks/bench_scale.py on a short run: every cell's fields are there and consistent (the device-bound
ideal is above the measured rate, phases sum to at most the host time, DDTree emits more than a token per
request-step at accept_prob 0.9)."""

from __future__ import annotations


def test_bench_scale_short_run(tmp_path) -> None:
    from benchmarks.bench_scale import main

    out = main(["--batches", "1,8", "--budgets", "16", "--steps", "3", "--prompt-len", "8", "--accept-prob", "0.9",
                "--out", str(tmp_path / "scale.json")])
    rows = {(r["batch"], r["mode"]): r for r in out["rows"]}
    assert set(rows) == {(1, "plain"), (1, "ddtree@16"), (8, "plain"), (8, "ddtree@16")}
    for r in rows.values():
        assert r["tokens"] > 0 and r["device_ms"] > 0 and r["host_ms"] >= 0
        assert r["tok_s"] <= r["ideal_tok_s"] * 1.05  # the ideal counts device time only
        assert sum(r["phases_ms"].values()) <= r["host_ms"] * 1.05 + 0.5
    assert rows[(1, "plain")]["tau"] == 1.0 and rows[(8, "ddtree@16")]["tau"] > 2.0
    assert (tmp_path / "scale.json").exists()
