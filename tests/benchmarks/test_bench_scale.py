"""benchmarks/bench_scale.py on a short run: every cell's fields are there and consistent (never above the
device-bound ideal: the host's clock is honest; phases sum to at most the host time; DDTree emits more than a
token per request-step at accept_prob 0.9; the sync and launch counts and their sites are reported; graphs are
modelled by default, as the server captures them, and a replayed graph costs the host far fewer launches than an
eager forward, ``--cuda-graph-max-bs 0``)."""

from __future__ import annotations


def test_bench_scale_short_run(tmp_path) -> None:
    from benchmarks.bench_scale import main

    out = main(["--machines", "b300", "--batches", "1,8", "--budgets", "16", "--steps", "3", "--prompt-len", "8",
                "--accept-prob", "0.9", "--out", str(tmp_path / "scale.json")])
    rows = {(r["batch"], r["mode"]): r for r in out["rows"]}
    assert set(rows) == {(1, "plain"), (1, "ddtree@16"), (8, "plain"), (8, "ddtree@16")}
    for r in rows.values():
        assert r["machine"] == "b300" and r["tokens"] > 0 and r["device_ms"] > 0 and r["host_ms"] >= 0
        assert r["tok_s"] <= r["ideal_tok_s"] * 1.001 and 0 < r["of_ideal"] <= 1.001
        assert sum(r["phases_ms"].values()) <= r["host_ms"] * 1.05 + 0.5
        assert r["syncs"] >= 1 and 0 < r["launches"] < 1000  # graphed by default: replays, not ~8,500 launches
        assert r["eager"] == 0  # every decode forward (target and drafter) replays a captured graph
        assert abs(sum(r["sync_sites"].values()) - r["syncs"]) < 0.05
    assert rows[(1, "plain")]["tau"] == 1.0 and rows[(8, "ddtree@16")]["tau"] > 2.0
    assert (tmp_path / "scale.json").exists()

    eager = main(["--machines", "b300", "--batches", "8", "--budgets", "16", "--steps", "2", "--prompt-len", "8",
                  "--cuda-graph-max-bs", "0", "--out", str(tmp_path / "eager.json")])
    for r in eager["rows"]:  # an eager K2.6 forward alone launches ~8,500 kernels
        assert r["launches"] >= 8500 and r["eager"] >= 1 and r["host_ms"] > rows[(8, r["mode"])]["host_ms"]
