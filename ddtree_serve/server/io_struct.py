"""Typed messages between the server's processes (pickled over ZMQ) and the scheduler core's I/O."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ddtree_serve.model_executor.sampling_params import SamplingParams


@dataclass(frozen=True)
class ImageInput:
    """One preprocessed image of a request (ddtree_serve/server/multimodal/image_processor.py). Its ``num_tokens``
    placeholder tokens sit at ``input_ids[offset : offset + num_tokens]``; prefill writes the image's
    embeddings over theirs. ``content_hash`` keys those tokens in the prefix cache."""

    offset: int
    num_tokens: int
    grid: tuple[int, int, int]  # (t, h, w) patches
    pixel_values: Any  # torch.Tensor [t * h * w, 3, patch, patch] float32, normalised
    content_hash: int  # 63-bit, of pixels and grid

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens


@dataclass
class GenerateReq:
    """A tokenized request. ``rid`` is unique per server. ``images``: in prompt order, non-overlapping."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    images: tuple[ImageInput, ...] = ()


@dataclass
class AbortReq:
    rid: str


@dataclass
class TokenOut:
    """What one scheduler step produced for one request: the new token ids of this step (possibly several
    in a speculative step), and when finished, why. ``logprobs`` (when asked): one entry per new token,
    ``(token_logprob, [(token_id, logprob), ...top alternatives])``. ``prompt_logprobs`` (when asked, once,
    in the first output after prefill): one entry per prompt token, ``(token_id, logprob, top)``, the first
    ``(token_id, None, None)``. ``error`` set means the request was rejected or failed; it is then also
    finished. ``error_param``: the request field a rejection is about, in the engine's names (``prompt``,
    ``max_tokens``, a ``SamplingParams`` field such as ``json_schema``); each HTTP API maps it to its own field
    name (ddtree_serve/server/http/serving_common.py ``ParamNames``)."""

    rid: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    spec_verify_steps: int = 0  # decode steps that verified a draft tree
    spec_plain_steps: int = 0  # decode steps without a draft tree
    spec_accepted_tokens: int = 0
    spec_accepted_suffix: int = 0  # of spec_accepted_tokens, proposed by the suffix draft source
    spec_budget_sum: int = 0
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    error: str | None = None
    prompt_logprobs: list[tuple[int, float | None, list[tuple[int, float]] | None]] | None = None
    error_param: str | None = None


@dataclass
class SchedulerStats:
    running: int = 0
    waiting: int = 0
    kv_used_tokens: int = 0
    kv_total_tokens: int = 0
    spec_verify_steps: int = 0
    spec_generated_tokens: int = 0
    spec_budget: dict = field(default_factory=dict)  # auto budget: BudgetController.stats() (cumulative)
    cache_hit_tokens: int = 0  # prompt tokens served from the prefix cache (cumulative)
    cache_query_tokens: int = 0  # prompt tokens of admitted requests (cumulative)
    cache_held_tokens: int = 0  # KV slots the prefix cache holds now
    spec_drafts: int = 0  # request-steps that verified a draft tree (cumulative; vLLM's num_drafts)
    spec_draft_tokens: int = 0  # tree nodes offered in them (cumulative)
    spec_accepted_tokens: int = 0  # draft tokens accepted (cumulative)
    spec_accepted_per_pos: tuple[int, ...] = ()  # [i]: request-steps that accepted draft position i (cumulative)
    extra: dict = field(default_factory=dict)


# ---- messages between the server's own processes (tokenizer manager, scheduler process, detokenizer) ----
@dataclass(frozen=True)
class IpcEndpoints:
    """ZMQ ``ipc://`` addresses, all inside one private temporary directory. Each is bound by its reader."""

    scheduler_input: str  # tokenizer manager -> scheduler process
    detokenizer_input: str  # scheduler process -> detokenizer
    tokenizer_input: str  # detokenizer -> tokenizer manager

    @classmethod
    def in_dir(cls, directory: str) -> IpcEndpoints:
        return cls(f"ipc://{directory}/scheduler", f"ipc://{directory}/detokenizer", f"ipc://{directory}/tokenizer")


@dataclass
class DetokenizeReq:
    """How the detokenizer turns one request's tokens into text. Rides ahead of the request through the
    scheduler process, so it always reaches the detokenizer before the request's first TokenOut."""

    rid: str
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()  # trimmed from the text when they end generation (with EOS)
    skip_special_tokens: bool = True
    logprobs: bool = False


@dataclass
class TokenizedGenerateReq:
    """Tokenizer manager -> scheduler process."""

    req: GenerateReq
    detokenize: DetokenizeReq


@dataclass
class BatchTokenOut:
    """Scheduler process -> detokenizer: the outputs of one scheduler step."""

    outputs: list[TokenOut]


@dataclass
class TextOut:
    """Detokenizer -> tokenizer manager: the new text of one request. ``logprobs`` entries are
    ``(token_text, logprob, [(alt_text, logprob), ...])``. ``abort_scheduler``: the detokenizer finished the
    request itself (stop string); the scheduler still runs it and must be told to drop it.
    ``prompt_logprobs``: as ``TokenOut``'s, in text: ``(token_text, logprob | None, [(alt_text, logprob)] | None)``.
    ``error_param``: as ``TokenOut``'s."""

    rid: str
    text: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    matched_stop: str | int | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    spec_verify_steps: int = 0  # decode steps that verified a draft tree
    spec_plain_steps: int = 0  # decode steps without a draft tree
    spec_accepted_tokens: int = 0
    spec_accepted_suffix: int = 0  # of spec_accepted_tokens, proposed by the suffix draft source
    spec_budget_sum: int = 0
    logprobs: list[tuple[str, float, list[tuple[str, float]]]] | None = None
    error: str | None = None
    error_status: int = 400
    abort_scheduler: bool = False
    prompt_logprobs: list[tuple[str, float | None, list[tuple[str, float]] | None]] | None = None
    error_param: str | None = None


@dataclass
class BatchTextOut:
    outputs: list[TextOut]


@dataclass
class RequestError:
    """Scheduler process -> detokenizer -> tokenizer manager: a request failed inside the server."""

    rid: str
    message: str
    status: int = 500


@dataclass
class SchedulerReady:
    """Sent once the model is loaded; forwarded by the detokenizer to the tokenizer manager."""

    max_context_len: int
    eos_token_ids: tuple[int, ...]
    model_path: str
    vocab_size: int = 0  # the model's (logit_bias ids are checked against it before a request is sent)


@dataclass
class ProcessFailed:
    """A child process could not start or hit an unrecoverable error; it exits after sending this."""

    process: str
    message: str
