"""Per-machine cost models of the simulated device: Kimi K2.6 under tensor parallelism over 8 GPUs, on the presets'
machines (configs/kimi-k2.6-8x-rtx-pro-6000.yaml: PCIe, no NVLink; configs/kimi-k2.6-8x-b300.yaml: NVLink).

A forward's device time is a roofline per rank plus what does not overlap with it:
- bytes read: the dense weights (attention, shared expert, the dense first layer, the LM head) once, and the routed
  experts the step's tokens wake: with ``t`` tokens each picking ``top_k`` of ``experts`` per MoE layer, the
  expected distinct experts are ``experts * (1 - (1 - top_k / experts) ** t)`` (concave in ``t``: 8 at one token,
  ~358 of 384 at 128); plus every request's context: Kimi's MLA latent, (512 + 64) x 2 bytes x 61 layers =
  70,272 bytes per cached token, read by every rank (TP replicates the latent), once per request and forward;
- FLOPs: 2 x 32B active parameters per token over the ranks, and attention's 2 x 64 heads x (576 + 512) per query
  token and key per layer;
- communication: two all-reduces of the hidden state (7,168 bf16) per layer and token (ring: 2 (g-1)/g of the
  bytes at the bus bandwidth, plus a latency each), and the logits rows' exchange (``logits_bytes_per_row``,
  ``_exchange_s``): with ``vocab_parallel`` (``ParallelArgs.vocab_parallel_logits``, the default) each rank keeps
  its vocabulary shard and every row exchanges a (max, id) pair, 16 bytes a rank, in one collective
  (``sharded_sampling.sharded_argmax``, which ``sampler.draw_tokens`` runs on every row); once a row samples, the
  sharded draw runs on every row of the step (on CUDA ``draw_tokens`` does not read back which rows sample), each
  exchanging its two threshold searches' histograms (4 passes of 256 int64 bins each) and 5 numbers, 16,424
  bytes, in 13 collectives (the max, 4 + 4 histograms, the survivors' mass, the kept total, the ranks' totals,
  the crossing's id: ``sharded_sampling.kept_weights`` / ``inverse_cdf_draw``); rows of requests that ask for
  logprobs are gathered whole (``VocabShard.full_rows``: 163,840 float32, one collective); a drafter row sends
  its shard's top-64 (value float32 + id int64) and its log-sum-exp, 772 bytes, in 3 collectives
  (``speculative.ddtree.draft_topk``). Without it every row's float32 logits are all-gathered (163,840 x 4
  bytes, one collective);
- the logits rows' own device work (``logits_row_us``, an estimate): ~5 reads of a float32 row of the whole
  vocabulary (655 KB) at the RTX PRO 6000's achieved 1.61 TB/s (the LM head's write, the max / mass pass, the
  threshold passes, the draw: kernels/triton_sampling.py reads a row 2 times), ~2 us; a rank works on its
  V / tp columns under ``vocab_parallel``, on the whole row when gathered;
- kernels: a gap between consecutive kernels on the device (graphs included), and on the host a launch per eager
  kernel (~8,500 per eager K2.6 forward: ~140 ops and 3 Triton launches per MoE layer, counted on the tiny
  model) or one graph replay.

Sources: memory bandwidth, compute and link figures are the vendors' datasheet numbers (RTX PRO 6000 Blackwell
Server Edition: 96 GB GDDR7 at 1.79 TB/s, PCIe Gen5 x16; B300: 288 GB HBM3e at 8 TB/s, NVLink 5 at 1.8 TB/s per
GPU); the efficiencies and NCCL figures are typical achieved fractions (nccl-tests all-reduce bus bandwidth over
PCIe Gen5 ~40 GB/s, over NVLink ~650 GB/s; small-message latency ~25 us over PCIe, ~6 us over NVLink);
the RTX PRO 6000 model is then checked against users' published vLLM figures for K2.x on 8x RTX PRO 6000 (92
tok/s at concurrency 1, 2,223 at 128: steps of ~10 ms and ~57 ms; tests/sim/test_simulated_device.py).
Kimi's shapes are its config.json's (tests/data/kimi-k2.6-config.json). Host costs are the host CPU's, not the
GPU's: PyTorch's eager dispatch and launch ~5 us per kernel, a graph replay ~15 us, a synchronising read ~15 us
beyond the wait itself.
"""

from __future__ import annotations

from dataclasses import dataclass

