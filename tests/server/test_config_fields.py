"""One definition per configuration field: help and valid values in the dataclass field, one flag per field
by the one flat-name rule, validation in ``__post_init__`` (the same for flags, presets and Engine kwargs)."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from ddtree_serve.server.cli.args import add_server_arguments
from ddtree_serve.server.config import (
    SETTING,
    CacheArgs,
    ModelArgs,
    ParallelArgs,
    SchedulerArgs,
    ServerArgs,
    ServerConfig,
    Setting,
    SpeculativeArgs,
    area_classes,
    config_fields,
    field_kinds,
    flat_name,
)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_server_arguments(p)
    return p


def test_every_field_has_help_and_exactly_one_flag() -> None:
    actions = [a for a in _parser()._actions if a.dest not in ("help", "config")]
    by_dest: dict[str, list[argparse.Action]] = {}
    for a in actions:
        by_dest.setdefault(a.dest, []).append(a)
    flats = []
    for flat, _, klass, f in config_fields():
        meta = f.metadata.get(SETTING)
        assert isinstance(meta, Setting) and meta.help.strip().endswith("."), f"{flat}: no help text"
        assert flat == flat_name(klass, f.name) == klass.PREFIX + f.name
        assert len(by_dest.get(flat, [])) == 1, f"{flat}: {len(by_dest.get(flat, []))} flags"
        action = by_dest[flat][0]
        assert action.option_strings[0] == "--" + flat.replace("_", "-")
        assert meta.help in action.help and (meta.default_help or repr(f.default)) in action.help
        flats.append(flat)
    assert len(flats) == len(set(flats)) == len(by_dest)  # no flag without a field, no name shared
    assert set(area_classes()) == {f.name for f in dataclasses.fields(ServerConfig)}


def test_flat_names_keep_the_public_spellings() -> None:
    names = {flat for flat, *_ in config_fields()}
    for flat in ("model_path", "speculative_algorithm", "speculative_draft_model_path", "speculative_ddtree_budget",
                 "speculative_ddtree_max_budget", "speculative_block_size", "tp_size", "max_total_tokens", "port"):
        assert flat in names
    bare = {f.name for _, _, klass, f in config_fields() if klass.PREFIX}
    assert not bare & names, "a short Engine name would shadow another field"


def test_defaults_are_valid_and_choices_are_the_flag_choices() -> None:
    for klass in area_classes().values():
        klass()  # every default passes its own __post_init__
    p = _parser()
    dtype = next(a for a in p._actions if a.dest == "dtype")
    assert tuple(dtype.choices) == dataclasses.fields(ModelArgs)[1].metadata[SETTING].choices


@pytest.mark.parametrize(
    ("klass", "kwargs", "name"),
    [
        (ModelArgs, dict(dtype="int8"), "dtype"),
        (ModelArgs, dict(device="tpu"), "device"),
        (ModelArgs, dict(cuda_graph_max_bs=-1), "cuda_graph_max_bs"),
        (ModelArgs, dict(context_length="long"), "context_length"),
        (ModelArgs, dict(trust_remote_code="yes"), "trust_remote_code"),
        (CacheArgs, dict(mem_fraction_static=0.0), "mem_fraction_static"),
        (CacheArgs, dict(kv_memory_gb=0), "kv_memory_gb"),
        (SchedulerArgs, dict(max_running_requests=0), "max_running_requests"),
        (SpeculativeArgs, dict(algorithm="medusa"), "speculative_algorithm"),
        (SpeculativeArgs, dict(ddtree_budget=0), "speculative_ddtree_budget"),
        (SpeculativeArgs, dict(ddtree_budget="sometimes"), "speculative_ddtree_budget"),
        (SpeculativeArgs, dict(ddtree_budget=True), "speculative_ddtree_budget"),
        (SpeculativeArgs, dict(ddtree_max_budget=0), "speculative_ddtree_max_budget"),
        (SpeculativeArgs, dict(accept_threshold_acc=1.5), "speculative_accept_threshold_acc"),
        (SpeculativeArgs, dict(block_size=1), "speculative_block_size"),
        (ParallelArgs, dict(tp_size=0), "tp_size"),
        (ServerArgs, dict(port=70000), "port"),
        (ServerArgs, dict(port=80.5), "port"),
        (ServerArgs, dict(tool_call_parser="xml"), "tool_call_parser"),
        (ServerArgs, dict(max_request_body_bytes=10), "max_request_body_bytes"),
        (ServerArgs, dict(max_prompt_tokens=0), "max_prompt_tokens"),
        (ServerArgs, dict(max_waiting_requests=-1), "max_waiting_requests"),
    ],
)
def test_invalid_values_raise_from_post_init(klass, kwargs, name) -> None:
    with pytest.raises(ValueError, match=rf"^{name} must be"):
        klass(**kwargs)
    with pytest.raises(ValueError, match=rf"^{name} must be"):  # the same check through every entry point
        ServerConfig.from_flat({name: next(iter(kwargs.values()))})


def test_valid_edge_values_and_normalisation(tmp_path) -> None:
    spec = SpeculativeArgs(ddtree_budget=1, accept_threshold_single=0, block_size=2)
    assert spec.ddtree_budget == 1 and spec.lossy
    assert CacheArgs(mem_fraction_static=1, kv_memory_gb=2).mem_fraction_static == 1  # ints for floats
    assert ServerArgs(tool_call_parser=None, max_waiting_requests=0).max_waiting_requests == 0
    assert ModelArgs(model_path=tmp_path).model_path == str(tmp_path)  # a path-like becomes its string
    assert field_kinds(SpeculativeArgs, "ddtree_budget") == ((int, str), False)
    assert field_kinds(ModelArgs, "context_length") == ((int,), True)
    cfg = ServerConfig().replace("parallel", tp_size=2)
    assert cfg.parallel.tp_size == 2 and ServerConfig().parallel.tp_size == 1
    with pytest.raises(ValueError, match="tp_size"):
        ServerConfig().replace("parallel", tp_size=-2)


def test_engine_short_names_only_when_asked() -> None:
    cfg = ServerConfig.from_flat({"ddtree_budget": 8, "draft_model_path": "/d", "algorithm": "dflash"},
                                 short_names=True)
    assert cfg.speculative.ddtree_budget == 8 and cfg.speculative.algorithm == "dflash"
    with pytest.raises(ValueError, match="unknown configuration keys: ddtree_budget"):
        ServerConfig.from_flat({"ddtree_budget": 8})


def test_cli_checks_ranges_at_parse_time() -> None:
    p = _parser()
    for argv in (["--port", "0"], ["--mem-fraction-static", "1.5"], ["--speculative-block-size", "x"]):
        with pytest.raises(SystemExit):
            p.parse_args(argv)
    ns = p.parse_args(["--kv-memory-gb", "3", "--speculative-ddtree-budget", "12", "--no-expert-parallel"])
    assert ns.kv_memory_gb == 3.0 and ns.speculative_ddtree_budget == 12 and ns.expert_parallel is False


def test_moe_backend_offers_only_what_is_wired():
    """`--moe-backend flashinfer` always failed at load (issue 46 item 7): it is no longer offered."""
    import argparse

    from ddtree_serve.server.cli.args import add_server_arguments

    parser = argparse.ArgumentParser()
    add_server_arguments(parser)
    assert "flashinfer" not in parser.format_help().split("--moe-backend", 1)[1].split("--", 1)[0]
    with pytest.raises(SystemExit):
        parser.parse_args(["--moe-backend", "flashinfer"])
    with pytest.raises(ValueError, match="moe_backend"):
        ServerConfig.from_flat({"moe_backend": "flashinfer"})


def test_train_drafter_help_shows_defaults(capsys):
    from ddtree_serve.server.cli.main import main

    with pytest.raises(SystemExit):
        main(["train-drafter", "--help"])
    out = capsys.readouterr().out
    for flag, default in (("--steps", "1000"), ("--num-layers", "1"), ("--block-size", "8"), ("--lr", "0.0006"),
                          ("--prompts-jsonl", "none")):
        assert f"(default: {default})" in out.split("\n  " + flag, 1)[1].split("\n  --", 1)[0], flag
