"""Per-request sampling parameters (OpenAI/SGLang semantics), validated once at admission."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy. top_k <= 0 (or >= vocab) disables top-k; top_p 1 disables top-p;
    min_p 0 disables min-p. ``logprobs``: None for none, k >= 0 for the chosen token's logprob plus the
    top-k alternatives. ``stop_token_ids`` end generation like EOS (the token is emitted).

    ``prompt_logprobs`` (vLLM's name): None for none; k >= 0 scores the prompt during prefill: for every
    prompt token after the first, its raw-model logprob given the tokens before it plus the top-k
    alternatives (the first token has no context: ``None``). ``max_tokens`` 0 is allowed only with
    ``prompt_logprobs``: the request is prefilled, scored and finishes ("length") without sampling."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def validate(self) -> None:
        """Raise ValueError naming the offending field."""
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k!r}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        least = 0 if self.prompt_logprobs is not None else 1
        if not isinstance(self.max_tokens, int) or self.max_tokens < least:
            raise ValueError(f"max_tokens must be an integer >= {least}, got {self.max_tokens!r}"
                             + ("" if least == 0 else " (0 only with prompt_logprobs: scoring the prompt alone)"))
        if self.logprobs is not None and not (0 <= self.logprobs <= 20):
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs!r}")
        if self.prompt_logprobs is not None and not (0 <= self.prompt_logprobs <= 20):
            raise ValueError(f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")


def find_stop(tokens: list[int], params: SamplingParams, eos_ids: tuple[int, ...], budget_left: int) -> tuple[
        int, str | None]:
    """How many of ``tokens`` (new tokens of one step, in order) to keep, and the finish reason if the
    request ends inside them. A stop/EOS token is kept; ``budget_left`` is the remaining max_tokens."""
    for i, t in enumerate(tokens[:budget_left]):
        if t in params.stop_token_ids or (not params.ignore_eos and t in eos_ids):
            return i + 1, "stop"
    if len(tokens) >= budget_left:
        return budget_left, "length"
    return len(tokens), None
