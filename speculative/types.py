"""What the scheduler and the speculative worker exchange."""

from __future__ import annotations

from dataclasses import dataclass


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
