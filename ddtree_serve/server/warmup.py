"""Start-up warm-up: run every forward path serving will use before the server reports ready.

Kernels that compile at first use (Triton MLA/MoE, flashinfer's JIT modules, the sampling filters) and CUDA
graphs captured at first use would otherwise make the first requests pay for them, on every rank. The
auto budget's start-up probe runs its paths already (ddtree_serve/speculative/cost_probe.py), but a fixed budget or no
speculation did not. ``warm_up`` runs two short requests (one greedy, one sampled, fixed seeds) through the
real scheduler: a prefill, then decode steps, which are speculative steps (drafter forward, tree build,
verify forward, greedy and sampled verification, commit) whenever speculation is on, at the full budget
(the auto controller is set aside meanwhile, so its measurements and decisions are untouched). Then it
removes every trace: the requests are aborted (their output never joins the suffix index), the prefix
cache they filled is evicted and the statistics are reset. Every TP rank runs it identically (the same
collectives in the same order), before ``end_startup``. The paths that ran and the time are logged.

Before the requests, two more things (issue 33 item 4: nothing compiles or captures at first use):
- CUDA graphs (``--cuda-graph-max-bs``): every graph serving replays is captured
  (``cuda_graph_runner.serving_graph_keys``: decode and the full-tree verify at every padded batch size),
  then the runner is frozen: from then on a batch without its graph runs eagerly, nothing is captured at
  first use. The count and the time are logged. With speculation the drafter's and the tree build's graphs
  follow (``worker_graphs.capture_graphs``), then the auto budget's cost probe, which times the graphed steps.
- Triton kernel shapes (on CUDA, whenever the target runs a Triton MLA or MoE kernel): Triton compiles one
  kernel per specialization of its integer arguments (divisible by 16 or not), so eager forwards over
  synthetic batches run every shape family serving meets: extend, decode and verify with a key count
  divisible by 16 and one that is not, 1 and 16 tokens (the MoE's pair count), and on CUDA long contexts
  whose split-K launch uses a split count divisible by 16 and one that is not. Every key and new token of
  these batches is the padding slot 0, so they touch no request's KV. Under the interpreter (CPU) nothing
  compiles: off unless asked for (``kernel_shapes=True``, tests).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from ddtree_serve.model_executor.forward_batch import ForwardMode, build_forward_batch
from ddtree_serve.model_executor.sampling_params import SamplingParams
from ddtree_serve.server.io_struct import GenerateReq
from ddtree_serve.speculative.worker_graphs import capture_graphs

logger = logging.getLogger(__name__)

WARMUP_STEPS = 4  # scheduler steps: the prefill of both requests, then decode (or speculative) steps
WARMUP_MAX_TOKENS = 64  # never reached in WARMUP_STEPS: the requests never finish on their own
LONG_KEYS = (1027, 1040, 8192, 8195)  # split-K contexts (CUDA): key counts and split counts, /16 and not

KernelShape = tuple[ForwardMode, int, int, int]  # (mode, requests, new tokens per request, keys per request)


@dataclass(frozen=True)
class WarmupReport:
    paths: tuple[str, ...]  # forward modes and sub-steps that ran, in first-seen order
    seconds: float
    graphs: int = 0  # CUDA graphs captured ahead of use
    kernel_shapes: tuple[KernelShape, ...] = ()  # synthetic eager forwards run for the Triton kernels


def warm_up(scheduler, kernel_shapes: bool | None = None) -> WarmupReport:  # noqa: ANN001 - a Scheduler
    """Capture the CUDA graphs and run the Triton kernel shapes (``kernel_shapes``: default on CUDA with a
    Triton backend), then the warm-up requests, through ``scheduler`` (module docstring); returns what ran."""
    t0 = time.perf_counter()
    seen: list[str] = []
    runner, spec = scheduler.runner, scheduler.spec
    budget = spec.budget if spec is not None else None
    layer_ids = spec.capture_layer_ids if spec is not None else ()
    try:
        graphs = _capture_graphs(runner, layer_ids, budget, spec.max_verify_tokens if spec is not None else None,
                                 spec is not None and spec.auto)
        if spec is not None:
            graphs += capture_graphs(spec)  # the drafter's and the tree build's (none captured at first use)
    except RuntimeError as e:  # CUDA graphs are on by default where the model captures: say how to turn them off
        raise RuntimeError(f"CUDA graph capture failed ({e}); start with --cuda-graph-max-bs 0 to run the "
                           "forwards eagerly (docs/DEPLOY.md 'CUDA graphs')") from e
    if spec is not None:
        spec.probe_cost()  # the auto budget's cost probe, over the graphs just captured (once)
    if kernel_shapes is None:
        kernel_shapes = runner.device.type == "cuda" and runs_triton(runner.config)
    shapes = run_kernel_shapes(runner, layer_ids, budget) if kernel_shapes else ()
    undo = [_record(runner, "forward", lambda fb: f"target:{fb.mode.value}", seen)]
    if spec is not None and spec.drafter is not None:
        undo.append(_record(spec.drafter, "forward", lambda fb: "drafter", seen))
    controller = spec.controller if spec is not None else None
    if spec is not None:
        spec.controller = None  # the full budget, and nothing recorded into the auto controller
    vocab, room = scheduler.model_config.vocab_size, scheduler.max_request_tokens
    prompt = [(7 * i + 1) % vocab for i in range(max(1, min(8, room // 4)))]
    n = min(WARMUP_MAX_TOKENS, room - len(prompt))
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, seed=1),
              SamplingParams(temperature=1.0, top_p=0.9, max_tokens=n, ignore_eos=True, seed=2)]
    rids = [f"warmup-{i}" for i in range(len(params))]
    try:
        for rid, p in zip(rids, params, strict=True):
            try:
                scheduler.add_request(GenerateReq(rid, prompt, p))
            except ValueError as e:  # a KV pool or context too small for it: what fits still warms up
                logger.warning("warm-up request %s skipped: %s", rid, e)
        for _ in range(WARMUP_STEPS):
            if scheduler.has_work():
                scheduler.step()
        for rid in rids:  # aborted, not finished: the output never reaches the suffix index
            scheduler.abort_request(rid)
        scheduler.step()
    finally:
        for f in undo:
            f()
        if spec is not None:
            spec.controller = controller
    _forget(scheduler)
    report = WarmupReport(tuple(dict.fromkeys(seen)), time.perf_counter() - t0, graphs, shapes)
    logger.info("warm-up ran %s in %.1f s", ", ".join(report.paths), report.seconds)
    return report


def _capture_graphs(runner, layer_ids: tuple[int, ...], budget: int | None,  # noqa: ANN001 - a ModelRunner
                    max_verify_tokens: int | None, auto: bool = False) -> int:
    """Capture every CUDA graph serving replays, then freeze the runner; the number captured."""
    if runner.graphs is None:
        return 0
    from ddtree_serve.model_executor.cuda_graph_runner import serving_graph_keys

    t0 = time.perf_counter()
    keys = serving_graph_keys(runner.graphs.batch_sizes, layer_ids, budget, max_verify_tokens, auto)
    with torch.inference_mode():
        n = runner.graphs.capture(keys)
    runner.graphs.freeze()
    qs = sorted({k[1] for k in keys})
    logger.info("CUDA graphs: captured %d (batch sizes %s, tokens per request %s) in %.1f s; no capture after "
                "this", n, ",".join(map(str, runner.graphs.batch_sizes)), ",".join(map(str, qs)),
                time.perf_counter() - t0)
    return n


def runs_triton(config) -> bool:  # noqa: ANN001 - a ModelConfig
    """Whether the target runs a Triton kernel: MLA attention or routed experts on the triton backend."""
    mla = bool(config.hf.get("kv_lora_rank")) and config.attention_backend == "triton"
    return mla or (bool(config.hf.get("n_routed_experts")) and config.moe_backend == "triton")


def kernel_shape_plan(max_context: int, budget: int | None, long_contexts: bool) -> list[KernelShape]:
    """The synthetic batches ``(mode, requests, new tokens each, keys each)`` of the kernel-shape warm-up
    (module docstring): key counts divisible by 16 and not, 1 and 16 tokens, the verify tree at ``budget``
    (None: no speculation), and with ``long_contexts`` the split-K contexts ``LONG_KEYS``; only shapes within
    ``max_context`` keys."""
    shapes: list[KernelShape] = [(ForwardMode.EXTEND, 1, 16, 16), (ForwardMode.EXTEND, 1, 16, 19),
                                 (ForwardMode.DECODE, 1, 1, 17), (ForwardMode.DECODE, 16, 1, 32)]
    if budget is not None and budget >= 1:
        q = budget + 1
        shapes += [(ForwardMode.TARGET_VERIFY, 1, q, q + (3 if (q + 3) % 16 else 4)),
                   (ForwardMode.TARGET_VERIFY, 1, q, 16 * (q // 16 + 1))]
    if long_contexts:
        shapes += [(ForwardMode.DECODE, 1, 1, k) for k in LONG_KEYS]
        if budget is not None and budget >= 1:
            shapes += [(ForwardMode.TARGET_VERIFY, 1, budget + 1, k) for k in LONG_KEYS]
    return [s for s in shapes if s[3] <= max_context]


def run_kernel_shapes(runner, layer_ids: tuple[int, ...], budget: int | None  # noqa: ANN001 - a ModelRunner
                       ) -> tuple[KernelShape, ...]:
    """Eager target forwards over the ``kernel_shape_plan`` batches, every key and token in slot 0."""
    t0 = time.perf_counter()
    dev = runner.device
    plan = kernel_shape_plan(runner.max_context, budget, dev.type == "cuda")
    with torch.inference_mode():
        for mode, bs, q, keys in plan:
            pre, t = keys - q, bs * q
            tree = None
            if mode == ForwardMode.TARGET_VERIFY:  # a chain: node i sees nodes 0..i
                tree = torch.tril(torch.ones(q, q, dtype=torch.bool, device=dev)).expand(bs, q, q).contiguous()
            fb = build_forward_batch(
                mode, torch.zeros(t, dtype=torch.int64, device=dev),
                torch.arange(pre, keys, device=dev).repeat(bs),  # [T] positions
                torch.zeros(t, dtype=torch.int64, device=dev),  # [T] every new token's KV into slot 0
                torch.zeros(bs, keys, dtype=torch.int64, device=dev),  # [bs, K] every key is slot 0
                torch.arange(bs, device=dev), torch.full((bs,), pre), torch.full((bs,), q), tree_mask=tree,
                capture_layer_ids=layer_ids, dense_mask=runner.dense_mask)
            runner.model(fb, runner.kv, runner.backend)  # eager, past the CUDA graphs
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    logger.info("Triton kernel shapes warmed up: %d forwards in %.1f s", len(plan), time.perf_counter() - t0)
    return tuple(plan)


def _record(obj, name: str, label, seen: list[str]):  # noqa: ANN001, ANN202
    inner = getattr(obj, name)

    def call(fb, *args, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        seen.append(label(fb))
        return inner(fb, *args, **kw)

    setattr(obj, name, call)
    return lambda: delattr(obj, name)  # back to the class's method


def _forget(scheduler) -> None:  # noqa: ANN001
    """Evict what the warm-up cached and reset the statistics it moved."""
    kv = scheduler.kv
    if kv.tree is not None:
        kv.tree.evict(kv.tree.evictable_size)
    kv.hit_tokens = kv.query_tokens = 0
    scheduler.total_verify_steps = scheduler.total_spec_tokens = 0
    if scheduler.spec is not None:  # the per-phase step timings (benchmarks, tests) start empty
        scheduler.spec.timer.totals.clear()
        scheduler.spec.timer.steps = 0
    scheduler.outbox.clear()
