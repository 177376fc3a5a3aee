"""A simulated accelerator: forwards cost modelled device time on a timeline of their own, off the host thread.

As with CUDA's asynchronous launches, ``launch`` returns at once and the device works through its queue in the
background (``busy_until`` moves forward); the host blocks only in ``wait``, where a real build reads a result
back (a ``.cpu()`` / ``.tolist()`` of the step's tokens). So host work done between a launch and the wait
hides behind the device, as an overlap scheduler would hide it, and host work before a launch delays it.

The default costs are those of Kimi K2.6 on 8 GPUs (tensor parallel, no speculation), from users' published vLLM
figures on 8x RTX PRO 6000 (92 tok/s at concurrency 1, 2,223 tok/s at 128: a decode step of ~10 ms at batch 1,
~57 ms at batch 128) as a roofline in the step's tokens (``DeviceCostModel``), plus the vocabulary-sized work
every logits row costs on the device (the LM head's share, top-k / softmax / sampling or verification at 163,840
tokens). Every field can be overridden in the simulated checkpoint's config.json (``ddtree_serve/sim/checkpoint.py``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceCostModel:
    """Modelled device seconds of one forward (milliseconds in the fields), a two-part roofline: up to
    ``knee_tokens`` tokens a step is bound by reading the weights (more tokens wake more experts: ``token_ms``
    each), and every token also costs its FLOPs (``flop_token_ms``: ~64 GFLOP per token of a 32B-active MoE at
    ~2 PFLOP/s over the 8 GPUs), which bounds large verify and prefill forwards. Calibrated to a decode step of
    10 ms at batch 1 and 57 ms at batch 128."""

    step_ms: float = 10.0  # a target forward's fixed cost (the weights read once: batch 1 decode)
    token_ms: float = 0.338  # each of the first ``knee_tokens`` tokens: more experts read
    knee_tokens: int = 128  # past it, every expert is read anyway
    flop_token_ms: float = 0.032  # each token's FLOPs
    context_us: float = 0.002  # each cached key a query token's attention reads
    logits_row_us: float = 2.0  # each logits row: vocabulary-wide softmax, top-k / top-p, sampling or verification
    draft_step_ms: float = 2.0  # a drafter forward's fixed cost (one small layer block) and the batched tree build
    draft_token_ms: float = 0.004  # each drafter token (block position)

    def target_s(self, tokens: int, context_reads: int, logits_rows: int) -> float:
        """One target forward over ``tokens`` new tokens that read ``context_reads`` cached keys in all."""
        ms = (self.step_ms + self.token_ms * min(tokens, self.knee_tokens) + self.flop_token_ms * tokens
              + self.context_us * context_reads * 1e-3 + self.logits_row_us * logits_rows * 1e-3)
        return ms * 1e-3

    def draft_s(self, tokens: int, logits_rows: int) -> float:
        """One drafter forward over ``tokens`` block tokens, ``logits_rows`` of them through the LM head."""
        return (self.draft_step_ms + self.draft_token_ms * tokens + self.logits_row_us * logits_rows * 1e-3) * 1e-3


class DeviceClock:
    """The device's timeline: what was launched, when it will be done, and how long the host waited for it."""

    def __init__(self, cost: DeviceCostModel) -> None:
        self.cost = cost
        self.busy_until = 0.0  # perf_counter time the queued work ends
        self.device_s = 0.0  # modelled device seconds launched so far
        self.waited_s = 0.0  # host seconds spent blocked in ``wait``
        self.device_ops_s = 0.0  # host seconds spent running device ops (``on_device``)
        self.launches = 0

    def launch(self, seconds: float) -> None:
        """Queue ``seconds`` of device work behind what is queued; returns at once."""
        now = time.perf_counter()
        self.busy_until = max(self.busy_until, now) + seconds
        self.device_s += seconds
        self.launches += 1

    def wait(self) -> None:
        """Block the host until the queued work is done (a synchronising read of a result)."""
        left = self.busy_until - time.perf_counter()
        if left > 0:
            t0 = time.perf_counter()
            time.sleep(left)
            self.waited_s += time.perf_counter() - t0

    @contextmanager
    def on_device(self) -> Iterator[None]:
        """Code that is device work in deployment (vocabulary top-k, sampling, verification kernels) but that the
        CPU must run here to produce its results, at the simulator's small vocabulary: its seconds are booked
        as ``device_ops_s``, not host work (their full-size cost is in the forwards' modelled time)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.device_ops_s += time.perf_counter() - t0
