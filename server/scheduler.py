"""The scheduler core: continuous batching over one ModelRunner (TP rank 0 view).

One step reads as ``schedule() -> run(batch) -> process(results)``:
- schedule: a prefill batch (chunked under ``chunked_prefill_size``) when requests wait and KV admits
  them, otherwise a decode batch of every running request;
- run: one target forward (prefill/decode) or one speculative step (draft, tree, verify, commit);
- process: append tokens, finish on stop/EOS/length, free KV, report ``TokenOut`` deltas.
KV exhaustion during decode retracts the newest request back to the queue (its output is kept).
"""

from __future__ import annotations

import logging
import random
from collections import deque
from dataclasses import dataclass

import torch

from model_executor.forward_batch import ForwardMode, build_forward_batch
from model_executor.model_config import ModelConfig
from model_executor.model_runner import ModelRunner
from model_executor.sampler import BatchSamplingInfo, sample, token_logprobs
from model_executor.sampling_params import find_stop
from server.config import ServerConfig
from server.io_struct import GenerateReq, SchedulerStats, TokenOut
from server.request import Req
from server.spec_setup import build_spec_worker
from speculative.types import OutOfKVSlots

logger = logging.getLogger(__name__)


@dataclass
class Batch:
    mode: ForwardMode
    reqs: list[Req]
    chunk_lens: list[int]  # new tokens per request (prefill); 1 per request (decode)


