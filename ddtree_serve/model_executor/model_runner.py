"""Owns one model on one device (one TP rank): weights, KV cache, its slot owner (``KVSlots``: allocator and
request->token table) and the attention backend. ``prepare_prefill`` / ``prepare_decode`` place a batch's
new tokens and build its forward inputs; ``forward(fb)`` runs the model; scheduling lives elsewhere."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext

import torch

from ddtree_serve.kernels.attention import TorchAttentionBackend
from ddtree_serve.kernels.attention_invariant import InvariantAttentionBackend
from ddtree_serve.kernels.sampling import warm_up_filters
from ddtree_serve.model_executor.forward_batch import (
    ForwardBatch,
    ForwardMode,
    HostShape,
    RowKinds,
    build_forward_batch,
)
from ddtree_serve.model_executor.kv_cache import KVCache, KVCacheLayout
from ddtree_serve.model_executor.kv_slots import KVSlots
from ddtree_serve.model_executor.layers.embedding import ParallelLMHead
from ddtree_serve.model_executor.layers.linear import use_invariant_linears
from ddtree_serve.model_executor.model_config import ModelConfig
from ddtree_serve.model_executor.model_registry import get_model_class
from ddtree_serve.model_executor.models.output import ModelOutput
from ddtree_serve.model_executor.parallel_state import TPGroup
from ddtree_serve.model_executor.uploads import upload
from ddtree_serve.model_executor.vocab_shard import VocabShard
from ddtree_serve.model_executor.weight_loader import iter_weights

logger = logging.getLogger(__name__)


def pick_attention_backend(device: torch.device, dtype: torch.dtype, layout: KVCacheLayout, name: str = "auto",
                           invariant: bool = False):
    """The attention backend for a model of ``dtype`` whose KV cache has ``layout`` (``name``: auto | torch |
    flashinfer, from ``--attention-backend``; auto = flashinfer on CUDA when the dtype and head dims fit it,
    ddtree_serve.kernels.attention_select). A layout without a V buffer (MLA) is a model that runs its own latent
    attention (torch or triton) and never calls the backend. ``invariant``: ``--enable-deterministic-inference``,
    the batch-invariant backend (ddtree_serve/kernels/attention_invariant.py)."""
    if invariant and layout.v_dim:
        return InvariantAttentionBackend()
    if layout.v_dim == 0 or name in ("torch", "triton"):
        return TorchAttentionBackend()
    from ddtree_serve.kernels.attention_select import get_attention_backend

    return get_attention_backend(name, device, dtype, layout.k_dim, layout.v_dim)


def warm_up_attention(backend, layout: KVCacheLayout, model: torch.nn.Module, dtype: torch.dtype,
                      device: torch.device, kinds: tuple[str, ...] = ("decode", "extend", "tree")) -> None:
    """JIT-compile and run each kernel of a compiling backend (flashinfer) once at start-up, so the first
    request does not pay for it and the server turns healthy only afterwards. No-op for the reference.
    ``kinds``: the forwards the model runs (decode, causal extend, tree-masked); a DFlash drafter runs
    tree-masked forwards only."""
    if not hasattr(backend, "warmup"):
        return
    num_q = model.layers[0].self_attn.local_heads  # llama-style models and DFlash drafters
    t0 = time.time()
    ran = backend.warmup(num_q, layout.kv_heads, layout.k_dim, layout.v_dim, dtype, device, kinds)
    logger.info("attention kernels warmed up in %.1fs: %s", time.time() - t0, ", ".join(ran))


def load_model(config: ModelConfig, tp: TPGroup, device: torch.device) -> torch.nn.Module:
    t0 = time.time()
    cls = get_model_class(config.architecture)
    with torch.device(device):
        model = cls(config, tp)
    model.load_weights(iter_weights(config.path, desc=f"Loading {config.architecture}",
                                    skip_prefixes=getattr(model, "skip_weight_prefixes", ()), lazy=tp.size > 1))
    model.eval()
    logger.info("loaded %s in %.1fs", config.path, time.time() - t0)
    return model


class ModelRunner:
    """Loads the weights at construction. The KV cache is allocated then when ``max_total_tokens`` is given;
    otherwise the owner sizes it once everything else is resident (``ddtree_serve.model_executor.memory``) and calls
    ``allocate_kv``. ``cuda_graph_max_bs > 0``: replay DECODE / TARGET_VERIFY forwards of up to that many
    requests from CUDA graphs (ddtree_serve/model_executor/cuda_graph_runner.py; MLA models with the Triton backends only)."""

    def __init__(self, config: ModelConfig, max_reqs: int, max_context: int, tp: TPGroup = TPGroup(),
                 device: str = "cpu", max_total_tokens: int | None = None, cuda_graph_max_bs: int = 0):
        self.config = config
        self.device = torch.device(device)
        self.tp = tp
        self.max_reqs, self.max_context = max_reqs, max_context
        self.dcp_size = tp.dcp_size
        if self.dcp_size > 1 and not getattr(get_model_class(config.architecture), "supports_dcp", False):
            raise ValueError(f"--decode-context-parallel-size {self.dcp_size} needs an MLA model (DeepSeek-V3 / Kimi "
                             f"K2 family); {config.architecture} keeps its KV heads split over the TP ranks")
        self.model = load_model(config, tp, self.device)
        self.kv_layout = self.model.kv_cache_layout()
        # the O(Q x K) attention mask only for a model whose attention reads it (forward_batch.py); MHA
        # models (torch, flashinfer) and DFlash drafters do, the Triton MLA path does not
        self.dense_mask = bool(getattr(self.model, "reads_attn_mask", True))
        self.num_slots = 0
        self.backend = pick_attention_backend(self.device, config.dtype, self.kv_layout, config.attention_backend,
                                              invariant=config.deterministic_inference)
        if config.deterministic_inference:
            use_invariant_linears(self.model)
        warm_up_attention(self.backend, self.kv_layout, self.model, config.dtype, self.device)
        if self.device.type == "cuda":  # flashinfer's sampling module JIT-compiles at first use
            logger.info("sampling filters warmed up: %s", warm_up_filters(self.device, config.vocab_size))
        self.cuda_graph_max_bs = cuda_graph_max_bs
        self.graphs = None
        self.while_busy: Callable[[], None] | None = None  # the overlap window's host work (wait_device)
        self.simulated = bool(getattr(self.model, "simulated_device", False))
        if cuda_graph_max_bs > 0 and self.simulated:  # a simulated device models replays (one launch each)
            self.model.graph_max_bs = cuda_graph_max_bs
        elif cuda_graph_max_bs > 0:
            from ddtree_serve.model_executor.cuda_graph_runner import check_graphable

            check_graphable(config)
        if max_total_tokens is not None:
            self.allocate_kv(max_total_tokens)

    @property
    def graph_batch_sizes(self) -> tuple[int, ...]:
        """The padded batch sizes CUDA graphs are captured for (empty: graphs off)."""
        if self.cuda_graph_max_bs <= 0:
            return ()
        from ddtree_serve.model_executor.cuda_graph_runner import graph_batch_sizes

        return graph_batch_sizes(self.cuda_graph_max_bs)

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes one token of a sequence costs this rank: with DCP (N > 1) a rank stores 1/N of the tokens
        (rounded up)."""
        return -(-self.kv_layout.bytes_per_token(self.config.kv_dtype) // self.dcp_size)

    def allocate_kv(self, num_slots: int, table_margin: int = 0) -> None:
        """Allocate the KV cache, slot allocator and request->token table (once), and the CUDA graph runner
        over them when enabled. ``table_margin``: extra table columns past ``max_context`` for the temporary
        slots of a step (a draft block or a tree written after the last cached position of a request at the
        context limit)."""
        if self.num_slots:
            raise RuntimeError("the KV cache is already allocated")
        if num_slots < 16:
            raise ValueError(f"max_total_tokens must be >= 16, got {num_slots}")
        self.slots = KVSlots(num_slots, self.max_reqs, self.max_context + table_margin, self.device, self.dcp_size)
        self.num_slots = self.slots.num_slots  # a multiple of the DCP size
        self.kv = KVCache(self.kv_layout, self.slots.local_slots, self.config.kv_dtype, self.device)
        if self.cuda_graph_max_bs > 0 and not self.simulated:
            from ddtree_serve.model_executor.cuda_graph_runner import CudaGraphRunner, graph_batch_sizes

            self.graphs = CudaGraphRunner(self.model, self.kv, self.backend, graph_batch_sizes(self.cuda_graph_max_bs),
                                          self.max_context, self.device)
        logger.info("KV cache: %d tokens x %d bytes (%s)%s", self.num_slots, self.kv_bytes_per_token,
                    self.config.kv_dtype, f", sharded over {self.dcp_size} DCP ranks ({self.slots.local_slots} "
                    "each)" if self.dcp_size > 1 else "")

    def prepare_prefill(self, rows: list[int], starts: list[int], lens: list[int], ids: list[int],
                        capture_layer_ids: tuple[int, ...] = (), logits_indices: torch.Tensor | None = None
                        ) -> ForwardBatch | None:
        """An EXTEND forward: request ``rows[b]`` has ``starts[b]`` tokens cached and adds ``lens[b]``; ``ids``
        are the new tokens, request after request. Places their slots; None when too few are free."""
        dev = self.device  # inputs go up asynchronously and the sizes are the host's (no sync: uploads.py)
        lens_t = upload(lens, dev, torch.int64)  # [bs]
        starts_t = upload(starts, dev, torch.int64)  # [bs]
        rows_t = upload(rows, dev, torch.int64)  # [bs]
        host = HostShape(sum(lens), max(lens, default=0), max((s + n for s, n in zip(starts, lens, strict=True)),
                                                              default=0))
        loc = self.slots.place(rows_t, starts_t, lens_t, total=host.tokens)  # [T]
        if loc is None:
            return None
        pos = upload(torch.cat([torch.arange(p, p + n) for p, n in zip(starts, lens, strict=True)]), dev)  # [T]
        return build_forward_batch(ForwardMode.EXTEND, upload(ids, dev, torch.int64), pos, loc, self.slots.table,
                                   rows_t, starts_t, lens_t, logits_indices=logits_indices,
                                   capture_layer_ids=capture_layer_ids, dense_mask=self.dense_mask, host=host)

    def prepare_decode(self, rows: list[int], cached: list[int], ids: list[int] | torch.Tensor,
                       capture_layer_ids: tuple[int, ...] = (), params: Sequence | None = None) -> ForwardBatch | None:
        """A DECODE forward: one new token ``ids[b]`` per request at position ``cached[b]`` (``ids``: the host's list,
        or a device tensor ``[bs]``, tokens sampled and not read back yet). Places its slot; None when too few are
        free. ``params``: the requests' ``SamplingParams`` (``RowKinds``), or None."""
        dev = self.device  # inputs go up asynchronously and the sizes are the host's (no sync: uploads.py)
        rows_t = upload(rows, dev, torch.int64)  # [bs]
        cached_t = upload(cached, dev, torch.int64)  # [bs]
        ones = torch.ones(len(rows), dtype=torch.int64, device=dev)  # [bs]
        host = HostShape(len(rows), 1, max(cached, default=-1) + 1)
        loc = self.slots.place(rows_t, cached_t, ones, total=host.tokens)  # [bs]
        if loc is None:
            return None
        ids_t = ids if isinstance(ids, torch.Tensor) else upload(ids, dev, torch.int64)  # [bs]
        return build_forward_batch(ForwardMode.DECODE, ids_t, cached_t, loc, self.slots.table,
                                   rows_t, cached_t, ones, capture_layer_ids=capture_layer_ids,
                                   dense_mask=self.dense_mask, host=host, row_kinds=RowKinds.of(params))

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> ModelOutput:
        if self.graphs is not None and self.graphs.can_run(fb):
            return self.graphs.forward(fb)
        return self.model(fb, self.kv, self.backend)

    @property
    def accelerated(self) -> bool:
        """Whether tensor work runs off the host: a GPU, or the simulated device (ddtree_serve/sim/), under which
        the speculative step runs its device-side paths (the batched tree build) as on a GPU."""
        return self.device.type != "cpu" or self.simulated

    def device_session(self) -> AbstractContextManager:
        """Wraps one scheduler step (or a start-up probe): under the simulated device (ddtree_serve/sim/) its
        tracker charges every host read of a device tensor, blocking copy and eager launch; otherwise nothing."""
        session = getattr(self.model, "device_session", None)
        return session() if session is not None else nullcontext()

    def host_now(self) -> float:
        """The host's clock for step timings: a simulated device's corrected clock (its charges and refunds,
        ddtree_serve/sim/device_clock.py), else wall time."""
        clock = getattr(self.model, "clock", None)
        return clock.now() if clock is not None else time.perf_counter()

    def blocked_seconds(self) -> float:
        """Host seconds spent blocked on a simulated device so far (a real device blocks inside its reads)."""
        clock = getattr(self.model, "clock", None)
        return clock.waited_s if clock is not None else 0.0

    def synchronize(self) -> None:
        """Wait until nothing is queued on the device (before a timing starts): a named, full sync."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        drain = getattr(self.model, "drain", None)
        if drain is not None:
            drain()

    def wait_device(self) -> None:
        """Where the step would read a forward's results back, right after launching it: the overlap window
        (``while_busy``: host work that needs no result of this step, set by the scheduler loop). The read itself
        synchronises (on CUDA, and under the simulated device's tracker); a simulated device outside a tracked
        session blocks here instead."""
        if self.while_busy is not None:
            self.while_busy()
        wait = getattr(self.model, "wait_device", None)
        if wait is not None:
            wait()

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[n, V]`` float32 logits, gathered over the TP ranks."""
        return self.model.compute_logits(hidden)

    @property
    def vocab_shard(self) -> VocabShard:
        """The vocabulary columns a step's logits hold on this rank (``step_logits``): the LM head's shard under
        TP with ``vocab_parallel_logits``, else the whole vocabulary."""
        head = getattr(self.model, "lm_head", None)
        if self.tp.size > 1 and self.tp.vocab_parallel and isinstance(head, ParallelLMHead):
            return VocabShard.of_group(head.vocab_size, head.start, head.end, self.tp)
        return VocabShard.whole(self.config.vocab_size, device_kernel=self.tp.size == 1)  # TP: the integer rule

    @torch.inference_mode()
    def step_logits(self, hidden: torch.Tensor) -> tuple[torch.Tensor, VocabShard]:
        """A step's logits for sampling and verification: ``[n, V/tp]`` this rank's columns and their shard
        under vocabulary-parallel TP (no gather: the sampler exchanges O(1) numbers a row), else ``[n, V]``."""
        shard = self.vocab_shard
        if shard.sharded:
            return self.model.lm_head.local_logits(hidden), shard
        return self.logits(hidden), shard
