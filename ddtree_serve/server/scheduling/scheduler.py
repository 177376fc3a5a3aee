"""The scheduler core: continuous batching over one ModelRunner (TP rank 0 view).

One step reads as ``schedule() -> run(batch) -> process(results)``:
- schedule: a prefill batch (chunked under ``chunked_prefill_size``) when requests wait and KV admits
  them, otherwise a decode batch of every running request;
- run: one target forward (prefill/decode) or one speculative step (draft, tree, verify, commit);
- process: append tokens, finish on stop/EOS/length, release KV, report ``TokenOut`` deltas.
A request's KV slots go through ``ReqKVManager`` (ddtree_serve/server/scheduling/kv_manager.py): admission matches the longest
cached prefix (radix cache), release hands the tokens to the cache. KV exhaustion evicts unused cached
prefixes first, then retracts the newest request back to the queue (its output is kept).
"""

from __future__ import annotations

import dataclasses
import logging
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from ddtree_serve.kernels.dispatch import check_tree_walk
from ddtree_serve.model_executor.forward_batch import ForwardMode
from ddtree_serve.model_executor.grammar import GrammarBackend
from ddtree_serve.model_executor.grammar.queue import GrammarQueue
from ddtree_serve.model_executor.memory import MemoryProbe, device_memory
from ddtree_serve.model_executor.model_runner import ModelRunner
from ddtree_serve.model_executor.parallel_state import TPGroup
from ddtree_serve.model_executor.penalties import TokenCounts
from ddtree_serve.model_executor.sampler import sample_requests
from ddtree_serve.model_executor.sampling_params import find_stop
from ddtree_serve.model_executor.vocab_shard import VocabShard
from ddtree_serve.server.config import ServerConfig
from ddtree_serve.server.io_struct import GenerateReq, SchedulerStats, TokenOut
from ddtree_serve.server.memory_sizing import ModelFacts, size_startup_memory
from ddtree_serve.server.scheduling.decode_ahead import DecodeAhead, plain_decode
from ddtree_serve.server.scheduling.image_prefill import check_images, prefill_embeds
from ddtree_serve.server.scheduling.kv_manager import ReqKVManager
from ddtree_serve.server.scheduling.prompt_scoring import score_prompt_chunk
from ddtree_serve.server.scheduling.request import AdmissionError, Req
from ddtree_serve.server.scheduling.spec_counters import SpecCounters
from ddtree_serve.server.startup import is_resolved, resolve_cuda_graphs, target_model_config
from ddtree_serve.speculative.spec_worker import SpecWorker
from ddtree_serve.speculative.types import OutOfKVSlots
from ddtree_serve.speculative.worker_graphs import pad_for_graphs

logger = logging.getLogger(__name__)


@dataclass
class Batch:
    mode: ForwardMode
    reqs: list[Req]
    chunk_lens: list[int]  # new tokens per request (prefill); 1 per request (decode)


