"""Structured outputs: grammar compilation (``backend``), per-request matcher state (``state``) and token
bitmasks for plain decoding and draft trees (``masks``). docs/DESIGN.md, "Grammar masks under speculation"."""

from ddtree_serve.model_executor.grammar.backend import GrammarBackend, check_grammar
from ddtree_serve.model_executor.grammar.masks import (
    draft_pop_budgets,
    mask_draft_logits,
    mask_logits,
    mask_tree_logits,
    prune_popped,
    tree_bitmask,
)
from ddtree_serve.model_executor.grammar.state import GrammarState, ReasoningGate

__all__ = ["GrammarBackend", "GrammarState", "ReasoningGate", "check_grammar", "draft_pop_budgets",
           "mask_draft_logits", "mask_logits", "mask_tree_logits", "prune_popped", "tree_bitmask"]
