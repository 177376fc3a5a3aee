"""Start-up resolves the model path, drafter path and device once (ddtree_serve/server/startup.py); everything below
(make_scheduler, Scheduler, the TP ranks) takes the resolved configuration as it is."""

from __future__ import annotations

import json

import pytest

from ddtree_serve.model_executor.default_drafter import default_drafter_path
from ddtree_serve.server.config import ServerConfig
from ddtree_serve.server.scheduling.scheduler import Scheduler
from ddtree_serve.server.scheduling.scheduler_factory import SchedulerLike, make_scheduler
from ddtree_serve.server.startup import is_resolved, resolve_config, resolve_device
from ddtree_serve.server.tp.protocol import TPScheduler


def test_resolve_config_once_and_idempotent(default_model_path) -> None:
    cfg = ServerConfig.from_flat({"speculative_algorithm": "ddtree", "device": "auto"})
    assert not is_resolved(cfg)
    resolved = resolve_config(cfg)
    assert resolved.model.model_path == default_model_path
    assert resolved.model.device == resolve_device("auto") and resolved.model.device in ("cpu", "cuda")
    assert resolved.speculative.draft_model_path == default_drafter_path()
    assert is_resolved(resolved) and resolve_config(resolved) == resolved
    plain = resolve_config(ServerConfig.from_flat({"device": "cpu"}))
    assert plain.speculative.draft_model_path is None and plain.model.device == "cpu"


def test_bad_paths_fail_before_loading(tmp_path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        resolve_config(ServerConfig.from_flat({"model_path": str(tmp_path / "missing")}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"auto_map": {"AutoTokenizer": "tok.Tok"}}))
    with pytest.raises(ValueError, match="trust_remote_code"):
        resolve_config(ServerConfig.from_flat({"model_path": str(tmp_path), "trust_remote_code": False}))


def test_builders_refuse_an_unresolved_config() -> None:
    for build in (Scheduler, make_scheduler):
        with pytest.raises(ValueError, match="resolved config"):
            build(ServerConfig())


def test_both_schedulers_declare_the_protocol() -> None:
    """TPScheduler's side (the TP tests check a live one; test_engine a live Scheduler)."""
    members = [m for m in vars(SchedulerLike) if not m.startswith("_")]
    assert {"add_request", "abort_request", "has_work", "step", "stats", "close", "running", "waiting"} <= set(members)
    for name in members:
        assert hasattr(TPScheduler, name), name
    for name in ("add_request", "abort_request", "has_work", "step", "stats", "close"):
        assert callable(getattr(Scheduler, name)), name
    assert not hasattr(TPScheduler, "__getattr__")


KIMI_PRESET = "configs/kimi-k2.6-8x-b300.yaml"


def _serve(argv: list[str], capsys) -> tuple[int, str]:
    from ddtree_serve.server.cli.main import main

    rc = main(["serve", *argv])
    return rc, capsys.readouterr().err


def test_missing_or_wrong_drafter_fails_before_the_target_loads(tmp_path, capsys) -> None:
    """The target directory holds config.json only: any attempt to load its weights would fail otherwise.
    The Kimi preset's drafter path is missing here; a target directory or another target's drafter is not it."""
    target = tmp_path / "kimi"
    target.mkdir()
    (target / "config.json").write_text(open("tests/data/kimi-k2.6-config.json").read())
    base = ["--config", KIMI_PRESET, "--model-path", str(target), "--device", "cpu"]
    rc, err = _serve(base, capsys)
    assert rc == 2 and "--speculative-draft-model-path '/models/Kimi-K2.6-DFlash' does not exist" in err
    assert "z-lab/Kimi-K2.6-DFlash" in err and "--speculative-draft-sources suffix" in err
    assert "is not a model directory" not in err
    rc, err = _serve([*base, "--speculative-draft-model-path", str(target)], capsys)
    assert rc == 2 and "--speculative-draft-model-path" in err and "is not a DFlash drafter" in err
    drafter = tmp_path / "dflash"  # a drafter trained for a target of hidden size 64, not 7168
    drafter.mkdir()
    (drafter / "config.json").write_text(json.dumps({"architectures": ["DFlashDraftModel"], "hidden_size": 64,
                                                      "dflash_config": {"mask_token_id": 0}}))
    rc, err = _serve([*base, "--speculative-draft-model-path", str(drafter)], capsys)
    assert rc == 2 and "is a drafter for another target (hidden size 64, the target's 7168)" in err
    (tmp_path / "empty").mkdir()
    rc, err = _serve([*base, "--speculative-draft-model-path", str(tmp_path / "empty")], capsys)
    assert rc == 2 and "holds no config.json" in err


def test_kimi_preset_serves_without_a_drafter_on_suffix_drafts(tmp_path) -> None:
    """The documented command for the presets without the drafter: suffix drafts alone, no drafter loaded."""
    import argparse

    from ddtree_serve.server.cli import serve as cli_serve
    from ddtree_serve.server.cli.args import config_from_args
    from tests.model_executor.tiny_deepseek import write_tiny_deepseek

    kimi = write_tiny_deepseek(tmp_path / "kimi", int4=True, kimi=True).path
    parser = argparse.ArgumentParser()
    cli_serve.add_arguments(parser)
    args = parser.parse_args(["--config", KIMI_PRESET, "--model-path", kimi, "--device", "cpu",
                              "--speculative-draft-sources", "suffix", "--speculative-draft-model-path", "",
                              "--context-length", "256", "--max-running-requests", "2", "--max-total-tokens", "1024"])
    config = resolve_config(config_from_args(args))
    assert config.speculative.draft_sources == "suffix" and not config.speculative.uses_drafter
    scheduler = Scheduler(config)
    assert scheduler.spec.drafter is None and scheduler.spec.suffix is not None
