"""Scheduler-side request state, and the error that rejects a request at admission."""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from ddtree_serve.model_executor.grammar.state import GrammarState
from ddtree_serve.model_executor.penalties import TokenCounts
from ddtree_serve.model_executor.radix_cache import RadixNode
from ddtree_serve.model_executor.sampling_params import GRAMMAR_KINDS, SamplingParams
from ddtree_serve.server.io_struct import ImageInput, TokenOut


class AdmissionError(ValueError):
    """A request the scheduler refuses (HTTP 400). ``param``: the request field it is about, in the engine's
    names (``prompt`` or a ``SamplingParams`` field); the HTTP API names its own field from it."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


_PARAM_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


def rejection_param(error: ValueError, params: SamplingParams | None = None) -> str | None:
    """The field a refusal is about: an AdmissionError's ``param``; for ``SamplingParams.validate``'s errors,
    which start with the field's name, that name; for a grammar that does not compile, its kind (``json_schema``,
    ``regex`` or ``ebnf``, from ``params``)."""
    if isinstance(error, AdmissionError):
        return error.param
    first = str(error).split(" ", 1)[0]
    if first in _PARAM_FIELDS:
        return first
    kinds = [k for k in GRAMMAR_KINDS if params is not None and getattr(params, k) is not None]
    return kinds[0] if kinds else None


@dataclass
class Req:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator  # coins of relaxed acceptance only (thresholds below 1), seeded from the seed
    output_ids: list[int] = field(default_factory=list)
    req_pool_idx: int | None = None
    num_cached: int = 0  # tokens whose target KV is in the cache (req_to_token[idx, :num_cached])
    tree_len: int = 0  # leading cached tokens whose slots the prefix cache holds (locked via cache_node)
    cache_node: RadixNode | None = None  # the prefix cache node locked for this request
    cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission (usage report)
    finish_reason: str | None = None
    spec_verify_steps: int = 0  # decode steps that verified a draft tree (of at least one node)
    spec_plain_steps: int = 0  # decode steps without a draft tree (a plain decode forward)
    spec_accepted_tokens: int = 0
    spec_accepted_suffix: int = 0  # of spec_accepted_tokens, proposed by the suffix draft source
    spec_budget_sum: int = 0  # tree nodes offered over all verify steps (auto budget: mean = sum / steps)
    pending_logprobs: list = field(default_factory=list)
    sent_tokens: int = 0  # output tokens already reported
    token_counts: TokenCounts | None = None  # token statistics, only when a penalty reads them
    prompt_lps: list = field(default_factory=list)  # (logprob, top) of prompt tokens 1.. scored so far
    prompt_lps_sent: bool = False
    grammar: GrammarState | None = None  # structured output: matcher over the committed output
    grammar_future: Future | None = None  # its compilation, until the request leaves the grammar queue
    images: tuple[ImageInput, ...] = ()  # the prompt's images (placeholder spans), in order
    image_embeds: dict[int, torch.Tensor] = field(default_factory=dict)  # image index -> [tokens, H], while prefill needs it

    @property
    def seed(self) -> int:
        """The request's concrete seed (the scheduler draws one at admission when the request gave none)."""
        assert self.params.seed is not None, "admission sets a concrete seed"
        return self.params.seed

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def cache_key(self, n: int) -> list[int]:
        """The prefix cache's key of the first ``n`` tokens: the token ids, with each image's placeholder
        span replaced by a value derived from the image's content hash (negative: never a token id), so the
        same image resent matches and a different image, or text, does not."""
        key = self.all_ids[:n]
        for im in self.images:
            if im.offset >= n:
                break
            key[im.offset:min(n, im.end)] = [-1 - im.content_hash] * (min(n, im.end) - im.offset)
        return key

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def prefill_len(self) -> int:
        """Tokens to cache before decoding: all of them, except the last emitted token (the next root)."""
        return self.seq_len - (1 if self.output_ids else 0)

    @property
    def prefill_done(self) -> bool:
        """All tokens but the last emitted one are cached (decode invariant)."""
        return bool(self.output_ids) and self.num_cached == self.seq_len - 1

    @property
    def remaining_tokens(self) -> int:
        return self.params.max_tokens - len(self.output_ids)

    def record_spec_step(self, accepted: int, accepted_suffix: int, budget: int) -> bool:
        """Count one speculative decode step; True when it verified a tree (``budget`` > 0 nodes), else its root
        alone ran: a plain decode token (docs/API.md spec_stats)."""
        if budget <= 0:
            self.spec_plain_steps += 1
            return False
        self.spec_verify_steps += 1
        self.spec_accepted_tokens += accepted
        self.spec_accepted_suffix += accepted_suffix
        self.spec_budget_sum += budget
        return True

    def take_output(self, new: list[int]) -> TokenOut:
        """The scheduler's report of ``new`` tokens, with the logprobs pending for them and, once the whole
        prompt is scored, the prompt's logprobs (once)."""
        lps = None
        if self.params.logprobs is not None:
            lps, self.pending_logprobs = self.pending_logprobs[:len(new)], self.pending_logprobs[len(new):]
        return TokenOut(self.rid, list(new), prompt_tokens=len(self.prompt_ids),
                        completion_tokens=len(self.output_ids), cached_tokens=self.cached_tokens,
                        spec_verify_steps=self.spec_verify_steps, spec_plain_steps=self.spec_plain_steps,
                        spec_accepted_tokens=self.spec_accepted_tokens,
                        spec_accepted_suffix=self.spec_accepted_suffix,
                        spec_budget_sum=self.spec_budget_sum, logprobs=lps, prompt_logprobs=self._take_prompt_logprobs())

    def _take_prompt_logprobs(self) -> list | None:
        if self.params.prompt_logprobs is None or self.prompt_lps_sent or len(self.prompt_lps) < len(self.prompt_ids) - 1:
            return None
        self.prompt_lps_sent = True
        ids = self.prompt_ids
        return [(ids[0], None, None)] + [(t, lp, top) for t, (lp, top) in zip(ids[1:], self.prompt_lps, strict=True)]