class Scheduler:
    takes_requests_mid_step: ClassVar[bool] = True  # add_request is safe inside a step's overlap window
    def __init__(self, config: ServerConfig, tp: TPGroup | None = None, memory_probe: MemoryProbe = device_memory):
        """``config`` is resolved (ddtree_serve/server/startup.py: a model directory and a concrete device); ``tp``: this
        rank's TP group (None: a single process); ``memory_probe``: ``(total, used)`` bytes of a device, read
        once to size the KV pool."""
        if not is_resolved(config):
            raise ValueError("Scheduler needs a resolved config (ddtree_serve.server.startup.resolve_config)")
        self.model_config = target_model_config(config)
        self.config = config = resolve_cuda_graphs(config, self.model_config)  # a concrete graph bound
        self.model_path, device = config.model.model_path, config.model.device
        self.max_context_len = config.model.context_length or self.model_config.max_context_len
        self.eos_token_ids = self.model_config.eos_token_ids
        self.vocab_size = self.model_config.vocab_size  # token ids (prompt, logit_bias) are below it
        sc = config.scheduler
        tp = tp or TPGroup(vocab_parallel=config.parallel.vocab_parallel_logits)  # (a simulated device's model)
        self.runner = ModelRunner(self.model_config, sc.max_running_requests + 1, self.max_context_len, tp, device,
                                  cuda_graph_max_bs=config.model.cuda_graph_max_bs)
        spec = config.speculative
        if spec.enabled:  # on CUDA: sgl-kernel's tree walk, or the torch reference asked for (a start-up error)
            check_tree_walk(self.runner.device)
        self.spec = SpecWorker.create(spec, self.runner, self.model_config) if spec.enabled else None
        self.launch_ahead = not sc.disable_overlap_schedule  # forwards launched before a step's read (DESIGN 4.17)
        if self.spec is not None:
            self.spec.launch_ahead = self.launch_ahead
        self._size_memory(config, tp, device, memory_probe)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.outbox: list[TokenOut] = []
        self.grammars = GrammarQueue(lambda: GrammarBackend.from_model_path(  # structured outputs (lazy)
            self.model_path, self.model_config.vocab_size, self.eos_token_ids, config.model.trust_remote_code),
            blocking=tp.size > 1)
        self.step_batch: Batch | None = None  # the running step's batch (ddtree_serve/server/scheduling/step_recovery.py)
        self.decode_ahead: DecodeAhead | None = None  # the next plain decode's forward, launched (decode_ahead.py)
        self._seed_rng = random.Random(0x5EED)
        self.total_verify_steps = 0
        self.total_spec_tokens = 0
        self.spec_counters = SpecCounters()

    def close(self) -> None:
        """Nothing to release in a single process (``SchedulerLike.close``; TP rank 0 stops its followers)."""

    def _size_memory(self, config: ServerConfig, tp, device: str, probe: MemoryProbe) -> None:
        """With the target and drafter weights resident: reserve the step workspace, size the KV pool from
        what is left (ddtree_serve/model_executor/memory.py), allocate it, and hand the verify cap to the worker."""
        spec, cache, mc = self.spec, config.cache, self.model_config
        facts = ModelFacts(mc.vocab_size, self.max_context_len,
                           self.runner.kv_bytes_per_token + (spec.draft_kv_bytes_per_token if spec else 0),
                           spec.budget if spec else None, spec.block_size if spec else None,
                           mc.hidden_size, mc.dtype.itemsize, mc.hidden_size * len(spec.capture_layer_ids) if spec else 0,
                           getattr(self.runner.model, "encoder_peak_bytes", lambda: 0)())  # vision tower
        sizing = size_startup_memory(config, facts, device, tp, probe)
        self.workspace, self.kv_sizing = sizing.workspace, sizing.kv
        logger.info("%s", sizing.log_line())
        self.runner.allocate_kv(self.kv_sizing.tokens, table_margin=spec.max_step_tokens if spec else 0)
        self.kv = ReqKVManager(self.runner.slots, not cache.disable_radix_cache, cache.radix_eviction_policy)
        if spec is not None:
            spec.allocate_kv()
            spec.max_verify_tokens = self.workspace.max_verify_tokens
            pad_for_graphs(spec, self.runner.graph_batch_sizes)  # trees padded to captured widths (DESIGN 4.17)
            if self.runner.graphs is None:  # no graph to capture first (CPU, the simulated device): probe now
                spec.probe_cost()  # (else the warm-up does, once it captured them: ddtree_serve/server/warmup.py)

    # ---------------------------------------------------------------- requests in / out
    def add_request(self, req: GenerateReq) -> None:
        p = req.params
        vocab = self.model_config.vocab_size
        p.validate(vocab)
        if not req.input_ids:
            raise AdmissionError("prompt must not be empty", "prompt")
        n = len(req.input_ids)
        if p.max_tokens is None:  # until the request limit: ends with "length" there
            if n + 1 > self.max_request_tokens:
                raise AdmissionError(f"the prompt ({n} tokens) leaves no room to generate: a request holds at most "
                                     f"{self.max_request_tokens} tokens (context length {self.max_context_len}, "
                                     f"KV cache {self.runner.num_slots} tokens)", "prompt")
            p = dataclasses.replace(p, max_tokens=self.max_request_tokens - n)
        elif p.clamp_max_tokens and self.max_request_tokens > n and n + p.max_tokens > self.max_request_tokens:
            room = self.max_request_tokens - n  # lowered to the room left (the agent APIs; --allow-auto-truncate)
            p = dataclasses.replace(p, max_tokens=room, min_tokens=min(p.min_tokens, room))
        if n + p.max_tokens > self.max_context_len:
            raise AdmissionError(f"prompt ({n} tokens) plus max_tokens ({p.max_tokens}) exceeds the context length "
                                 f"{self.max_context_len}", "prompt")  # OpenAI names the prompt (messages)
        if n + p.max_tokens + self._spec_margin() > self.runner.num_slots:
            raise AdmissionError(f"prompt plus max_tokens exceeds the KV cache capacity ({self.runner.num_slots} "
                                 "tokens)", "prompt")
        if min(req.input_ids) < 0 or max(req.input_ids) >= vocab:
            raise AdmissionError(f"prompt token ids must be in [0, {vocab})", "prompt")
        if p.min_tokens > 0:  # min_tokens bans the stop ids until then (model_executor/penalties.py)
            p = dataclasses.replace(p, min_tokens_ban=tuple(sorted({*self.eos_token_ids, *p.stop_token_ids})))
        if p.seed is None:  # a concrete seed for every request: its draws are position-keyed (sampler.py)
            p = dataclasses.replace(p, seed=self._seed_rng.getrandbits(63))
        gen = torch.Generator().manual_seed(p.seed % (1 << 63))  # relaxed acceptance's coins only (verify.py)
        counts = TokenCounts(req.input_ids, vocab, self.runner.device) if p.needs_token_counts else None
        check_images(req, self.runner.model)
        new = Req(req.rid, list(req.input_ids), p, gen, token_counts=counts, images=tuple(req.images))
        if p.grammar is not None:
            self.grammars.submit(new)
        else:
            self.waiting.append(new)

    @property
    def max_request_tokens(self) -> int:
        """Most prompt + output tokens one request may hold: the context length, or the KV pool less one
        step's temporary slots, whichever is smaller."""
        return min(self.max_context_len, self.runner.num_slots - self._spec_margin())

    def abort_request(self, rid: str) -> None:
        for req in self.grammars.remove(rid):
            self._finish_out(req, "abort")
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
        return bool(self.waiting or self.running or self.outbox or len(self.grammars))

    def stats(self) -> SchedulerStats:
        kv = self.runner.slots
        return SchedulerStats(running=len(self.running), waiting=len(self.waiting),
                              kv_used_tokens=kv.num_slots - self.kv.available, kv_total_tokens=kv.num_slots,
                              cache_hit_tokens=self.kv.hit_tokens, cache_query_tokens=self.kv.query_tokens,
                              cache_held_tokens=self.kv.cached_tokens,
                              spec_verify_steps=self.total_verify_steps,
                              spec_generated_tokens=self.total_spec_tokens,
                              spec_drafts=self.spec_counters.drafts, spec_draft_tokens=self.spec_counters.draft_tokens,
                              spec_accepted_tokens=self.spec_counters.accepted,
                              spec_accepted_per_pos=tuple(self.spec_counters.per_pos),
                              spec_budget=self.spec.controller.stats() if self.spec and self.spec.controller else {})

    # ---------------------------------------------------------------- the step
    def step(self) -> list[TokenOut]:
        self.step_batch = None  # what ddtree_serve/server/scheduling/step_recovery.py fails if this step raises (None: everything)
        for req, err in self.grammars.poll(idle=not (self.waiting or self.running)):  # compiled grammars
            if err is None:
                self.waiting.append(req)
            else:
                self.outbox.append(TokenOut(req.rid, [], finished=True, error=err, prompt_tokens=len(req.prompt_ids),
                                            error_param=req.params.grammar[0]))  # the grammar's kind
        with self.runner.device_session():  # a simulated device charges the host's acts (ddtree_serve/sim/)
            batch = self.step_batch = self.schedule()
            if batch is not None:
                results = self.run(batch)
                self.process(batch, results)
        out, self.outbox = self.outbox, []
        return out

    def set_host_window(self, work: Callable[[], None] | None) -> None:
        """Host work to run while the device runs a step's forward (the overlap window, ``ModelRunner.wait_device``);
        it must not change the running step's requests (adding new ones is fine). None: no window."""
        self.runner.while_busy = work

    def fail_step(self) -> list[str]:
        """After ``step`` raised: fail that step's requests, free their KV (ddtree_serve/server/scheduling/step_recovery.py)."""
        from ddtree_serve.server.scheduling.step_recovery import fail_step

        return fail_step(self)

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
        return plain_decode(self, batch)  # (decode_ahead.py: the next forward launched before the read)

    def process(self, batch: Batch, results: list[list[int]]) -> None:
        for req, tokens in zip(batch.reqs, results, strict=True):
            if not tokens:
                continue
            keep, reason = find_stop(tokens, req.params, self.eos_token_ids, req.remaining_tokens)
            if self.spec is not None and keep < len(tokens):
                raise AssertionError("the speculative commit must truncate at stops itself")
            req.output_ids.extend(tokens[:keep])
            if req.grammar is not None:
                req.grammar.accept(tokens[:keep])
            if req.token_counts is not None:
                req.token_counts.add(tokens[:keep])
            if reason is None and req.seq_len >= self.max_context_len:
                reason = "length"
            if reason is not None:
                self.running.remove(req)
                self._release(req, finished=True)
                self._finish_out(req, reason)
            else:
                self._delta_out(req)

    # ---------------------------------------------------------------- prefill
    def _schedule_prefill(self) -> Batch | None:
        budget = self.config.scheduler.chunked_prefill_size
        reqs, lens = [], []
        kv = self.kv
        headroom = len(self.running) * (self.spec.min_step_tokens if self.spec is not None else 1)
        planned = 0
        while self.waiting and budget > 0 and len(self.running) + len(reqs) < self.config.scheduler.max_running_requests:
            req = self.waiting[0]
            fresh = req.req_pool_idx is None
            if fresh and not kv.admit(req, req.prefill_len):  # a request row and the cached prefix
                break
            n = min(req.prefill_len - req.num_cached, budget)
            if n > kv.available - headroom - planned:
                if fresh:
                    kv.release(req)  # no room yet: unlock the matched prefix again
                break
            if fresh:
                kv.count_admission(req)
            reqs.append(req)
            lens.append(n)
            budget -= n
            planned += n
            if req.num_cached + n == req.prefill_len:
                self.waiting.popleft()
            else:
                break  # a partially prefilled request stays at the head of the queue
        return Batch(ForwardMode.EXTEND, reqs, lens) if reqs else None

    def _run_prefill(self, batch: Batch) -> list[list[int]]:
        r = self.runner
        ids, ends = [], []
        for req, n in zip(batch.reqs, batch.chunk_lens, strict=True):
            start = req.num_cached
            ids.extend(req.all_ids[start:start + n])
            ends.append(start + n == req.prefill_len and not req.output_ids)  # needs a first token
        cum = torch.tensor(batch.chunk_lens).cumsum(0) - 1
        done = [i for i, e in enumerate(ends) if e]
        self.kv.ensure_free(sum(batch.chunk_lens))  # evicts unused cached prefixes when short
        fb = r.prepare_prefill([q.req_pool_idx for q in batch.reqs], [q.num_cached for q in batch.reqs],
                               batch.chunk_lens, ids,
                               capture_layer_ids=self.spec.capture_layer_ids if self.spec is not None else ())
        assert fb is not None, "admission checked free slots"
        fb.input_embeds = prefill_embeds(r.model, batch.reqs, batch.chunk_lens, fb.input_ids)  # images: [T, H]
        out = r.forward(fb)
        r.wait_device()  # a simulated device's modelled time (ddtree_serve/sim/)
        if self.spec is not None:
            self.spec.on_extend(fb, out.captured)
        score_prompt_chunk(self.runner.logits, batch.reqs, batch.chunk_lens, out.hidden)
        for req, n in zip(batch.reqs, batch.chunk_lens, strict=True):
            req.num_cached += n
            self.kv.cache_prefix(req)  # the chunk's tokens become a shareable prefix
        results: list[list[int]] = [[] for _ in batch.reqs]
        scored_only = [i for i in done if batch.reqs[i].params.max_tokens == 0]
        done = [i for i in done if batch.reqs[i].params.max_tokens > 0]
        if done:
            tokens = self._sample([batch.reqs[i] for i in done], *r.step_logits(out.hidden[cum[done]]))  # [n_done]
            for j, i in enumerate(done):
                results[i] = [tokens[j]]
        for i, req in enumerate(batch.reqs):
            if i in scored_only:  # max_tokens 0: the prompt is scored, nothing is generated
                self._release(req)
                self._finish_out(req, "length")
            elif req.num_cached == req.prefill_len:
                self.running.append(req)  # a retracted request resumes without a new token
        return results

    # ---------------------------------------------------------------- decode
    def _run_spec_decode(self, batch: Batch) -> list[list[int]]:
        while True:
            self._make_room(batch, self.spec.min_step_tokens)
            try:
                results = self.spec.decode(batch.reqs, self.eos_token_ids)
                break
            except OutOfKVSlots:
                self._retract_one(batch)
        out = []
        for req, res in zip(batch.reqs, results, strict=True):
            self.total_verify_steps += req.record_spec_step(res.accepted, res.accepted_suffix, res.budget)
            self.total_spec_tokens += len(res.tokens)
            self.spec_counters.record(res.accepted, res.budget)
            if req.params.logprobs is not None and res.logprobs is not None:
                req.pending_logprobs.extend(res.logprobs)
            out.append(res.tokens)
        return out

    def _make_room(self, batch: Batch, per_req: int) -> None:
        """Free slots for ``per_req`` new tokens of every request in ``batch``: evict unused cached prefixes,
        and retract the newest request only when that is not enough (its tokens become evictable)."""
        while not self.kv.ensure_free(per_req * len(batch.reqs)):
            self._retract_one(batch)

    def _retract_one(self, batch: Batch) -> None:
        if len(batch.reqs) <= 1:
            raise RuntimeError("KV cache too small for a single request")
        victim = batch.reqs.pop()
        self.running.remove(victim)
        self._release(victim)
        self.waiting.appendleft(victim)
        logger.info("KV full: retracted %s back to the queue", victim.rid)

    def _sample(self, reqs: list[Req], logits: torch.Tensor, shard: VocabShard) -> list[int]:
        return self._sample_device(reqs, logits, shard).tolist()

    def _sample_device(self, reqs: list[Req], logits: torch.Tensor, shard: VocabShard) -> torch.Tensor:
        """The requests' next tokens ``[bs]``, still on the device (their logprobs, read, attached)."""
        tokens, lps = sample_requests(reqs, logits, shard)
        for q, lp in zip(reqs, lps, strict=True):
            if lp is not None:
                q.pending_logprobs.extend(lp)
        return tokens

    # ---------------------------------------------------------------- KV bookkeeping
    def _spec_margin(self) -> int:
        return self.spec.max_step_tokens if self.spec is not None else 1

    def _release(self, req: Req, finished: bool = False) -> None:
        """Free a request's KV and its speculative state; a ``finished`` request's output joins the shared
        suffix-draft index (not an aborted, retracted or failed one's). A forward launched ahead for it is dropped."""
        if self.decode_ahead is not None and req.rid in self.decode_ahead.rids:
            self.decode_ahead.release(self.runner.slots)
            self.decode_ahead = None
        self.kv.release(req)
        if self.spec is not None:
            self.spec.release(req.rid, req.output_ids if finished else None)

    def _delta_out(self, req: Req) -> None:
        new = req.output_ids[req.sent_tokens:]
        if new:
            self.outbox.append(req.take_output(new))
            req.sent_tokens = len(req.output_ids)

    def _finish_out(self, req: Req, reason: str) -> None:
        req.finish_reason = reason
        out = req.take_output(req.output_ids[req.sent_tokens:])
        out.finished, out.finish_reason = True, reason
        req.sent_tokens = len(req.output_ids)
        self.outbox.append(out)

