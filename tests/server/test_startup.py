"""Start-up resolves the model path, drafter path and device once (server/startup.py); everything below
(make_scheduler, Scheduler, the TP ranks) takes the resolved configuration as it is."""

from __future__ import annotations

import json

import pytest

from model_executor.default_drafter import default_drafter_path
from server.config import ServerConfig
from server.scheduler import Scheduler
from server.scheduler_factory import SchedulerLike, make_scheduler
from server.startup import is_resolved, resolve_config, resolve_device
from server.tp_protocol import TPScheduler


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
