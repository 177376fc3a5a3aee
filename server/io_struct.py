"""Typed messages between the server's processes (pickled over ZMQ) and the scheduler core's I/O."""

from __future__ import annotations

from dataclasses import dataclass, field

from model_executor.sampling_params import SamplingParams


@dataclass
class GenerateReq:
    """A tokenized request. ``rid`` is unique per server."""

    rid: str
    input_ids: list[int]
    params: SamplingParams


@dataclass
class AbortReq:
    rid: str


@dataclass
class TokenOut:
    """What one scheduler step produced for one request: the new token ids of this step (possibly several
    in a speculative step), and when finished, why. ``logprobs`` (when asked): one entry per new token,
    ``(token_logprob, [(token_id, logprob), ...top alternatives])``. ``error`` set means the request was
    rejected or failed; it is then also finished."""

    rid: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    spec_verify_steps: int = 0
    spec_accepted_tokens: int = 0
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    error: str | None = None


@dataclass
class SchedulerStats:
    running: int = 0
    waiting: int = 0
    kv_used_tokens: int = 0
    kv_total_tokens: int = 0
    spec_verify_steps: int = 0
    spec_generated_tokens: int = 0
    extra: dict = field(default_factory=dict)
