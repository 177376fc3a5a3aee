"""``--speculative-draft-sources`` and the suffix bounds: validation, and how start-up resolves ``auto``."""

from __future__ import annotations

import pytest

from ddtree_serve.server.config import ServerConfig
from ddtree_serve.server.startup import resolve_draft_sources


def _cfg(**flat) -> ServerConfig:
    return ServerConfig.from_flat(flat)


@pytest.mark.parametrize(("flat", "match"), [
    ({"speculative_draft_sources": "ngram"}, "draft_sources must name one or more of dflash, suffix"),
    ({"speculative_draft_sources": ""}, "draft_sources"),
    ({"speculative_algorithm": "dflash", "speculative_draft_sources": "suffix"}, "needs speculative_algorithm ddtree"),
    ({"speculative_suffix_min_match": 5, "speculative_suffix_max_match": 3}, "must not exceed"),
    ({"speculative_suffix_max_depth": 0}, "suffix_max_depth must be an integer in"),
    ({"speculative_suffix_cache_tokens": -1}, "suffix_cache_tokens must be an integer >= 0"),
])
def test_bad_values_are_clear_errors(flat, match):
    with pytest.raises(ValueError, match=match):
        _cfg(**flat)


def test_sources_are_normalised_and_auto_resolves_by_drafter():
    assert _cfg(speculative_draft_sources="suffix,dflash").speculative.draft_sources == "dflash,suffix"
    ddtree = {"speculative_algorithm": "ddtree"}
    # the default model ships a drafter: both; a drafter path: both; none: suffix alone; dflash chains: dflash
    assert resolve_draft_sources(_cfg(model_path="default", **ddtree)) == "dflash,suffix"
    assert resolve_draft_sources(_cfg(model_path="/m", speculative_draft_model_path="/d", **ddtree)) == "dflash,suffix"
    assert resolve_draft_sources(_cfg(model_path="/m", **ddtree)) == "suffix"
    assert resolve_draft_sources(_cfg(model_path="/m", speculative_algorithm="dflash")) == "dflash"
    assert resolve_draft_sources(_cfg(model_path="/m", speculative_draft_sources="dflash", **ddtree)) == "dflash"
    cfg = _cfg(model_path="/m", **ddtree)
    assert not cfg.speculative.uses_drafter  # no drafter is loaded (nor resolved) for suffix drafts alone


def test_settings_of_an_unused_source_are_errors():
    from ddtree_serve.server.startup import check_source_settings

    def spec(**flat):
        cfg = _cfg(model_path="/m", speculative_algorithm="ddtree", **flat)
        return cfg.replace("speculative", draft_sources=resolve_draft_sources(cfg)).speculative

    with pytest.raises(ValueError, match="speculative_block_size set, but speculative_draft_sources is 'suffix'"):
        check_source_settings(spec(speculative_block_size=4))  # no drafter: suffix drafts alone
    with pytest.raises(ValueError, match="speculative_suffix_max_depth, speculative_suffix_cache_tokens set"):
        check_source_settings(spec(speculative_draft_model_path="/d", speculative_draft_sources="dflash",
                                   speculative_suffix_max_depth=4, speculative_suffix_cache_tokens=0))
    with pytest.raises(ValueError, match="speculative_draft_model_path set"):
        check_source_settings(spec(speculative_draft_model_path="/d", speculative_draft_sources="suffix"))
    with pytest.raises(ValueError, match="speculative_dflash_draft_window_size set"):
        check_source_settings(spec(speculative_dflash_draft_window_size=512))  # the drafter's: no drafter here
    check_source_settings(spec(speculative_draft_model_path="default", speculative_draft_sources="suffix"))
    check_source_settings(spec(speculative_suffix_max_depth=4))  # used: no error
    check_source_settings(spec(speculative_draft_model_path="/d", speculative_dflash_draft_window_size=512,
                               speculative_dflash_rope_attention_factor=1.4))
    check_source_settings(spec(speculative_draft_model_path="/d", speculative_block_size=4))


@pytest.mark.parametrize("flat", [
    {"speculative_draft_model_path": "/some/drafter"},
    {"speculative_draft_sources": "suffix"},
    {"speculative_ddtree_budget": 7},
])
def test_a_speculative_setting_implies_ddtree(flat, caplog):
    """A drafter path, draft sources or a budget without an algorithm serve ddtree (issue 46 item 4: they ran
    plain decoding before, silently), and the start-up log says why."""
    with caplog.at_level("INFO", logger="ddtree_serve.server.config"):
        assert _cfg(**flat).speculative.algorithm == "ddtree"
    assert "implied by " + next(iter(flat)) in caplog.text


@pytest.mark.parametrize(("flat", "match"), [
    ({"speculative_algorithm": "none", "speculative_draft_model_path": "/d", "speculative_ddtree_budget": 7},
     "speculative_ddtree_budget, speculative_draft_model_path set, but speculative_algorithm is 'none'"),
    ({"speculative_algorithm": "ddtree", "speculative_ddtree_budget": 7, "speculative_ddtree_max_budget": 16},
     "give one of them"),
])
def test_ignored_speculative_settings_are_errors(flat, match):
    with pytest.raises(ValueError, match=match):
        _cfg(**flat)


def test_cli_and_engine_names_follow_the_same_rule():
    """The CLI (``plan`` and ``serve`` parse the same flags) and Engine's short keyword names."""
    import argparse

    from ddtree_serve.server.cli.args import add_server_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_server_arguments(parser)
    args = parser.parse_args(["--model-path", "/m", "--speculative-draft-model-path", "/d",
                              "--speculative-ddtree-budget", "7"])
    assert config_from_args(args).speculative.algorithm == "ddtree"
    with pytest.raises(ValueError, match="speculative_algorithm is 'none'"):
        config_from_args(parser.parse_args(["--model-path", "/m", "--speculative-algorithm", "none",
                                            "--speculative-ddtree-budget", "7"]))
    assert ServerConfig.from_flat({"ddtree_budget": 5}, short_names=True).speculative.algorithm == "ddtree"
