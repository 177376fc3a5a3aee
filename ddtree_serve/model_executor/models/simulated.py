"""Models of the simulated device (ddtree_serve/sim/): a synthetic target and drafter whose forwards cost modelled
device time (``DeviceClock``) instead of computing, so the host side of serving (scheduling, tree build,
verification, commit, output) can be measured at GPU scale on a CPU (benchmarks/bench_scale.py).

Target: the greedy continuation is known, ``next_token(token, position)`` (a fixed hash of the last token and its
position), so a request's output is its prompt's last token iterated through the rule; its logits are a peak of
``peak`` at that token over a flat floor (vocabulary ``vocab_size``, small: the rows the host touches stay small,
the full vocabulary's cost is modelled). Drafter: for depth d of a block rooted at (token, position) it ranks the
true token first with probability ``accept_prob`` (a fixed hash of token, position and depth against it) and
second otherwise, under a wrong token, so the acceptance of chain and tree drafts is set by one number. Its
probabilities are ``draft_top_prob`` for the first token and the rest for the second: by default
``accept_prob`` (a calibrated drafter, DDTree's assumption); above it, an overconfident one (a top-1 that claims
more than it delivers, the second rank less: what a per-depth calibration cannot correct).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import replace

import torch
from torch import nn

from ddtree_serve.model_executor.forward_batch import ForwardBatch, ForwardMode
from ddtree_serve.model_executor.kv_cache import KVCache, KVCacheLayout
from ddtree_serve.model_executor.model_config import ModelConfig
from ddtree_serve.model_executor.models.output import ModelOutput
from ddtree_serve.model_executor.parallel_state import TPGroup
from ddtree_serve.sim.device_clock import DeviceClock
from ddtree_serve.sim.device_tracker import DeviceTracker
from ddtree_serve.sim.machines import DeviceCostModel

_M = (1 << 31) - 1  # the hashes' modulus


def next_token(tokens: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """The target's greedy token after ``tokens`` at ``positions`` (same shapes): in 1..vocab-2 (0 is the
    drafter's mask token, vocab-1 the end of sequence, never produced)."""
    return 1 + (tokens * 7919 + positions * 104729 + 13) % (vocab - 2)


def greedy_continuation(prompt: list[int], n: int, vocab: int) -> list[int]:
    """The target's greedy output of ``n`` tokens after ``prompt`` (what every lossless path must produce)."""
    tok, pos, out = prompt[-1], len(prompt) - 1, []
    for _ in range(n):
        tok = int(next_token(torch.tensor(tok), torch.tensor(pos), vocab))
        out.append(tok)
        pos += 1
    return out


def _uniform(tokens: torch.Tensor, positions: torch.Tensor, depth: torch.Tensor, seed: int) -> torch.Tensor:
    """A fixed pseudo-random number in [0, 1) per (token, position, depth): whether the drafter is right.
    Independent across depths: the key is mixed by a non-linear integer hash (xor-shift-multiply rounds); a hash
    linear in depth made a block's draws an arithmetic progression mod 1, so no top-1 chain passed depth 8 at
    ``accept_prob`` 0.8 (0.8^8 = 17% of blocks should)."""
    h = (tokens.long() * 1_000_003 + positions.long() * 998_244_353 + depth.long() * 19_260_817 + seed) % _M
    for _ in range(2):  # [same shape] each product < 2^32 * 2^27: exact in int64
        h = ((h >> 16) ^ h) * 0x45D9F3B & 0xFFFFFFFF
    h = (h >> 16) ^ h
    return h.double() / 2.0**32


def _cost(hf: dict, tp: TPGroup) -> DeviceCostModel:
    """The checkpoint's machine, with the server's logits configuration (``vocab_parallel_logits``)."""
    return replace(DeviceCostModel(**hf.get("simulated_device", {})), vocab_parallel=tp.vocab_parallel)