# Kimi K2.6 (DeepSeek-V3 backbone), from its config.json
_HIDDEN, _LAYERS, _MOE_LAYERS, _EXPERTS, _TOP_K = 7168, 61, 60, 384, 8
_INT4 = 0.5 + 2 / 32  # bytes per INT4 expert weight with a bf16 scale per group of 32
_EXPERT_BYTES = 3 * _HIDDEN * 2048 * _INT4  # one routed expert of one layer, all ranks together
_ATTN_REPLICATED = (_HIDDEN * 1536 + _HIDDEN * 576) * 2  # q_a and kv_a projections: every rank reads them
_ATTN_SHARDED = (1536 * 64 * 192 + 512 * 64 * 256 + 64 * 128 * _HIDDEN) * 2  # q_b, kv_b, o: split over ranks
_SHARED_EXPERT = 3 * _HIDDEN * 2048 * 2
_DENSE_MLP = 3 * _HIDDEN * 18432 * 2  # the first (dense) layer's MLP
_LM_HEAD = 163840 * _HIDDEN * 2
_KV_BYTES_PER_TOKEN = (512 + 64) * 2 * _LAYERS  # MLA latent + rope key, bf16, all layers
_ATTN_FLOPS_PER_QK = 2 * 64 * (576 + 512) * _LAYERS  # per query token and key it attends to
_FLOPS_PER_TOKEN = 2 * 32e9  # 32B active parameters


def _dense_bytes_per_rank(gpus: int) -> float:
    return (_LAYERS * (_ATTN_REPLICATED + _ATTN_SHARDED / gpus) + _MOE_LAYERS * _SHARED_EXPERT / gpus
            + _DENSE_MLP / gpus + _LM_HEAD / gpus)