class Scheduler:
    def __init__(self, config: ServerConfig, tp=None, model_path: str | None = None):
        from model_executor.parallel_state import TPGroup
        from server.model_path import resolve_model_path

        self.config = config
        self.model_path = model_path or resolve_model_path(config.model.model_path)
        device = _resolve_device(config.model.device)
        self.model_config = ModelConfig.load(self.model_path, config.model.dtype, device, config.model.int4_experts)
        self.max_context_len = config.model.context_length or self.model_config.max_context_len
        self.eos_token_ids = self.model_config.eos_token_ids
        sc = config.scheduler
        self.runner = ModelRunner(self.model_config, config.cache.max_total_tokens, config.cache.kv_memory_gb,
                                  sc.max_running_requests + 1, self.max_context_len, tp or TPGroup(), device)
        self.spec = build_spec_worker(config.speculative, self.runner, self.model_config)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.outbox: list[TokenOut] = []
        self._seed_rng = random.Random(0x5EED)
        self.total_verify_steps = 0
        self.total_spec_tokens = 0

    # ---------------------------------------------------------------- requests in / out
    def add_request(self, req: GenerateReq) -> None:
        p = req.params
        p.validate()
        if not req.input_ids:
            raise ValueError("prompt must not be empty")
        if len(req.input_ids) + p.max_tokens > self.max_context_len:
            raise ValueError(
                f"prompt ({len(req.input_ids)} tokens) plus max_tokens ({p.max_tokens}) exceeds the context "
                f"length {self.max_context_len}")
        if len(req.input_ids) + p.max_tokens + self._spec_margin() > self.runner.num_slots:
            raise ValueError(f"prompt plus max_tokens exceeds the KV cache capacity ({self.runner.num_slots} tokens)")
        vocab = self.model_config.vocab_size
        if min(req.input_ids) < 0 or max(req.input_ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        seed = p.seed if p.seed is not None else self._seed_rng.getrandbits(63)
        gen = torch.Generator().manual_seed(seed)
        self.waiting.append(Req(req.rid, list(req.input_ids), p, gen))

    def abort_request(self, rid: str) -> None:
        for req in list(self.waiting):
            if req.rid == rid:
                self.waiting.remove(req)
                self._release(req)
                self._finish_out(req, "abort")
        for req in list(self.running):
            if req.rid == rid:
                self.running.remove(req)
                self._release(req)
                self._finish_out(req, "abort")

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.outbox)

    def stats(self) -> SchedulerStats:
        alloc = self.runner.allocator
        return SchedulerStats(running=len(self.running), waiting=len(self.waiting),
                              kv_used_tokens=alloc.num_slots - alloc.num_free, kv_total_tokens=alloc.num_slots,
                              spec_verify_steps=self.total_verify_steps,
                              spec_generated_tokens=self.total_spec_tokens,
                              spec_budget=self.spec.controller.stats() if self.spec and self.spec.controller else {})

    # ---------------------------------------------------------------- the step
    def step(self) -> list[TokenOut]:
        batch = self.schedule()
        if batch is not None:
            results = self.run(batch)
            self.process(batch, results)
        out, self.outbox = self.outbox, []
        return out

    def schedule(self) -> Batch | None:
        prefill = self._schedule_prefill()
        if prefill is not None:
            return prefill
        if self.running:
            return Batch(ForwardMode.DECODE, list(self.running), [1] * len(self.running))
        return None

    def run(self, batch: Batch) -> list[list[int]]:
        if batch.mode == ForwardMode.EXTEND:
            return self._run_prefill(batch)
        if self.spec is not None:
            return self._run_spec_decode(batch)
        return self._run_decode(batch)

    def process(self, batch: Batch, results: list[list[int]]) -> None:
        for req, tokens in zip(batch.reqs, results, strict=True):
            if not tokens:
                continue
            keep, reason = find_stop(tokens, req.params, self.eos_token_ids, req.remaining_tokens)
            if self.spec is not None and keep < len(tokens):
                raise AssertionError("the speculative commit must truncate at stops itself")
            req.output_ids.extend(tokens[:keep])
            if reason is None and req.seq_len >= self.max_context_len:
                reason = "length"
            if reason is not None:
                self.running.remove(req)
                self._release(req)
                self._finish_out(req, reason)
            else:
                self._delta_out(req)

    # ---------------------------------------------------------------- prefill
    def _schedule_prefill(self) -> Batch | None:
        budget = self.config.scheduler.chunked_prefill_size
        reqs, lens = [], []
        alloc, pool = self.runner.allocator, self.runner.req_to_token
        headroom = len(self.running) * self._spec_margin()
        free = alloc.num_free - headroom
        while self.waiting and budget > 0 and len(self.running) + len(reqs) < self.config.scheduler.max_running_requests:
            req = self.waiting[0]
            n = min(_prefill_len(req) - req.num_cached, budget)
            if n > free:
                break
            if req.req_pool_idx is None:
                idx = pool.alloc()
                if idx is None:
                    break
                req.req_pool_idx = idx
            reqs.append(req)
            lens.append(n)
            budget -= n
            free -= n
            if req.num_cached + n == _prefill_len(req):
                self.waiting.popleft()
            else:
                break  # a partially prefilled request stays at the head of the queue
        return Batch(ForwardMode.EXTEND, reqs, lens) if reqs else None

    def _run_prefill(self, batch: Batch) -> list[list[int]]:
        r = self.runner
        dev = r.device
        total = sum(batch.chunk_lens)
        slots = r.allocator.alloc(total)
        assert slots is not None, "admission checked free slots"
        ids, pos, ends = [], [], []
        off = 0
        for req, n in zip(batch.reqs, batch.chunk_lens, strict=True):
            start = req.num_cached
            r.req_to_token.table[req.req_pool_idx, start:start + n] = slots[off:off + n]
            ids.extend(req.all_ids[start:start + n])
            pos.extend(range(start, start + n))
            off += n
            ends.append(start + n == _prefill_len(req) and not req.output_ids)  # needs a first token
        cum = torch.tensor(batch.chunk_lens).cumsum(0) - 1
        done = [i for i, e in enumerate(ends) if e]
        fb = build_forward_batch(
            ForwardMode.EXTEND, torch.tensor(ids, device=dev), torch.tensor(pos, device=dev), slots,
            r.req_to_token.table, torch.tensor([q.req_pool_idx for q in batch.reqs], device=dev),
            torch.tensor([q.num_cached for q in batch.reqs]), torch.tensor(batch.chunk_lens),
            capture_layer_ids=self.spec.capture_layer_ids if self.spec is not None else ())
        out = r.forward(fb)
        if self.spec is not None:
            self.spec.on_extend(fb, out.captured)
        for req, n in zip(batch.reqs, batch.chunk_lens, strict=True):
            req.num_cached += n
        results: list[list[int]] = [[] for _ in batch.reqs]
        if done:
            tokens = self._sample([batch.reqs[i] for i in done], r.logits(out.hidden[cum[done]]))  # [n_done, V]
            for j, i in enumerate(done):
                results[i] = [tokens[j]]
        for req in batch.reqs:
            if req.num_cached == _prefill_len(req):
                self.running.append(req)  # a retracted request resumes without a new token
        return results

    # ---------------------------------------------------------------- decode
    def _run_decode(self, batch: Batch) -> list[list[int]]:
        r = self.runner
        dev = r.device
        slots = self._alloc_or_retract(batch, 1)
        reqs = batch.reqs
        idx = torch.tensor([q.req_pool_idx for q in reqs], device=dev)
        cached = torch.tensor([q.num_cached for q in reqs], device=dev)
        r.req_to_token.table[idx, cached] = slots
        fb = build_forward_batch(
            ForwardMode.DECODE, torch.tensor([q.output_ids[-1] for q in reqs], device=dev), cached, slots,
            r.req_to_token.table, idx, cached, torch.ones(len(reqs), dtype=torch.int64))
        out = r.forward(fb)
        for q in reqs:
            q.num_cached += 1
        tokens = self._sample(reqs, r.logits(out.hidden))
        return [[t] for t in tokens]

    def _run_spec_decode(self, batch: Batch) -> list[list[int]]:
        while True:
            try:
                results = self.spec.decode(batch.reqs, self.eos_token_ids)
                break
            except OutOfKVSlots:
                self._retract_one(batch)
        out = []
        for req, res in zip(batch.reqs, results, strict=True):
            req.spec_verify_steps += 1
            req.spec_accepted_tokens += res.accepted
            req.spec_budget_sum += res.budget
            self.total_verify_steps += 1
            self.total_spec_tokens += len(res.tokens)
            if req.params.logprobs is not None and res.logprobs is not None:
                req.pending_logprobs.extend(res.logprobs)
            out.append(res.tokens)
        return out

    def _alloc_or_retract(self, batch: Batch, per_req: int) -> torch.Tensor:
        while True:
            slots = self.runner.allocator.alloc(per_req * len(batch.reqs))
            if slots is not None:
                return slots
            self._retract_one(batch)

    def _retract_one(self, batch: Batch) -> None:
        if len(batch.reqs) <= 1:
            raise RuntimeError("KV cache too small for a single request")
        victim = batch.reqs.pop()
        self.running.remove(victim)
        self._release(victim)
        self.waiting.appendleft(victim)
        logger.info("KV full: retracted %s back to the queue", victim.rid)

    def _sample(self, reqs: list[Req], logits: torch.Tensor) -> list[int]:
        info = BatchSamplingInfo.build([q.params for q in reqs], logits.shape[-1], logits.device)
        tokens = sample(logits, info, [q.generator for q in reqs])
        for i, q in enumerate(reqs):
            if q.params.logprobs is not None:
                q.pending_logprobs.extend(token_logprobs(logits[i:i + 1], tokens[i:i + 1], q.params.logprobs))
        return tokens.tolist()

    # ---------------------------------------------------------------- KV bookkeeping
    def _spec_margin(self) -> int:
        return self.spec.max_step_tokens if self.spec is not None else 1

    def _release(self, req: Req) -> None:
        r = self.runner
        if req.req_pool_idx is not None:
            r.allocator.free(r.req_to_token.table[req.req_pool_idx, :req.num_cached].clone())
            r.req_to_token.free(req.req_pool_idx)
        req.req_pool_idx, req.num_cached = None, 0

    def _delta_out(self, req: Req) -> None:
        new = req.output_ids[req.sent_tokens:]
        if new:
            self.outbox.append(self._token_out(req, new))
            req.sent_tokens = len(req.output_ids)

    def _finish_out(self, req: Req, reason: str) -> None:
        req.finish_reason = reason
        out = self._token_out(req, req.output_ids[req.sent_tokens:])
        out.finished, out.finish_reason = True, reason
        req.sent_tokens = len(req.output_ids)
        self.outbox.append(out)

    def _token_out(self, req: Req, new: list[int]) -> TokenOut:
        lps = None
        if req.params.logprobs is not None:
            lps, req.pending_logprobs = req.pending_logprobs[:len(new)], req.pending_logprobs[len(new):]
        return TokenOut(req.rid, list(new), prompt_tokens=len(req.prompt_ids), completion_tokens=len(req.output_ids),
                        spec_verify_steps=req.spec_verify_steps, spec_accepted_tokens=req.spec_accepted_tokens,
                        spec_budget_sum=req.spec_budget_sum,
                        logprobs=lps)


def _prefill_len(req: Req) -> int:
    """Tokens to cache before decoding: all of them, except the last emitted token (the next root)."""
    return req.seq_len - (1 if req.output_ids else 0)


def _resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device