class SimulatedTarget(nn.Module):
    """Architecture ``DDTreeSimulatedTarget``: hidden states are the logits (hidden_size == vocab_size)."""

    reads_attn_mask = False  # attention is modelled, not run: no O(Q x K) mask is built
    simulated_device = True  # ModelRunner.accelerated: the step takes its device-side paths

    def __init__(self, config: ModelConfig, tp: TPGroup = TPGroup()) -> None:
        super().__init__()
        self.vocab = config.vocab_size
        self.peak = float(config.hf.get("simulated_peak", 12.0))
        self.clock = DeviceClock(_cost(config.hf, tp))
        self.tracker = DeviceTracker(self.clock)
        self.graph_max_bs = 0  # ModelRunner: forwards of up to this many requests replay a graph (one launch)
        self._sessions = 0
        self.dummy = nn.Parameter(torch.zeros(1), requires_grad=False)

    def kv_cache_layout(self) -> KVCacheLayout:
        return KVCacheLayout(num_layers=1, kv_heads=1, k_dim=1, v_dim=1)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for _ in weights:  # the checkpoint holds one placeholder tensor
            pass

    @contextmanager
    def device_session(self) -> Iterator[None]:
        """Track one step's device tensors and charge the host's acts (ddtree_serve/sim/device_tracker.py)."""
        if self._sessions:  # nested (a probe inside a step): the outer session tracks
            yield
            return
        self._sessions += 1
        try:
            with self.tracker:
                yield
        finally:
            self._sessions -= 1

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros(ids.shape[0], 1, device=ids.device)  # [N, 1]: the drafter reads tokens, not embeddings

    def forward(self, fb: ForwardBatch, kv: KVCache, backend: object) -> ModelOutput:
        ids, pos = fb.input_ids, fb.positions  # [T]
        rows = ids.shape[0] if fb.logits_indices is None else fb.logits_indices.shape[0]
        with self.tracker.modelled():  # the forward's cost and synthetic outputs stand for the device's
            reads = int((fb.prefix_lens * fb.extend_lens).sum()) + int((fb.extend_lens ** 2).sum()) // 2
            kv_tokens = int((fb.prefix_lens + fb.extend_lens).sum())
            bs = int(fb.extend_lens.shape[0])
            # a replay where CudaGraphRunner.can_run would replay: decode, or a verify whose trees are one size
            uniform = fb.mode == ForwardMode.DECODE or (fb.mode == ForwardMode.TARGET_VERIFY
                                                         and int(ids.shape[0]) == bs * fb.max_q)
            graphed = uniform and 0 < bs <= self.graph_max_bs
            cost = self.clock.cost
            sampled, logprob = _kind_rows(fb)
            self.clock.launch(cost.target_s(int(ids.shape[0]), reads, rows, kv_tokens, logprob_rows=logprob,
                                            seeded_rows=sampled), cost.target_kernels, graphed)
            hidden = torch.zeros(ids.shape[0], self.vocab, device=ids.device)  # [T, V]
            hidden.scatter_(1, next_token(ids, pos, self.vocab)[:, None], self.peak)
            captured = torch.zeros(ids.shape[0], 1, device=ids.device) if fb.capture_layer_ids else None  # [T, 1]
        return ModelOutput(hidden, captured)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden.float()  # [T, V]

    def wait_device(self) -> None:
        """Inside a tracked session the read that follows synchronises; outside one, block here."""
        self.clock.close_window()
        if not self._sessions:
            self.clock.wait()

    def drain(self) -> None:
        """A full synchronisation (``ModelRunner.synchronize``)."""
        self.clock.wait()


def _kind_rows(fb: ForwardBatch) -> tuple[int, int]:
    """(sampled rows, logprob rows) of a forward from its ``RowKinds`` (0, 0 when unknown): a request's rows are its
    new tokens, or one when the forward computes selected rows' logits only."""
    kinds = fb.row_kinds
    if kinds is None:
        return 0, 0
    per = torch.ones_like(fb.extend_lens) if fb.logits_indices is not None else fb.extend_lens  # [bs]
    sampled = torch.tensor(kinds.sampled, dtype=torch.bool, device=per.device)  # [bs]
    logprobs = torch.tensor(kinds.logprobs, dtype=torch.bool, device=per.device)  # [bs]
    return int(per[sampled].sum()), int(per[logprobs].sum())  # modelled: the simulated device's own tensors


