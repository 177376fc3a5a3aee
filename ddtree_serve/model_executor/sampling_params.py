"""Per-request sampling parameters (OpenAI/SGLang semantics), validated once at admission."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

GREEDY_TEMPERATURE = 1e-5  # temperatures below this decode greedily


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy. top_k <= 0 (or >= vocab) disables top-k; top_p 1 disables top-p;
    min_p 0 disables min-p. ``max_tokens`` None: until the request limit (the context length, or what the
    KV cache can hold for one request, whichever is smaller), resolved at admission. ``logprobs``: None for
    none, k >= 0 for the chosen token's logprob plus the top-k alternatives. ``stop_token_ids`` end
    generation like EOS (the token is emitted).

    Penalties (definitions in ``ddtree_serve.model_executor.penalties``): ``presence_penalty`` and ``frequency_penalty``
    in [-2, 2] (OpenAI; over the generated tokens), ``repetition_penalty`` in (0, 2] (SGLang/vLLM; over
    prompt and generated tokens; 1 = off), ``logit_bias`` {token id: bias in [-100, 100]} (OpenAI; ids are
    checked against the vocabulary at admission). Logprobs stay those of the raw model logits.

    Structured outputs (SGLang's names; at most one is set; ``ddtree_serve.model_executor.grammar``): ``json_schema`` a JSON
    schema as a JSON string (OpenAI ``response_format`` ``json_object`` maps to ``'{"type": "object"}'``),
    ``regex`` a regular expression, ``ebnf`` a GBNF grammar (root rule ``root``). Each generated token is
    drawn from the model's distribution restricted to the tokens the grammar allows next (also under
    speculation); once the grammar is complete only EOS is allowed. Logprobs stay those of the raw model.
    ``reasoning_end_ids`` (a thinking model's reply, vLLM's reasoning-aware structured outputs): the grammar
    is dormant (every token allowed) until one of these tokens (``</think>``) is generated and holds from the
    next token on; ``reasoning_handoff_ids`` also end the dormancy but are the grammar's first token (Kimi's
    tool-call section start, which ends the reasoning inside the answer). Both need a grammar
    (``ddtree_serve.model_executor.grammar.state``).

    ``prompt_logprobs`` (vLLM's name): None for none; k >= 0 scores the prompt during prefill: for every
    prompt token after the first, its raw-model logprob given the tokens before it plus the top-k
    alternatives (the first token has no context: ``None``). ``max_tokens`` 0 is allowed only with
    ``prompt_logprobs``: the request is prefilled, scored and finishes ("length") without sampling.
    ``clamp_max_tokens``: a ``max_tokens`` beyond the room the request limit leaves after the prompt is lowered
    to that room at admission (the reply then ends with "length" there) instead of refused (the HTTP agent
    APIs; chat and completions with ``--allow-auto-truncate``)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = field(default=None, hash=False)
    prompt_logprobs: int | None = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    reasoning_end_ids: tuple[int, ...] = ()
    reasoning_handoff_ids: tuple[int, ...] = ()
    min_tokens: int = 0  # no stop token before this many output tokens (vLLM's min_tokens)
    min_tokens_ban: tuple[int, ...] = ()  # the ids banned until then: EOS and stop_token_ids (set at admission)
    clamp_max_tokens: bool = False  # max_tokens beyond the room left is lowered to it at admission
    draft_hint: tuple[int, ...] = ()  # a predicted output (OpenAI's prediction): a suffix-draft source, never output

    @property
    def grammar(self) -> tuple[str, str] | None:
        """``(kind, text)`` of the structured-output constraint (kind: json_schema, regex or ebnf), or None."""
        for kind in GRAMMAR_KINDS:
            text = getattr(self, kind)
            if text is not None:
                return kind, text
        return None

    @property
    def is_greedy(self) -> bool:
        # below GREEDY_TEMPERATURE, logits / T overflows float32 (a probability row of NaN): such a request is
        # greedy, as in SGLang and vLLM
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def needs_token_counts(self) -> bool:
        """A penalty reads the request's token statistics (``ddtree_serve.model_executor.penalties.TokenCounts``)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def has_logit_processing(self) -> bool:
        """Logits are modified before sampling (a penalty, a logit bias, or min_tokens' ban)."""
        return self.needs_token_counts or bool(self.logit_bias) or (self.min_tokens > 0 and bool(self.min_tokens_ban))

    def validate(self, vocab_size: int | None = None) -> None:
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
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < least):
            raise ValueError(f"max_tokens must be None or an integer >= {least}, got {self.max_tokens!r}"
                             + ("" if least == 0 else " (0 only with prompt_logprobs: scoring the prompt alone)"))
        if self.logprobs is not None and not (0 <= self.logprobs <= 20):
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs!r}")
        if self.prompt_logprobs is not None and not (0 <= self.prompt_logprobs <= 20):
            raise ValueError(f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_real(v) or not (-2.0 <= v <= 2.0):
                raise ValueError(f"{name} must be in [-2, 2], got {v!r}")
        if not _is_real(self.repetition_penalty) or not (0.0 < self.repetition_penalty <= 2.0):
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty!r}")
        self._validate_grammar()
        for name in ("reasoning_end_ids", "reasoning_handoff_ids"):
            ids = getattr(self, name)
            if ids and self.grammar is None:
                raise ValueError(f"{name} needs a grammar (json_schema, regex or ebnf)")
            for tok in ids:
                if not isinstance(tok, int) or isinstance(tok, bool) or tok < 0 or (
                        vocab_size is not None and tok >= vocab_size):
                    raise ValueError(f"{name} must be token ids in [0, {vocab_size or 'vocab'}), got {tok!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError("logit_bias must map token ids to biases")
            for tok, bias in self.logit_bias.items():
                if not isinstance(tok, int) or isinstance(tok, bool) or tok < 0:
                    raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {tok!r}")
                if vocab_size is not None and tok >= vocab_size:
                    raise ValueError(f"logit_bias token id {tok} is out of range [0, {vocab_size})")
                if not _is_real(bias) or not (-100.0 <= bias <= 100.0):
                    raise ValueError(f"logit_bias values must be in [-100, 100], got {bias!r} (token {tok})")

    def _validate_grammar(self) -> None:
        """At most one constraint, and it parses (``ddtree_serve.model_executor.grammar.check_grammar``: the grammar is
        built without a tokenizer, milliseconds; the token-level compile happens later, off the step)."""
        kinds = [k for k in GRAMMAR_KINDS if getattr(self, k) is not None]
        if len(kinds) > 1:
            raise ValueError(f"{kinds[1]} cannot be combined with {kinds[0]} (at most one of json_schema, regex "
                             "and ebnf may be set)")
        if kinds:
            from ddtree_serve.model_executor.grammar.backend import check_grammar

            text = getattr(self, kinds[0])
            if not isinstance(text, str) or not text.strip():
                raise ValueError(f"{kinds[0]} must be a non-empty string")
            check_grammar(kinds[0], text)


GRAMMAR_KINDS = ("json_schema", "regex", "ebnf")


def _is_real(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


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
