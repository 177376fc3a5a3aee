"""CUDA graphs for the target's DECODE and TARGET_VERIFY forwards over a fixed set of padded batch sizes.

A decode step (one token per request) or a verify step (``q`` tree nodes per request, ``q`` = DDTree
budget + 1) launches hundreds of small kernels; replaying a captured graph removes their launch overhead
(the idea of SGLang's CudaGraphRunner, written here for our ForwardBatch). One graph per
``(mode, q, capture_layer_ids, padded batch size)``, all sharing one memory pool. The server captures every
graph it will replay before it reports ready (ddtree_serve/server/warmup.py: ``serving_graph_keys`` -> ``capture``, then
``freeze``); after ``freeze`` a batch without its graph runs eagerly (``eager_fallbacks`` counts them) and
the runner never captures at first use (``forward`` raises instead). Unfrozen (tests, offline use), a graph
is captured at its first use.

A capture ahead of use (``capture``) fills the static buffers with padding only: every request padded,
writing slot 0 and seeing key 0. Order at a first use: fill the static buffers with THIS step's batch, then
warm up, then capture, then replay. The warm-up forwards really run, and every forward writes its tokens' KV
at ``out_cache_loc``: run on stale buffers (the previous step's batch, as before issue 33) they wrote the
previous step's tokens into slots that by now may hold another request's committed KV (it happened
whenever a new padded batch size was first captured for a query length used before). Filled first, they
write this step's own KV into this step's own slots (and padding into slot 0), which the replay then
writes again.

Static inputs: every ForwardBatch tensor at the padded size, as views of buffers shared by all graphs
(``kv_indices [max_bs, max_context]``, as wide as a request can grow, so one graph serves every step;
verify's compact ``tree_mask [max_bs, q, q]``). A replay copies the real batch into the top-left corner and
pads the rest: padded requests have prefix 0, write their KV to slot 0 (the padding slot) and see key 0
only; their outputs are dropped.

Capture is a ``GraphCapture`` (``warm_up(run)``, ``capture(run) -> replay``): ``CudaCapture`` on a GPU;
the CPU tests pass a stand-in (tests/model_executor/graph_capture_standin.py) that runs the warm-ups and
replays by running the recorded forward, so the runner's order is checked against a live KV pool on CPU.

Capturable only when the forward never syncs with the host: the MLA model (DeepSeek-V3 / Kimi) with
``attention_backend == "triton"`` (its kernels bound the key loop on device) and ``moe_backend == "triton"``
(sync-free alignment) or no routed experts. ``capture=False`` runs the same padded static batches eagerly:
how the CPU tests check the padding contract (padded forward == plain forward) without a GPU.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from ddtree_serve.model_executor.forward_batch import ForwardBatch, ForwardMode
from ddtree_serve.model_executor.model_config import ModelConfig
from ddtree_serve.model_executor.models.output import ModelOutput


def graph_batch_sizes(max_bs: int) -> tuple[int, ...]:
    """Padded batch sizes captured for ``--cuda-graph-max-bs``: 1, 2, 4, 8, then every 8 up to max_bs."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_bs] + list(range(16, max_bs, 8)) + [max_bs]
    return tuple(sorted(set(sizes)))


GraphKey = tuple[ForwardMode, int, tuple[int, ...], int]  # (mode, q, capture_layer_ids, padded batch size)


def auto_verify_widths(max_budget: int) -> tuple[int, ...]:
    """Tree widths (nodes + root) the adaptive budget's verify forwards are padded to, so they replay a graph:
    2, 3, 5, 9, 17, ... up to ``max_budget + 1``, and ``max_budget + 1`` itself (docs/DESIGN.md 4.17)."""
    widths = {w for w in (2 ** i + 1 for i in range(0, 12)) if w <= max_budget + 1} | {max_budget + 1}
    return tuple(sorted(w for w in widths if w >= 2))


