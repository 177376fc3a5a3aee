"""benchmarks/bench_seeded.py on a short run: seeded sampled DDTree gives plain decoding's tokens in float32
(``same`` 1.0), and the table's fields are there."""

from __future__ import annotations


def test_bench_seeded_short_run(tmp_path, default_model_path) -> None:
    from benchmarks.bench_seeded import main

    out = main(["--dtypes", "float32", "--batch-sizes", "2", "--rounds", "1", "--max-tokens", "12",
                "--configs", "plain,ddtree16", "--out", str(tmp_path / "seeded.json")])
    rows = {r["config"]: r for r in out["rows"]}
    assert rows["plain"]["same"] == 1.0 and rows["ddtree16"]["same"] == 1.0
    assert rows["ddtree16"]["tau"] is not None and rows["ddtree16"]["tau"] >= 1.0
    assert (tmp_path / "seeded.json").exists()