class SimulatedDrafter(nn.Module):
    """Architecture ``DDTreeSimulatedDrafter``: a DFlash-shaped drafter (block of root + masks) whose depth-d
    top token is the target's with probability ``accept_prob``; it shares the target's clock."""

    target_layer_ids = (0,)
    reads_attn_mask = False

    def __init__(self, config: ModelConfig, tp: TPGroup = TPGroup()) -> None:
        super().__init__()
        hf = config.hf
        self.vocab = config.vocab_size
        self.block_size = int(hf.get("block_size", 16))
        self.mask_token_id = 0
        self.accept_prob = float(hf.get("accept_prob", 0.8))
        top = hf.get("draft_top_prob")
        top = min(max(float(self.accept_prob if top is None else top), 1e-6), 1 - 1e-6)
        self.log_top, self.log_second = math.log(top), math.log(1 - top)  # the two ranks' log-probabilities
        self.seed = int(hf.get("seed", 0))
        self.clock = DeviceClock(_cost(hf, tp))  # replaced by the target's (share_device)
        self.tracker = DeviceTracker(self.clock)
        self.dummy = nn.Parameter(torch.zeros(1), requires_grad=False)

    def share_device(self, target: nn.Module) -> None:
        """Run on the target's device timeline (one accelerator)."""
        self.clock, self.tracker = target.clock, target.tracker

    def kv_cache_layout(self) -> KVCacheLayout:
        return KVCacheLayout(num_layers=1, kv_heads=1, k_dim=1, v_dim=1)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for _ in weights:
            pass

    def write_context(self, captured: torch.Tensor, positions: torch.Tensor, out_cache_loc: torch.Tensor,
                      kv: KVCache) -> None:
        """Context features cost nothing extra: their write is part of the target forward's modelled time."""

    def forward(self, fb: ForwardBatch, kv: KVCache, backend: object) -> torch.Tensor:
        assert fb.mode == ForwardMode.TARGET_VERIFY
        bsz = self.block_size
        ids = fb.input_ids.view(-1, bsz)  # [bs, B]
        bs = ids.shape[0]
        with self.tracker.modelled():  # the forward's cost and synthetic outputs stand for the device's
            cost = self.clock.cost
            self.clock.launch(cost.draft_s(bs * bsz, bs * (bsz - 1)), cost.draft_kernels, False, target=False)
            return self._draft_hidden(ids, fb.positions.view(bs, bsz)[:, 0])

    def forward_block(self, ids: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor, idx: torch.Tensor,
                      cached: torch.Tensor, table: torch.Tensor, kv: KVCache,
                      max_context: int | None = None) -> torch.Tensor:
        """``DFlashDraftModel.forward_block``'s entry point (the graphed draft, speculative/draft_graphs.py): the
        same hidden states as ``forward`` [bs*B, V]; inside a graph region (``dispatch.graph_replay``) its
        modelled cost is queued as part of the replay (no launches of its own), else as an eager forward."""
        bsz = self.block_size
        ids2 = ids.view(-1, bsz)  # [bs, B]
        bs = ids2.shape[0]
        with self.tracker.modelled():
            cost = self.clock.cost
            self.clock.launch(cost.draft_s(bs * bsz, bs * (bsz - 1)), cost.draft_kernels,
                              self.tracker.in_graph_region, target=False)
            return self._draft_hidden(ids2, positions.view(bs, bsz)[:, 0])

    def _draft_hidden(self, ids: torch.Tensor, pos0: torch.Tensor) -> torch.Tensor:
        """ids [bs, B] (root, masks), pos0 [bs] the roots' positions -> hidden [bs * B, V]."""
        bs, bsz = ids.shape
        v = self.vocab
        root = ids[:, 0]  # [bs]
        hidden = torch.full((bs, bsz, v), -30.0, device=ids.device)  # [bs, B, V] the other tokens: ~0
        tok = root
        for d in range(1, bsz):  # the true chain from the root, one depth at a time (B - 1 vector steps)
            true = next_token(tok, pos0 + d - 1, v)  # [bs]
            wrong = 1 + (true + 1 + d) % (v - 2)  # [bs] a token that is not the target's
            right = _uniform(root, pos0, torch.full_like(root, d), self.seed) < self.accept_prob  # [bs]
            hidden[:, d].scatter_(1, torch.where(right, true, wrong)[:, None], self.log_top)
            hidden[:, d].scatter_(1, torch.where(right, wrong, true)[:, None], self.log_second)
            tok = true
        return hidden.view(bs * bsz, v)
