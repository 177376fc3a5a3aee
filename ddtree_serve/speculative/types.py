"""What the scheduler and the speculative worker exchange."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from ddtree_serve.model_executor.grammar.state import GrammarState
    from ddtree_serve.model_executor.penalties import TokenCounts
    from ddtree_serve.model_executor.sampling_params import SamplingParams


class OutOfKVSlots(Exception):
    """The speculative step could not allocate tree slots; the scheduler retracts a request and retries.
    Raised before any state changes."""


@dataclass
class DecodeResult:
    """One request's outcome of one speculative step: the committed new tokens (accepted drafts then the
    bonus, already truncated at a stop token or max_tokens), the number of accepted drafts, and optional
    per-token logprobs."""

    tokens: list[int]
    accepted: int
    logprobs: list | None = None
    budget: int = 0  # tree nodes this step offered the request (0: a plain decode step)
    accepted_suffix: int = 0  # of ``accepted``, nodes proposed by the suffix draft source


class SpecSettings(Protocol):
    """What ``SpecWorker.create`` builds the worker from. ddtree_serve/server/config.py ``SpeculativeArgs`` satisfies it,
    validated and with ``draft_model_path`` resolved to a directory (ddtree_serve/server/startup.py)."""

    @property
    def algorithm(self) -> str: ...  # "dflash" (chain) | "ddtree" (tree)

    @property
    def draft_model_path(self) -> str | None: ...

    @property
    def ddtree_budget(self) -> int | str: ...  # an int >= 1, or "auto"

    @property
    def ddtree_max_budget(self) -> int: ...

    @property
    def block_size(self) -> int | None: ...  # None: the drafter config's

    @property
    def dflash_draft_window_size(self) -> int | None: ...  # None: no cap on the drafter's context

    @property
    def dflash_rope_attention_factor(self) -> float | None: ...  # None: derived from the drafter's config

    @property
    def accept_threshold_single(self) -> float: ...

    @property
    def accept_threshold_acc(self) -> float: ...

    @property
    def lossy(self) -> bool: ...  # a threshold below 1: sampled verification no longer follows the target

    @property
    def draft_sources(self) -> str: ...  # resolved: "dflash", "suffix" or "dflash,suffix"

    @property
    def suffix_max_depth(self) -> int: ...

    @property
    def suffix_min_match(self) -> int: ...

    @property
    def suffix_max_match(self) -> int: ...

    @property
    def suffix_cache_tokens(self) -> int: ...  # a threshold below 1: sampled verification no longer follows the target


class SpecRequest(Protocol):
    """What the worker reads from (and ``num_cached`` it updates on) a scheduler request."""

    rid: str
    params: SamplingParams
    generator: torch.Generator  # relaxed acceptance's coins only

    @property
    def seed(self) -> int: ...  # concrete; position-keyed draws (model_executor/position_uniforms.py)
    prompt_ids: list[int]
    output_ids: list[int]
    req_pool_idx: int | None
    num_cached: int
    token_counts: TokenCounts | None
    grammar: GrammarState | None  # structured output (ddtree_serve.model_executor.grammar); None: unconstrained

    @property
    def remaining_tokens(self) -> int: ...
