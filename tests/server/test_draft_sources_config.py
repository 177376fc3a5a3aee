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
    check_source_settings(spec(speculative_draft_model_path="default", speculative_draft_sources="suffix"))
    check_source_settings(spec(speculative_suffix_max_depth=4))  # used: no error
    check_source_settings(spec(speculative_draft_model_path="/d", speculative_block_size=4))