@dataclass(frozen=True)
class DeviceCostModel:
    """A machine of ``gpus`` GPUs running Kimi K2.6 under TP, per rank (see the module docstring for every figure's
    source). Every field can be overridden in the simulated checkpoint's config.json (ddtree_serve/sim/checkpoint.py)."""

    name: str = "rtx-pro-6000"
    gpus: int = 8
    mem_gbps: float = 1790.0  # memory bandwidth per GPU, GB/s (datasheet)
    mem_eff: float = 0.9  # achieved fraction
    tflops: float = 500.0  # dense bf16 per GPU (datasheet)
    flop_eff: float = 0.6
    link_gbps: float = 40.0  # all-reduce / all-gather bus bandwidth, GB/s (nccl-tests class figures)
    link_us: float = 25.0  # latency of one collective
    kernel_gap_us: float = 0.35  # device-side gap between consecutive kernels
    logits_gather_bytes_per_row: float = 163840 * 4.0  # a float32 row all-gathered (gathered logits, logprob rows)
    vocab_parallel: bool = True  # logits stay sharded by vocabulary (``ParallelArgs.vocab_parallel_logits``)
    argmax_bytes_per_row: float = 16.0  # vocabulary-parallel greedy row: a rank's (max, id), float64 each
    search_bytes_per_row: float = 4 * 256 * 8.0  # vocabulary-parallel seeded row: one threshold search's histograms
    seeded_collectives: int = 13  # vocabulary-parallel sharded draw: its exchanges a step (sharded_sampling.py)
    draft_topk_bytes_per_row: float = 64 * 12.0 + 4.0  # vocabulary-parallel drafter row: a shard's top-64, its lse
    draft_collectives: int = 3  # the drafter's top-k of top-k's: the lse, the values, the ids (ddtree.draft_topk)
    logits_row_us: float = 2.0  # a whole-vocabulary logits row's device work (softmax, top-k / top-p, sampling)
    target_kernels: int = 8500  # kernels of one eager target forward
    draft_bytes: float = 1.1e9  # a DFlash drafter's bytes per rank (6 layers + the fc; the LM head is the target's)
    draft_layers: int = 6
    draft_kernels: int = 220
    launch_us: float = 5.0  # host: one eager kernel launch
    graph_launch_us: float = 15.0  # host: one graph replay
    sync_us: float = 15.0  # host: one synchronising read's round trip beyond the wait

    def _allreduce_s(self, tokens: int, count: int) -> float:
        g = self.gpus
        size = tokens * _HIDDEN * 2
        return count * (self.link_us * 1e-6 + 2 * (g - 1) / g * size / (self.link_gbps * 1e9))

    def logits_bytes_per_row(self, kind: str = "greedy", searches: int = 2) -> float:
        """Bytes one rank contributes to the logits exchange of a row of ``kind``: "greedy" (argmax), "seeded"
        (``searches`` threshold searches: top-k and top-p; then the max, the top-p mass, the kept total, the
        token), "draft" (the drafter's top-k of top-k's), or "logprobs" (the whole row, gathered). Without ``vocab_parallel`` every row is gathered whole."""
        if not self.vocab_parallel or kind == "logprobs":
            return self.logits_gather_bytes_per_row
        if kind in ("greedy", "draft"):
            return self.argmax_bytes_per_row if kind == "greedy" else self.draft_topk_bytes_per_row
        return searches * self.search_bytes_per_row + 5 * 8.0

    def _exchange_s(self, per_rank_bytes: float, collectives: int) -> float:
        """``collectives`` collectives moving ``per_rank_bytes`` from each rank in all: a latency each and
        (g-1)/g of the bytes at the bus bandwidth."""
        if collectives == 0 or self.gpus == 1:
            return 0.0
        g = self.gpus
        return collectives * self.link_us * 1e-6 + (g - 1) / g * per_rank_bytes / (self.link_gbps * 1e9)

    def logits_exchange_s(self, rows: int, seeded_rows: int = 0, logprob_rows: int = 0) -> float:
        """A target step's logits exchange (module docstring): ``rows`` rows, ``seeded_rows`` of them sampling
        (then every row runs the sharded draw), ``logprob_rows`` of them gathered whole as well."""
        if not self.vocab_parallel:
            return self._exchange_s(rows * self.logits_gather_bytes_per_row, 1 if rows else 0)
        t = self._exchange_s(rows * self.argmax_bytes_per_row, 1 if rows else 0)
        if seeded_rows:
            t += self._exchange_s(rows * self.logits_bytes_per_row("seeded"), self.seeded_collectives)
        return t + self._exchange_s(logprob_rows * self.logits_gather_bytes_per_row, 1 if logprob_rows else 0)

    def row_s(self, rows: int) -> float:
        """The logits rows' own device work on one rank: its shard's columns under ``vocab_parallel``."""
        return rows * self.logits_row_us * 1e-6 / (self.gpus if self.vocab_parallel else 1)

    def expert_bytes(self, tokens: int) -> float:
        """Routed-expert bytes one rank reads for ``tokens`` tokens: the expected distinct experts per layer."""
        distinct = _EXPERTS * (1 - (1 - _TOP_K / _EXPERTS) ** tokens)
        return _MOE_LAYERS * distinct * _EXPERT_BYTES / self.gpus

    def target_s(self, tokens: int, context_reads: int, logits_rows: int, kv_tokens: int = 0,
                 kernels: int | None = None, logprob_rows: int = 0, seeded_rows: int = 0) -> float:
        """One target forward over ``tokens`` new tokens: ``context_reads`` query-key pairs in all, ``kv_tokens``
        cached tokens read (each request's context once), ``logits_rows`` rows through the LM head and their
        exchange (``logits_exchange_s``: ``seeded_rows`` of them sampling, ``logprob_rows`` of them of requests
        that ask for logprobs)."""
        read = _dense_bytes_per_rank(self.gpus) + self.expert_bytes(tokens) + kv_tokens * _KV_BYTES_PER_TOKEN
        mem = read / (self.mem_gbps * 1e9 * self.mem_eff)
        flops = (tokens * _FLOPS_PER_TOKEN + context_reads * _ATTN_FLOPS_PER_QK) / self.gpus
        compute = flops / (self.tflops * 1e12 * self.flop_eff)
        gaps = (self.target_kernels if kernels is None else kernels) * self.kernel_gap_us * 1e-6
        exchange = self.logits_exchange_s(logits_rows, seeded_rows, logprob_rows)
        return max(mem, compute) + self._allreduce_s(tokens, 2 * _LAYERS) + exchange + gaps + self.row_s(logits_rows)

    def draft_s(self, tokens: int, logits_rows: int) -> float:
        """One drafter forward over ``tokens`` block tokens, ``logits_rows`` of them through the LM head."""
        read = self.draft_bytes + _LM_HEAD / self.gpus
        mem = read / (self.mem_gbps * 1e9 * self.mem_eff)
        compute = tokens * self.draft_bytes / (self.tflops * 1e12 * self.flop_eff)  # 2 FLOPs per bf16 weight (2 bytes)
        per_row, collectives = ((self.logits_bytes_per_row("draft"), self.draft_collectives) if self.vocab_parallel
                                else (self.logits_gather_bytes_per_row, 1))
        exchange = self._exchange_s(logits_rows * per_row, collectives if logits_rows else 0)
        return (max(mem, compute) + self._allreduce_s(tokens, 2 * self.draft_layers) + exchange
                + self.draft_kernels * self.kernel_gap_us * 1e-6 + self.row_s(logits_rows))


MACHINES: dict[str, DeviceCostModel] = {
    "rtx-pro-6000": DeviceCostModel(),
    "b300": DeviceCostModel(name="b300", mem_gbps=8000.0, tflops=2250.0, link_gbps=650.0, link_us=6.0),
}
