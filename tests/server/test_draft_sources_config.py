"""``--speculative-draft-sources`` and the suffix bounds: validation, and how start-up resolves ``auto``."""

from __future__ import annotations

import pytest

from server.config import ServerConfig
from server.startup import resolve_draft_sources


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
