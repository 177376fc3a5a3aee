"""The test helper ``write_random_drafter`` (tests/speculative/drafter_utils.py) on shallow targets: its drafter
captures only layers the target has (z-lab's 1..N-3 rule gave layer -1 on a 2-layer target, and the capture
failed), and the DDTree engine over a 2-layer target with it decodes plain greedy's tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ddtree_serve.server.engine import Engine, SamplingParams
from tests.conftest import write_tiny_llama_family
from tests.speculative.drafter_utils import write_random_drafter

VOCAB = 24


def _target_and_drafter(root: Path, depth: int) -> tuple[str, str, list[int]]:
    target = write_tiny_llama_family(root / f"t{depth}", "qwen3", vocab=VOCAB, seed=3, num_hidden_layers=depth)
    drafter = write_random_drafter(target, root / f"d{depth}", num_layers=1, block_size=4, seed=1, std=0.3)
    ids = json.loads((Path(drafter) / "config.json").read_text())["dflash_config"]["target_layer_ids"]
    return target, drafter, ids


@pytest.mark.parametrize("depth", [1, 2, 3, 5])
def test_drafter_layer_ids_are_target_layers(tmp_path: Path, depth: int) -> None:
    _, _, ids = _target_and_drafter(tmp_path, depth)
    assert ids and ids == sorted(set(ids)) and all(0 <= i < depth for i in ids), ids


def test_ddtree_over_a_two_layer_target_is_lossless(tmp_path: Path) -> None:
    target, drafter, ids = _target_and_drafter(tmp_path, 2)
    assert ids == [0, 1]
    # the drafter (capturing layers 0 and 1) beside suffix drafts: a tiny random target's greedy text repeats
    # itself, so the verified trees accept drafts and the equality does not rest on plain steps alone
    prompts = [[1, 2, 3, 4, 1, 2, 3, 4], [5, 6, 7, 5, 6, 7]]
    params = [SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)] * 2
    kw = dict(dtype="float32", max_total_tokens=4096)
    ref = Engine(target, **kw).generate(input_ids=prompts, sampling_params=params)
    spec = Engine(target, speculative_algorithm="ddtree", draft_model_path=drafter, ddtree_budget=8,
                  draft_sources="dflash,suffix", **kw)
    got = spec.generate(input_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert all(len(o.token_ids) == 48 for o in got)
    assert all(o.spec_verify_steps > 0 for o in got)  # every request went through tree steps
    assert any(o.spec_accepted_tokens > o.spec_verify_steps for o in got)  # some step accepted depth >= 2


def test_a_drafter_for_a_deeper_target_is_refused_at_load(tmp_path: Path) -> None:
    """A drafter whose target_layer_ids name layers the target lacks: a ValueError naming them at start-up."""
    target = write_tiny_llama_family(tmp_path / "t", "qwen3", vocab=VOCAB, seed=3, num_hidden_layers=2)
    deep = write_tiny_llama_family(tmp_path / "deep", "qwen3", vocab=VOCAB, seed=3, num_hidden_layers=6)
    drafter = write_random_drafter(deep, tmp_path / "d", num_layers=1, block_size=4, seed=1)
    ids = json.loads((Path(drafter) / "config.json").read_text())["dflash_config"]["target_layer_ids"]
    assert max(ids) >= 2
    with pytest.raises(ValueError, match=r"reads target layers \[.*\].*target has 2 layers"):
        Engine(target, speculative_algorithm="ddtree", draft_model_path=drafter, ddtree_budget=8,
               dtype="float32", max_total_tokens=4096)