def serving_graph_keys(batch_sizes: tuple[int, ...], layer_ids: tuple[int, ...], budget: int | None,
                       max_verify_tokens: int | None = None, auto: bool = False) -> list[GraphKey]:
    """The graphs a server replays: DECODE (q 1) at every padded size, and with speculation (``budget``: the
    worker's tree budget, the maximum for ``auto``) TARGET_VERIFY at ``q = step budget + 1`` of every batch
    that pads to each size: a full tree per request, the budget lowered by ``memory.step_budget`` where
    ``bs x (budget + 1)`` would pass ``max_verify_tokens``; with ``auto``, every width of ``auto_verify_widths``
    whose padded batch fits ``max_verify_tokens`` (the adaptive budget's trees are padded to the next one). Trees
    of other sizes run eagerly. ``layer_ids``: the target layers the drafter reads (``()`` without one)."""
    from ddtree_serve.model_executor.memory import step_budget

    keys: list[GraphKey] = [(ForwardMode.DECODE, 1, layer_ids, b) for b in batch_sizes]
    if budget is None or budget < 1:
        return keys
    lo = 0
    for pad in batch_sizes:
        if auto:
            qs = {w for w in auto_verify_widths(budget) if max_verify_tokens is None or pad * w <= max_verify_tokens}
        else:
            qs = {(budget if max_verify_tokens is None else step_budget(budget, b, max_verify_tokens)) + 1
                  for b in range(lo + 1, pad + 1)}
        keys += [(ForwardMode.TARGET_VERIFY, q, layer_ids, pad) for q in sorted(qs) if q >= 2]
        lo = pad
    return keys


def verify_widths(keys: list[GraphKey]) -> dict[int, tuple[int, ...]]:
    """Per padded batch size, the tree widths (tokens per request) of ``keys``' verify graphs, ascending."""
    out: dict[int, set[int]] = {}
    for mode, q, _, pad in keys:
        if mode == ForwardMode.TARGET_VERIFY:
            out.setdefault(pad, set()).add(q)
    return {pad: tuple(sorted(qs)) for pad, qs in sorted(out.items())}


def check_graphable(config: ModelConfig) -> None:
    """ValueError unless this model's forward is capturable (see module docstring)."""
    mla = bool(config.hf.get("kv_lora_rank"))
    moe_ok = config.moe_backend == "triton" or not config.hf.get("n_routed_experts")
    if not (mla and config.attention_backend == "triton" and moe_ok):
        raise ValueError(
            "CUDA graphs are wired for MLA models with attention_backend 'triton' and moe_backend "
            f"'triton' only (got {config.architecture}, attention_backend "
            f"{config.attention_backend!r}, moe_backend {config.moe_backend!r})"
        )


DEFAULT_GRAPH_MAX_BS = 256  # the default's cap: past it a step is long enough that launches are a small share


def default_graph_max_bs(requested: int | None, config: ModelConfig, device: str, max_running: int,
                         dcp: int = 1) -> tuple[int, str]:
    """``--cuda-graph-max-bs`` resolved -> (the padded batch bound, 0 = eager; why). Given (``requested`` not
    None): as given, 0 turning graphs off. By default (None) on for a forward that can be captured: CUDA, the
    MLA model with the Triton backends (``check_graphable``), no decode context parallelism (its collectives
    have not run captured), up to ``max_running`` requests (at most ``DEFAULT_GRAPH_MAX_BS``); eager otherwise,
    with the reason, which start-up logs."""
    if requested is not None:
        return requested, "set by --cuda-graph-max-bs" if requested else "off: --cuda-graph-max-bs 0"
    if not str(device).startswith("cuda"):
        return 0, f"off: device {device}"
    try:
        check_graphable(config)
    except ValueError as e:
        return 0, f"off: {e}"
    if dcp > 1:
        return 0, "off: decode context parallelism (not run captured yet; --cuda-graph-max-bs N asks for it)"
    return min(max_running, DEFAULT_GRAPH_MAX_BS), "on by default (--cuda-graph-max-bs 0 turns them off)"


class GraphCapture(Protocol):
    """How the runner turns a forward over static buffers into a replayable graph."""

    def warm_up(self, run: Callable[[], ModelOutput]) -> None:
        """Run the forward once before capture (compiles kernels, settles the allocator); it really runs."""

    def capture(self, run: Callable[[], ModelOutput]) -> Callable[[], ModelOutput]:
        """Record the forward (nothing runs) -> a replay that runs it on the static buffers' current
        contents and returns its output."""


class CudaCapture:
    """``GraphCapture`` with torch.cuda graphs: warm-ups on a side stream, every graph in one memory pool."""

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()

    def warm_up(self, run: Callable[[], ModelOutput]) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            run()
        torch.cuda.current_stream().wait_stream(stream)

    def capture(self, run: Callable[[], ModelOutput]) -> Callable[[], ModelOutput]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = run()  # static outputs: each replay rewrites them

        def replay() -> ModelOutput:
            graph.replay()
            return out

        return replay


@dataclass
class _Graph:
    fb: ForwardBatch  # static padded inputs (views of the runner's shared buffers)
    replay: Callable[[], ModelOutput]  # the captured graph, or an eager forward of ``fb`` (no capture)


class CudaGraphRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv,
        backend,
        batch_sizes: tuple[int, ...],
        max_context: int,
        device: torch.device | str,
        capture: bool | GraphCapture = True,
    ):
        """``capture``: True: CUDA graphs (``CudaCapture``, CUDA only); False: the padded static batches run
        eagerly; a ``GraphCapture``: that one (the CPU tests' stand-in)."""
        if capture is True and torch.device(device).type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.model, self.kv, self.backend = model, kv, backend
        self.batch_sizes = tuple(sorted(batch_sizes))
        self.max_bs = self.batch_sizes[-1]
        self.max_context, self.device = max_context, torch.device(device)
        self.capturer: GraphCapture | None = CudaCapture() if capture is True else (capture or None)
        self.graphs: dict[tuple, _Graph] = {}
        # shared by every graph (each uses the leading rows): [max_bs, max_context] KV slots, [max_bs] prefixes
        self.kv_indices = torch.zeros(self.max_bs, max_context, dtype=torch.int64, device=self.device)
        self.prefix_lens = torch.zeros(self.max_bs, dtype=torch.int64, device=self.device)
        self.tokens: dict[int, dict[str, torch.Tensor]] = {}  # per q: [max_bs * q] token-level buffers
        # per (q, captured width): [max_bs * q, H] and [max_bs * q, C] outputs every graph of that q writes, so
        # graphs of other batch sizes share them instead of each keeping its own (``forward`` copies them out)
        self.outputs: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.frozen = False  # set by ``freeze``: no capture at first use from then on
        self.captures = 0  # graphs captured (ahead of use or at first use)
        self.replays: Counter[GraphKey] = Counter()  # forwards served from each graph
        self.eager_fallbacks = 0  # after ``freeze``: graphable batches whose graph was not captured

    def _key(self, fb: ForwardBatch) -> GraphKey:
        bs_pad = next(b for b in self.batch_sizes if b >= fb.batch_size)
        return fb.mode, fb.max_q, fb.capture_layer_ids, bs_pad

    def can_run(self, fb: ForwardBatch) -> bool:
        """Decode or verify, every request with the same number of new tokens, a captured size fits; after
        ``freeze``, its graph was captured."""
        if fb.mode not in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY) or fb.input_embeds is not None:
            return False
        if fb.mode == ForwardMode.TARGET_VERIFY and fb.tree_mask is None:
            return False
        bs, q = fb.batch_size, fb.max_q
        fits = 0 < bs <= self.max_bs and fb.input_ids.numel() == bs * q and fb.kv_indices.shape[1] <= self.max_context
        if fits and self.frozen and self._key(fb) not in self.graphs:
            self.eager_fallbacks += 1
            return False
        return fits

    def capture(self, keys: list[GraphKey]) -> int:
        """Capture the graphs of ``keys`` not captured yet, ahead of use (server warm-up), on static buffers
        holding padding only (module docstring): their forwards write slot 0 alone. Returns how many."""
        if self.frozen:
            raise RuntimeError("CudaGraphRunner is frozen: graphs are captured before freeze()")
        n = 0
        for mode, q, layer_ids, bs in keys:
            key = (mode, q, tuple(layer_ids), bs)
            if bs not in self.batch_sizes:
                raise ValueError(f"batch size {bs} is not one of the padded sizes {self.batch_sizes}")
            if key in self.graphs:
                continue
            static = self._static(mode, q, key[2], bs)
            self._pad(static)
            self.graphs[key] = self._make(static)
            n += 1
        return n

    def freeze(self) -> None:
        """From now on never capture: a graphable batch without its graph runs eagerly (``can_run`` False)."""
        self.frozen = True

    def forward(self, fb: ForwardBatch) -> ModelOutput:
        bs, q = fb.batch_size, fb.max_q
        key = self._key(fb)
        g = self.graphs.get(key)
        if g is None:  # fill first: the warm-up forwards write KV at the static out_cache_loc (module doc)
            if self.frozen:
                raise RuntimeError(f"no CUDA graph for {key} after freeze(): can_run() is False for this batch")
            static = self._static(fb.mode, q, fb.capture_layer_ids, key[3])
            self._fill(static, fb)
            g = self.graphs[key] = self._make(static)
        else:
            self._fill(g.fb, fb)
        self.replays[key] += 1
        out = g.replay()
        t = bs * q
        captured = out.captured[:t].clone() if out.captured is not None else None
        return ModelOutput(out.hidden[:t].clone(), captured)

    def _buffers(self, q: int) -> dict[str, torch.Tensor]:
        if q not in self.tokens:
            n, dev = self.max_bs * q, self.device
            self.tokens[q] = {
                "input_ids": torch.zeros(n, dtype=torch.int64, device=dev),
                "positions": torch.zeros(n, dtype=torch.int64, device=dev),
                "out_cache_loc": torch.zeros(n, dtype=torch.int64, device=dev),
                "q_index": torch.arange(n, device=dev),
                "tree_mask": torch.zeros(self.max_bs, q, q, dtype=torch.bool, device=dev),
            }
        return self.tokens[q]

    def _static(self, mode: ForwardMode, q: int, layer_ids: tuple[int, ...], bs: int) -> ForwardBatch:
        """Views of the shared buffers at the padded size. ``attn_mask`` is a [bs, q, 1] placeholder: the
        Triton MLA kernels read lengths (decode) and ``tree_mask`` (verify), not the dense mask."""
        buf, t = self._buffers(q), bs * q
        verify = mode == ForwardMode.TARGET_VERIFY
        return ForwardBatch(
            mode=mode,
            input_ids=buf["input_ids"][:t],
            positions=buf["positions"][:t],
            out_cache_loc=buf["out_cache_loc"][:t],
            kv_indices=self.kv_indices[:bs],
            attn_mask=torch.ones(bs, q, 1, dtype=torch.bool, device=self.device),
            q_index=buf["q_index"][:t],
            prefix_lens=self.prefix_lens[:bs],
            extend_lens=torch.full((bs,), q, dtype=torch.int64, device=self.device),
            capture_layer_ids=layer_ids,
            tree_mask=buf["tree_mask"][:bs] if verify else None,
        )

    def _make(self, fb: ForwardBatch) -> _Graph:
        """Warm up and capture the forward of the static batch ``fb``, already filled with the step's batch."""

        def run() -> ModelOutput:  # the model's own outputs are pool temporaries; the shared buffers keep them
            out = self.model(fb, self.kv, self.backend)
            hidden, captured = self._outputs(fb.max_q, out)
            t = out.hidden.shape[0]
            hidden[:t].copy_(out.hidden)
            if captured is not None:
                captured[:t].copy_(out.captured)
            return ModelOutput(hidden[:t], captured[:t] if captured is not None else None)

        self.captures += 1
        if self.capturer is None:
            return _Graph(fb, run)
        for _ in range(2):  # compiles the Triton kernels and settles the allocator outside the capture
            self.capturer.warm_up(run)
        return _Graph(fb, self.capturer.capture(run))

    def _outputs(self, q: int, out: ModelOutput) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The shared output buffers of every graph with ``q`` tokens per request (allocated at the first, before
        any capture uses them: a warm-up forward runs first)."""
        width = out.captured.shape[-1] if out.captured is not None else 0
        if (q, width) not in self.outputs:
            n = self.max_bs * q
            hidden = out.hidden.new_empty(n, out.hidden.shape[-1])  # [max_bs * q, H]
            captured = out.captured.new_empty(n, width) if out.captured is not None else None  # [max_bs * q, C]
            self.outputs[(q, width)] = (hidden, captured)
        return self.outputs[(q, width)]

    @staticmethod
    def _pad(st: ForwardBatch) -> None:
        """Every request of the static batch padding: prefix 0, token 0 at position 0 into slot 0, key 0 only."""
        for name in ("input_ids", "positions", "out_cache_loc"):
            getattr(st, name).zero_()
        st.kv_indices.zero_()
        st.prefix_lens.zero_()
        if st.tree_mask is not None:
            st.tree_mask.zero_()
            st.tree_mask[:, :, 0] = True

    @staticmethod
    def _fill(st: ForwardBatch, fb: ForwardBatch) -> None:
        """Copy the real batch into the static one; padded requests: prefix 0, slot 0, key 0 visible."""
        bs, t, k = fb.batch_size, fb.input_ids.numel(), fb.kv_indices.shape[1]
        for name in ("input_ids", "positions", "out_cache_loc"):
            dst = getattr(st, name)
            dst[:t].copy_(getattr(fb, name))
            dst[t:].zero_()
        st.kv_indices.zero_()
        st.kv_indices[:bs, :k].copy_(fb.kv_indices)
        st.prefix_lens.zero_()
        st.prefix_lens[:bs].copy_(fb.prefix_lens)
        if st.tree_mask is not None:
            st.tree_mask.zero_()
            st.tree_mask[:bs].copy_(fb.tree_mask)
            st.tree_mask[bs:, :, 0] = True
