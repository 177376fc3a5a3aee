"""The speculative decode step: DFlash draft -> DDTree build -> one target verify forward -> greedy or
sampled verification -> one unified commit (docs/DESIGN.md section 3; DFlash arXiv 2602.06036, DDTree arXiv
2604.12989).

KV bookkeeping invariant (shared with the scheduler): a running request has ``num_cached = seq_len - 1``
tokens in the target cache; its last emitted token is the root of the next tree and gets its KV in the
verify forward. The drafter's context cache uses the same slot ids as the target's cache and holds the
projected target hidden states of every cached token, so a prefix matched in the prefix cache (its slots
placed in the request's row by the scheduler) carries its drafter features too. Only the committed path
(``num_cached``) ever leaves a step; draft-block and tree slots are temporary (``KVSlots``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch

from ddtree_serve.model_executor.forward_batch import ForwardBatch, HostShape
from ddtree_serve.model_executor.grammar import mask_draft_logits, mask_tree_logits
from ddtree_serve.model_executor.kv_cache import KVCache
from ddtree_serve.model_executor.model_config import ModelConfig
from ddtree_serve.model_executor.model_runner import ModelRunner, pick_attention_backend, warm_up_attention
from ddtree_serve.model_executor.penalties import BatchPenalties
from ddtree_serve.model_executor.position_uniforms import SampleKeys
from ddtree_serve.model_executor.read_back import read_later
from ddtree_serve.model_executor.sampler import BatchSamplingInfo
from ddtree_serve.model_executor.uploads import upload
from ddtree_serve.speculative.auto_device import (
    allowed_budgets,
    device_budget,
    learn_from_read,
    next_budget,
    pop_width,
    step_times,
    tree_tensors,
)
from ddtree_serve.speculative.budget import DRAFT, PLAIN, SUFFIX_ONLY, BudgetController
from ddtree_serve.speculative.budget_config import BudgetConfig
from ddtree_serve.speculative.commit import attach_logprobs, commit, commit_paths
from ddtree_serve.speculative.ddtree import SUFFIX, DraftTree, draft_topk
from ddtree_serve.speculative.deferred_context import DeferredContext
from ddtree_serve.speculative.draft_ahead import DraftAhead, draft_next
from ddtree_serve.speculative.draft_graphs import DraftGraphs
from ddtree_serve.speculative.draft_loading import load_draft_sources
from ddtree_serve.speculative.draft_sources import step_suffix_drafts
from ddtree_serve.speculative.host_tree import host_tree
from ddtree_serve.speculative.plain_step import plain_step
from ddtree_serve.speculative.step_cost import StepCostModel
from ddtree_serve.speculative.step_timer import StepTimer
from ddtree_serve.speculative.suffix_gate import SuffixGate, evidence_ratios
from ddtree_serve.speculative.suffix_index import SuffixConfig, SuffixProposer
from ddtree_serve.speculative.tree_forward import (
    VerifyInputs,
    draft_forward,
    padded_width,
    run_verify,
    verify_forward,
)
from ddtree_serve.speculative.tree_graphs import DeviceTreeBuilder
from ddtree_serve.speculative.types import DecodeResult, OutOfKVSlots, SpecRequest, SpecSettings
from ddtree_serve.speculative.verify import verify_tree
from ddtree_serve.speculative.worker_shape import step_shape

logger = logging.getLogger(__name__)


class SpecWorker:
    """budget: an int (fixed tree size) or "auto" (``ddtree_serve.speculative.budget``: per step and request, from measured
    cost and calibrated expected acceptance, at most ``max_budget``; 0 everywhere = a plain decode step).
    drafter: the DFlash drafter, or None (suffix drafts alone); suffix: the suffix-draft settings, or None
    (no suffix drafts). At least one of the two is given."""

    def __init__(self, algorithm: str, drafter: torch.nn.Module | None, budget: int | str, block_size: int,
                 runner: ModelRunner, max_budget: int = 64, accept_thresholds: tuple[float, float] = (1.0, 1.0),
                 budget_config: BudgetConfig | None = None, suffix: SuffixConfig | None = None):
        auto = budget == "auto"  # the values were checked once, by the configuration (ddtree_serve/server/config.py)
        self.chain = algorithm == "dflash"
        self.drafter = drafter
        self.runner = runner
        self.block_size, self.budget = step_shape(algorithm, budget, max_budget, block_size if drafter is not None
                                                  else None)
        self.depth_limit = self.block_size - 1  # the drafter's deepest level
        self.suffix = SuffixProposer(suffix) if suffix is not None else None
        # on an accelerator, which steps' suffix drafts leave the device path (suffix_gate.py); with both sources
        self.suffix_gate = SuffixGate(self.block_size) if suffix is not None and drafter is not None else None
        self.tree_depth = max(self.depth_limit, suffix.max_depth if suffix is not None else 0)  # any source's
        self.accept_thresholds = accept_thresholds
        self.max_verify_tokens: int | None = None  # per-step cap on verified tree tokens (roots included)
        self.verify_widths: dict[int, tuple[int, ...]] = {}  # padded batch size -> captured tree widths ({}: ragged)
        self.tree_builder = DeviceTreeBuilder()  # fixed budgets' device-built trees (graphed: worker_graphs.py)
        self.draft_graphs: DraftGraphs | None = None  # the drafter's forward as graph replays (worker_graphs.py)
        self.capture_layer_ids = tuple(drafter.target_layer_ids) if drafter is not None else ()
        self.draft_kv: KVCache | None = None
        self.draft_backend = None
        if drafter is not None:  # the drafter's own attention backend: its head dims may differ from the target's
            layout = drafter.kv_cache_layout()
            self.draft_backend = pick_attention_backend(runner.device, runner.config.dtype, layout)
            # tree-masked (custom-mask prefill) forwards only: flashinfer's decode would compile for unused shapes
            warm_up_attention(self.draft_backend, layout, drafter, runner.config.dtype, runner.device, ("tree",))
        self.timer = StepTimer(runner)
        self.auto, self.budget_config = auto, budget_config
        self.controller: BudgetController | None = None  # auto budget: built once the KV cache exists
        self.mask_drafts = True  # grammar masks on the drafter's logits + pruning of rejected nodes
        self.deferred: DeferredContext | None = None  # plain steps' drafter context (allocate_kv)
        self.ahead: DraftAhead | None = None  # the next step's trees (and forward), launched before this step's read
        self.ahead_taken, self.launch_ahead = 0, True  # steps that took one; off: serial (--disable-overlap-schedule)
        self.read_at: float | None = None  # when the last speculative step's read landed (the host clock)
        if runner.num_slots:
            self.allocate_kv()
            self.probe_cost()

    @property
    def draft_kv_bytes_per_token(self) -> int:
        return 0 if self.drafter is None else self.drafter.kv_cache_layout().bytes_per_token(self.runner.config.dtype)

    def allocate_kv(self) -> None:
        """The drafter's context cache, one slot per target KV slot (after the runner's ``allocate_kv``); then,
        for the auto budget, the controller and its step-cost model (``probe_cost`` fills it)."""
        r = self.runner
        if self.drafter is not None:
            # indexed by target slot id: unsharded under DCP too (every global id, padding ones included)
            self.draft_kv = KVCache(self.drafter.kv_cache_layout(), r.slots.id_space - 1, r.config.dtype, r.device)
        if self.auto:
            cfg = self.budget_config or BudgetConfig(max_budget=self.budget)
            if self.drafter is not None:
                self.deferred = DeferredContext(
                    lambda c, p, s: self.drafter.write_context(c, p, s, self.draft_kv), cfg.deferred_context_tokens)
            max_reqs = r.slots.max_rows - 1
            cost = StepCostModel(max_reqs, self.budget)
            # an accelerator pads every verify forward (the device-built tree; captured widths): padded choices
            self.controller = BudgetController(cfg, self.tree_depth, cost, padded=r.accelerated)
            self.controller.widths_for = lambda bs: allowed_budgets(self.verify_widths, bs)

    def probe_cost(self) -> None:
        """The auto budget's start-up probe of its step-cost model (real forwards, ``cost_probe.py``), once: after
        the trees are padded for the graphs and the graphs exist, so that it times what the steps run."""
        ctl = self.controller
        if ctl is not None and not ctl.cost.probed:
            from ddtree_serve.speculative.cost_probe import probe_step_cost

            probe_step_cost(self, ctl.cost, ctl.config.probe_seconds)

    @classmethod
    def create(cls, settings: SpecSettings, runner: ModelRunner, target_config: ModelConfig) -> SpecWorker:
        """The worker of ``settings``, its draft sources loaded (``draft_loading.py``); warns when the accept
        thresholds make sampling lossy."""
        drafter, bsz, suffix = load_draft_sources(settings, runner, target_config)
        thresholds = (settings.accept_threshold_single, settings.accept_threshold_acc)
        if settings.lossy:
            logger.warning("speculative accept thresholds single=%g acc=%g are below 1: sampled verification is "
                           "LOSSY (outputs no longer follow the target distribution)", *thresholds)
        return cls(settings.algorithm, drafter, settings.ddtree_budget, bsz, runner, settings.ddtree_max_budget,
                   thresholds, suffix=suffix)

    @property
    def max_step_tokens(self) -> int:
        """KV slots one request may hold temporarily during a step."""
        return max(self.block_size, self.budget + 1)

    @property
    def min_step_tokens(self) -> int:
        """KV slots per request a step needs free. Fixed budgets: ``max_step_tokens``. Auto: 1, a plain decode
        step; it drafts only when the draft block fits and caps the trees at the slots that are free, so
        speculation never takes KV (prefix cache, admissions) from plain decoding."""
        return 1 if self.auto else self.max_step_tokens

    # ---------------------------------------------------------------- prefill hook
    @torch.inference_mode()
    def on_extend(self, fb: ForwardBatch, captured: torch.Tensor) -> None:
        """Write drafter context features for the tokens a target extend forward just cached (a draft ahead is
        for the very next decode step: dropped)."""
        self.drop_ahead()
        self._write_context(captured, fb.positions, fb.out_cache_loc)

    def _write_context(self, captured: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """Store context features in the drafter's cache, after every deferred write (their order kept)."""
        if self.drafter is None:
            return
        self.flush_context()
        self.drafter.write_context(captured, positions, slots, self.draft_kv)

    def release(self, rid: str, output: list[int] | None = None) -> None:
        """A request left the running set (finished, aborted, retracted, failed): free its suffix index;
        ``output``: a finished request's generated tokens, which the shared suffix index keeps. A verify forward
        prepared ahead for a batch with it is dropped (its tree stays, for the others' rows)."""
        if self.ahead is not None and rid in self.ahead.rids:
            self.ahead.release(rid, self.runner.slots)
        if self.suffix is not None:
            self.suffix.release(rid, output)

    def drop_ahead(self) -> None:
        """Forget the draft ahead (draft_ahead.py), freeing a prepared verify forward's slots."""
        if self.ahead is not None:
            self.ahead.drop_prepared(self.runner.slots)
        self.ahead = None

    def flush_context(self) -> None:
        """Write the plain steps' deferred drafter context (before anything reads the drafter's cache)."""
        if self.deferred is not None:
            self.deferred.flush()

    # ---------------------------------------------------------------- the step
    @torch.inference_mode()
    def decode(self, reqs: Sequence[SpecRequest], eos_ids: tuple[int, ...]) -> list[DecodeResult]:
        """One speculative step over ``reqs`` (module docstring); the draft ahead of the previous step, if any
        (draft_ahead.py), is this step's to take, and its prepared slots are freed unless the step used them."""
        ahead, self.ahead = self.ahead, None
        try:
            return self._step(reqs, eos_ids, ahead)
        finally:
            if ahead is not None:
                ahead.drop_prepared(self.runner.slots)

    def _step(self, reqs: Sequence[SpecRequest], eos_ids: tuple[int, ...], ahead: DraftAhead | None
              ) -> list[DecodeResult]:
        r = self.runner
        bs = len(reqs)
        room = r.slots.num_free
        if room < bs * self.min_step_tokens and ahead is not None:  # the slots of a forward launched ahead back
            ahead.drop_prepared(r.slots)
            room = r.slots.num_free
        if room < bs * self.min_step_tokens:
            raise OutOfKVSlots()
        t = self.timer
        t.start()
        t0 = t.now()
        dev = r.device
        rows = [q.req_pool_idx for q in reqs]  # [bs] host lists: a plain step needs no tensors of them
        root_pos = [q.num_cached for q in reqs]  # [bs] = root position
        root_ids = [q.output_ids[-1] for q in reqs]  # [bs]
        sampled = np.array([not q.params.is_greedy for q in reqs])  # [bs] bool
        ctl = self.controller  # auto budget; under TP rank 0 decides (timings differ per rank) and broadcasts
        cap = self.max_verify_tokens  # tree tokens, roots included: the verify workspace, and (auto) the free slots
        # a request with one token left can take no tree node: where none can, no source would be of use
        max_depths = [q.remaining_tokens - 1 for q in reqs]  # deeper nodes could never be emitted
        useful = max(max_depths) > 0
        suffix = step_suffix_drafts(self.suffix, reqs, max_depths, r.tp) if useful and self.suffix is not None else None
        grammars = [q.grammar for q in reqs]
        mask_drafts = self.mask_drafts and any(g is not None for g in grammars)
        if suffix is not None and self.suffix_gate is not None and r.accelerated and not mask_drafts:
            admit = self.suffix_gate.admits(suffix, ctl.suffix_ratios(sampled, suffix) if ctl is not None
                                            else evidence_ratios(suffix))
            suffix = suffix if r.tp.broadcast_object(admit) else None  # (rank 0's ratios decide) none: device path
        draft_fits = useful and self.drafter is not None
        if ctl is not None:
            room += ahead.held if ahead is not None else 0  # a forward launched ahead holds this step's slots
            cap = room if cap is None else min(cap, room)
            draft_fits = draft_fits and room >= bs * self.block_size  # the block (freed before the verify forward)
            plan = int(r.tp.broadcast_object(ctl.plan_step(sampled, draft_fits, suffix, cap)))
        else:
            plan = DRAFT if draft_fits else SUFFIX_ONLY if suffix is not None else PLAIN
        if plan == PLAIN:
            return plain_step(self, reqs, rows, root_pos, root_ids, sampled, None)
        idx = upload(rows, dev, torch.int64)  # [bs] asynchronous copies (model_executor/uploads.py)
        cached = upload(root_pos, dev, torch.int64)  # [bs]
        roots = upload(root_ids, dev, torch.int64)  # [bs]
        # the trees popped and assembled on the device (DESIGN 4.17): no read back for them; auto: one budget
        on_device = plan == DRAFT and suffix is None and not mask_drafts and r.accelerated
        tree = draft_logits = topk = taken = None
        if on_device:
            budget = device_budget(self, sampled, cap, ahead)  # (auto_device.py)
            if budget == 0:  # no captured tree fits the slots free
                return plain_step(self, reqs, rows, root_pos, root_ids, sampled, None)
            pad = padded_width(self.verify_widths, bs, 1 + budget, cap) or budget + 1  # a uniform width
            taken = ahead.take(reqs, budget, pad) if ahead is not None else None
            self.ahead_taken += taken is not None
            tree, ahead_rows = taken if taken is not None else (None, None)
        if ahead is not None and taken is None:  # not this step's: its slots back before anything allocates
            ahead.drop_prepared(r.slots)
        if plan == DRAFT and tree is None:
            draft_logits, dshard = self._draft(idx, cached, roots, max(root_pos), True)  # [bs, L, V/tp]
            self._window("draft")  # the pops read the draft on the host
            if mask_drafts:  # the tree then holds only tokens the grammar allows (docs/DESIGN.md); per shard
                mask_draft_logits(grammars, draft_logits, dshard)
            # top-K once (the shards' top-k's) for every width popped; masked requests pop 2x (draft_pop_budgets)
            k = 1 if self.chain else min(self.budget * (2 if mask_drafts else 1), dshard.vocab)
            topk = draft_topk(draft_logits, k, dshard)  # [bs, L, K] on the device
        if on_device:  # drafted ahead by the previous step, or built now
            pops = pop_width(budget, ctl.config) if ctl is not None else 0  # auto: the pops past the tree too
            tree = tree or self.tree_builder.build(topk, budget, max_depths, self.chain, roots, cached, pad, pops)
            n_used = None  # [bs] nodes per tree: read back with the verification's results
        else:  # the pops read back: the host's choice and tree (host_tree.py)
            built = host_tree(self, plan, (draft_logits, topk), suffix, sampled, cap, max_depths, grammars,
                              mask_drafts, roots, cached)
            if built is None:  # every tree is its root alone
                return plain_step(self, reqs, rows, root_pos, root_ids, sampled, t.now() - t0 if plan == DRAFT
                                  else None)
            tree, n_used, pad = built
        t.lap("build")
        built_at = t.now() if plan == DRAFT else t0  # a suffix-only step's host work counts as verify
        draft_s = built_at - t0 if plan == DRAFT else None  # drafter forward + pops + decision + tree
        if pad is not None:  # every request's tree padded to ``pad`` slots
            host = HostShape(bs * pad, pad, max(root_pos) + pad)
        else:
            longest = max(p + n + 1 for p, n in zip(root_pos, n_used.tolist(), strict=True))  # cached + tree tokens
            host = HostShape(bs + int(n_used.sum()), 1 + int(n_used.max()), longest)
        params, shard = [q.params for q in reqs], r.vocab_shard  # the logits' vocabulary columns on this rank
        # the verify forward the previous step launched with the tree (its rows), else this step's own
        claimed = ahead.claim(ahead_rows, r.slots) if taken is not None else None
        if ahead is not None and claimed is None:
            ahead.drop_prepared(r.slots)
        if claimed is not None:
            host, logits, captured, tree_slots = claimed
        else:
            logits, captured, tree_slots = self._verify_forward(tree, idx, cached, host, pad is not None, params)
        # while the verify forward runs: the verification's inputs, which need none of its results (overlap)
        info = BatchSamplingInfo.build(params, vocab := shard.vocab, dev)
        want_lp = any(p.logprobs is not None for p in params)
        pen = BatchPenalties.build(params, [q.token_counts for q in reqs], vocab, dev, [len(q.output_ids) for q in reqs])
        pen = pen.for_shard(shard) if pen is not None else None
        keys = SampleKeys.build([q.seed for q in reqs], [len(q.output_ids) for q in reqs], dev)
        single, acc = self.accept_thresholds
        go_ahead = on_device and self.launch_ahead and not want_lp  # (logprobs: their read would wait for it)
        ahead_at = next_budget(self, sampled, cap, (budget, pad)) if go_ahead else (0, 0)  # auto: chosen now
        self._window("verify_forward")
        # exact per-node grammar masks; logprobs stay those of the raw logits (a copy only when asked for)
        vlogits = mask_tree_logits(grammars, tree, logits, copy=want_lp, shard=shard)
        res = verify_tree(tree, vlogits, info.temperature, info.top_k, info.top_p, info.is_greedy, keys,
                          min_p=info.min_p, penalties=pen, threshold_single=single, threshold_acc=acc,
                          want_reach=ctl is not None, generators=[q.generator for q in reqs],
                          greedy_only=info.greedy_only, maybe=info.maybe, shard=shard)
        commit_paths(r, res, idx, cached, tree_slots, captured, self._write_context)  # the commit's device half
        t.lap("verify")
        # the step's one read of its results: accepted paths and tokens (and the controller's reach), started
        learn = on_device and ctl is not None  # the auto budget learns from the device-built tree (auto_device.py)
        reads = {"accept": res.accept_length, "emitted": res.emitted_tokens, **(
            {"reach": res.node_reach} if ctl is not None else {}), **(
            {"num_nodes": tree.num_nodes} if n_used is None else {}), **(
            tree_tensors(tree) if learn else {})}
        pending = read_later(*reads.values())
        # then the next step's draft queued behind it (auto: at the budget chosen in the window above)
        if go_ahead and ahead_at[0] and r.slots.num_free >= bs * self.block_size:
            self.ahead = draft_next(self, reqs, idx, cached, res, *ahead_at, max(root_pos),
                                    pop_width(ahead_at[0], ctl.config) if ctl is not None else 0)
        read = dict(zip(reads, pending.wait(), strict=True))
        read_at, self.read_at = self.read_at, t.now()  # the previous step's read, this one's
        n_used = read["num_nodes"] if n_used is None else n_used  # [bs] nodes per tree
        out = commit(r, reqs, tree, res, tree_slots, eos_ids, placed=host.tokens, paths=(read["accept"],
                                                                                          read["emitted"]))
        if self.suffix_gate is not None:
            self.suffix_gate.observe([len(o.tokens) for o in out])
        if self.ahead is not None:  # the draft ahead assumed every request goes on
            self.ahead.expected = {q.rid: q.num_cached for q in reqs}
        if want_lp:
            attach_logprobs(reqs, res, logits, out, shard)
        t.lap("commit")
        t.steps += 1
        for o, n in zip(out, n_used.tolist(), strict=True):  # nodes per tree: the host's
            o.budget = n
        if ctl is not None:  # the verify forward ran host.tokens tokens (padded or ragged)
            reach = read["reach"]  # [bs, D] sampled rows: expected, not one draw of the coins
            if self.suffix is not None and tree.sources is not None:  # each request's own suffix record
                mine = tree.numpy("sources") == SUFFIX  # [bs, D]
                q = np.exp(tree.numpy("node_logws").astype(np.float64)) * mine  # [bs, D]
                self.suffix.observe([q_.rid for q_ in reqs], (reach * mine).sum(1), q.sum(1))
            verify_s = t.now() - built_at
            if learn:  # timed over one period of the pipeline, the drafter at the model's price (auto_device.py)
                learn_from_read(ctl, tree, read, n_used, sampled)
                draft_s, verify_s = step_times(ctl, bs, t.now() - (read_at if taken is not None and read_at else t0))
            ctl.record(n_used, tree, reach[:, 1:].sum(1), sampled, bs, host.tokens, draft_s, verify_s, reach,
                       draft_measured=not learn)
        return out

    def _window(self, phase: str) -> None:
        """Close ``phase``, then the overlap window (``ModelRunner.wait_device``) as its own phase."""
        self.timer.lap(phase)
        self.runner.wait_device()
        self.timer.lap("window")

    def _draft(self, idx: torch.Tensor, cached: torch.Tensor, roots: torch.Tensor, max_cached: int, local: bool):
        """The drafter's forward: logits [bs, B-1, V] (``local``: V/tp) and their shard (``draft_forward``)."""
        self.flush_context()
        return draft_forward(self.runner, self.drafter, self.draft_kv, self.draft_backend, self.block_size, idx,
                             cached, roots, max_cached, local, self.draft_graphs)

    def _verify_forward(self, tree: DraftTree, idx: torch.Tensor, cached: torch.Tensor, host: HostShape | None = None,
                        padded: bool = False, params: Sequence | None = None, prepared: VerifyInputs | None = None):
        """The tree's target forward (``tree_forward.verify_forward``, or ``run_verify`` of the inputs ``prepared``
        ahead): logits [bs, D, V], captured, slots [bs, D]."""
        if prepared is not None:
            return run_verify(self.runner, prepared)
        return verify_forward(self.runner, tree, idx, cached, self.capture_layer_ids, host, padded, params)
