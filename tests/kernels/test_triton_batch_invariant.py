"""Batch invariance of the Triton kernels' ``invariant=True`` mode (issue 60 item 1; docs/DESIGN.md 4.18) under
``TRITON_INTERPRET=1``: a row computed alone and inside a batch / a draft tree / a prefill chunk gives
bit-identical outputs (``torch.equal``), and the mode stays as close to the torch reference as the default
kernels (tolerances of tests/kernels/test_triton_mla.py and test_triton_moe.py: float32 1e-5, bfloat16 2e-2).

MLA (ddtree_serve/kernels/triton_mla_invariant.py): "alone" is one decode request whose keys are the row's
context in position order; the same row then runs inside decode batches of other sizes and key widths
(single-program and split-grid plans), as a token of a prefill chunk inside an extend batch, and as a tree
node whose ancestors are the plain tokens (its context sits at the tree's columns, behind masked siblings);
bfloat16 and float32, an fp8 cache, and a DCP rank's partial (o, lse). The float32 cases are the sharp ones:
the default kernels fail them (a forced split count changes a decode row by ~1e-7, a tree node differs from
the same token decoded by ~6e-8), while bfloat16's output rounding hides such differences at these shapes.
MoE (ddtree_serve/kernels/triton_moe.py):
a token alone vs inside batches of 5 and 37 tokens, dense and INT4. Tiny shapes (latent 32, rope 8, 4 heads,
contexts of up to ~170 keys cut into splits of 32 or 64 positions).
"""

from __future__ import annotations

import pytest
import torch

from ddtree_serve.kernels.attention import masked_paged_attention
from ddtree_serve.kernels.kv_quant import quantize_latent
from ddtree_serve.model_executor.forward_batch import ForwardMode, build_forward_batch
from ddtree_serve.model_executor.parallel_state import TPGroup
from tests.kernels.test_triton_mla import _tree_mask
from tests.kernels.test_triton_moe import H, _experts, _routing

pytest.importorskip("triton")

from ddtree_serve.kernels.triton_mla import MLA_KERNELS  # noqa: E402
from ddtree_serve.kernels.triton_mla_dcp import MLA_DCP_KERNELS  # noqa: E402
from ddtree_serve.kernels.triton_mla_launch import tree_ancestors  # noqa: E402
from ddtree_serve.kernels.triton_mla_plan import choose_mla_tiles, invariant_split_grid  # noqa: E402

LAT, ROPE, HEADS, SCALE, SLOTS = 32, 8, 4, 0.3, 700
W = LAT + ROPE


class World:
    """A latent cache of ``SLOTS`` rows (row 0: padding) in ``dtype`` (or fp8 with per-token scales), queries
    drawn per row, and the kernels' invariant launches over it."""

    def __init__(self, dtype: torch.dtype, seed: int, fp8: bool = False, split_keys: int = 64,
                 smem_limit: int | None = None) -> None:
        self.g = torch.Generator().manual_seed(seed)
        cache = torch.randn(SLOTS, 1, W, generator=self.g)  # [slots, 1, L + R]
        self.scales = None
        if fp8:
            cache[..., LAT:] *= 0.01
            cache, self.scales = quantize_latent(cache, LAT)  # fp8 [slots, 1, W], [slots, 2]
        else:
            cache = cache.to(dtype)
        self.cache, self.dtype, self.split_keys = cache, dtype, split_keys
        self.tiles = choose_mla_tiles(HEADS, LAT, ROPE, dtype, smem_limit, None, cache.dtype if fp8 else None,
                                      invariant=True)

    def slots(self, n: int) -> list[int]:
        """n distinct cache rows in random order (requests may share rows: the kernels only read them)."""
        return (torch.randperm(SLOTS - 1, generator=self.g)[:n] + 1).tolist()

    def queries(self, n: int) -> torch.Tensor:
        return torch.randn(n, HEADS, W, generator=self.g).to(self.dtype)  # [n, H, W]

    def batch(self, mode: ForwardMode, reqs: list[tuple[list[int], int]], tree: torch.Tensor | None = None):
        """reqs: (slots of every key column in order, prefix length) per request -> a ForwardBatch."""
        prefix = [p for _, p in reqs]
        extend = [len(s) - p for s, p in reqs]
        table = torch.zeros(len(reqs), max(len(s) for s, _ in reqs), dtype=torch.int64)  # [bs, K]
        for b, (s, _) in enumerate(reqs):
            table[b, : len(s)] = torch.tensor(s)
        new = torch.cat([table[b, p : len(s)] for b, (s, p) in enumerate(reqs)])
        z = torch.zeros(sum(extend), dtype=torch.int64)
        return build_forward_batch(mode, z, z, new, table, torch.arange(len(reqs)), torch.tensor(prefix),
                                   torch.tensor(extend), tree_mask=tree)

    def run(self, fb, q: torch.Tensor, invariant: bool = True, dcp: tuple[int, int] | None = None, **kw):
        args = (q, self.cache, fb.kv_indices, fb.attn_mask, fb.q_index, fb.prefix_lens, fb.extend_lens, LAT, SCALE,
                fb.tree_mask)
        opts = dict(k_scale=self.scales, tiles=self.tiles, invariant=invariant, split_keys=self.split_keys, **kw)
        if dcp is not None:
            return MLA_DCP_KERNELS[fb.mode.value](*args, dcp_size=dcp[0], dcp_rank=dcp[1], **opts)
        return MLA_KERNELS[fb.mode.value](*args, **opts)

    def alone(self, ctx: list[int], q_row: torch.Tensor, **kw):
        """One decode request over context ``ctx`` (its own key last) -> the row's output."""
        return self.run(self.batch(ForwardMode.DECODE, [(ctx, len(ctx) - 1)]), q_row[None], **kw)


def _assert_rows_equal(got, want, rows, msg: str) -> None:
    """got/want: tensors (or (o, lse) pairs) with one row per query; ``rows`` of ``got`` vs ``want``'s rows."""
    pairs = zip(got, want, strict=True) if isinstance(got, tuple) else [(got, want)]
    for g, w in pairs:
        assert torch.equal(g[rows], w), f"{msg}: max diff {(g[rows].float() - w.float()).abs().max()}"


def _decode_batches(world: World, ctx: list[int], q_row: torch.Tensor, **kw):
    """The row inside decode batches of 3 and 6 requests (other contexts from 1 to 150 keys, so the key width
    and the plan's grid change), first single-program then as a split grid -> [(output, row index)]."""
    out = []
    for bs, at in ((3, 1), (6, 4)):
        others = [world.slots(n) for n in torch.randint(1, 151, (bs - 1,), generator=world.g).tolist()]
        ctxs = others[:at] + [ctx] + others[at:]
        q = world.queries(bs)
        q[at] = q_row
        fb = world.batch(ForwardMode.DECODE, [(c, len(c) - 1) for c in ctxs])
        for num_splits in (1, 3):
            out.append((world.run(fb, q, num_splits=num_splits, **kw), at))
    return out


def _tree_case(world: World, prefix: int, nodes: int):
    """A request of ``prefix`` cached keys and a draft tree of ``nodes`` -> (key slots, tree [Q, Q], each node's
    plain context: the prefix, its ancestors by depth, itself)."""
    slots = world.slots(prefix + nodes)
    tree = _tree_mask(nodes, world.g)  # [n, n] ancestor-or-self
    depth = tree.sum(1) - 1
    plain = []
    for i in range(nodes):
        anc = sorted(tree[i].nonzero().flatten().tolist(), key=lambda k: int(depth[k]))
        plain.append(slots[:prefix] + [slots[prefix + k] for k in anc])
    return slots, tree, plain


CASES = [  # (dtype, fp8, split_keys, smem_limit): 32-key tiles in splits of 64; 16-key tiles in splits of 32
    pytest.param(torch.float32, False, 64, None, id="f32"),
    pytest.param(torch.bfloat16, False, 32, 8_000, id="bf16-tile16"),
    pytest.param(torch.bfloat16, True, 64, None, id="bf16-fp8cache"),
]


@pytest.mark.parametrize("dtype,fp8,split_keys,smem", CASES)
def test_mla_row_alone_equals_row_in_batch_chunk_and_tree(dtype, fp8, split_keys, smem):
    world = World(dtype, seed=3, fp8=fp8, split_keys=split_keys, smem_limit=smem)
    assert world.tiles is not None and split_keys % world.tiles.block_n == 0
    # decode: a 100-key context alone vs in batches, single program and split grid
    ctx = world.slots(100)
    q_row = world.queries(1)[0]
    alone = world.alone(ctx, q_row)
    for got, at in _decode_batches(world, ctx, q_row):
        _assert_rows_equal(got, alone[0], at, "decode in a batch")
    # a prefill chunk: 30 tokens after 50 cached ones, second request of an extend batch
    seq, pre, n = world.slots(80), 50, 30
    other = world.slots(50)
    q = world.queries(10 + n)
    fb = world.batch(ForwardMode.EXTEND, [(other, 40), (seq, pre)])  # 10 + 30 new tokens
    chunk = world.run(fb, q)[10:]
    plain = world.run(world.batch(ForwardMode.DECODE, [(seq[: pre + j + 1], pre + j) for j in range(n)]), q[10:])
    _assert_rows_equal(chunk, plain, slice(None), "chunk vs its tokens decoded")
    for j in (0, n - 1):
        _assert_rows_equal(chunk, world.alone(seq[: pre + j + 1], q[10 + j])[0], j, f"chunk token {j} alone")
    # a draft tree of 9 nodes after 70 cached keys, first request of a verify batch with another tree
    slots, tree, node_ctx = _tree_case(world, 70, 9)
    slots2, tree2, _ = _tree_case(world, 110, 5)
    masks = torch.zeros(2, 9, 9, dtype=torch.bool)
    masks[0], masks[1, :5, :5] = tree, tree2
    q = world.queries(14)
    plain = world.run(world.batch(ForwardMode.DECODE, [(c, len(c) - 1) for c in node_ctx]), q[:9])
    for num_splits in (1, 2):
        got = world.run(world.batch(ForwardMode.TARGET_VERIFY, [(slots, 70), (slots2, 110)], masks), q,
                        num_splits=num_splits)
        _assert_rows_equal(got, plain, slice(0, 9), f"tree nodes vs decoded, splits {num_splits}")
    for i in (0, 8):
        _assert_rows_equal(got, world.alone(node_ctx[i], q[i])[0], i, f"tree node {i} alone")


@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.EXTEND, ForwardMode.TARGET_VERIFY])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_invariant_matches_reference(mode, dtype):
    world = World(dtype, seed=5)
    extend = {ForwardMode.DECODE: [1, 1, 1], ForwardMode.EXTEND: [7, 1, 20],
              ForwardMode.TARGET_VERIFY: [9, 5, 12]}[mode]
    prefix = [5, 0, 150] if mode == ForwardMode.DECODE else [12, 3, 100]
    tree = None
    if mode == ForwardMode.TARGET_VERIFY:
        tree = torch.zeros(3, max(extend), max(extend), dtype=torch.bool)
        for b, n in enumerate(extend):
            tree[b, :n, :n] = _tree_mask(n, world.g)
    fb = world.batch(mode, [(world.slots(p + e), p) for p, e in zip(prefix, extend, strict=True)], tree)
    q = world.queries(sum(extend))
    ref = masked_paged_attention(q, world.cache, world.cache[..., :LAT], fb.kv_indices, fb.attn_mask, fb.q_index,
                                 SCALE)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for num_splits in (1, 2):
        got = world.run(fb, q, num_splits=num_splits)
        assert got.dtype == dtype and got.shape == ref.shape
        torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype,fp8", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)])
def test_mla_dcp_rank_partial_is_invariant_and_matches_the_default(dtype, fp8):
    """A DCP rank's partial (o, lse; DCP 2, rank 1): the row alone vs in a batch and as a tree node, bit for
    bit; and close to the default DCP kernel's (1e-5; bfloat16 2e-2). float32 is the sharp case: the default
    kernels fail it (split count, tree layout); at these tiny shapes they happen to pass the bfloat16 one."""
    world = World(dtype, seed=9, fp8=fp8)
    dcp = (2, 1)
    ctx = world.slots(120)
    q_row = world.queries(1)[0]
    alone = world.alone(ctx, q_row, dcp=dcp)
    for got, at in _decode_batches(world, ctx, q_row, dcp=dcp):
        _assert_rows_equal(got, (alone[0][0], alone[1][0]), at, "dcp decode in a batch")
    slots, tree, node_ctx = _tree_case(world, 66, 7)
    q = world.queries(7)
    fb = world.batch(ForwardMode.TARGET_VERIFY, [(slots, 66)], tree[None])
    got = world.run(fb, q, dcp=dcp)
    plain = world.run(world.batch(ForwardMode.DECODE, [(c, len(c) - 1) for c in node_ctx]), q, dcp=dcp)
    _assert_rows_equal(got, plain, slice(None), "dcp tree nodes vs decoded")
    default = world.run(fb, q, invariant=False, dcp=dcp)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for a, b in zip(got, default, strict=True):
        torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)


def test_invariant_launch_rules():
    """The split size must be a multiple of the key tile; a mask that is not a tree is refused; the plan's
    split grid covers every position in fixed splits (and is 1 where the default would not split)."""
    world = World(torch.float32, seed=1, split_keys=48)  # BLOCK_N 32
    with pytest.raises(ValueError, match="split_keys"):
        world.alone(world.slots(10), world.queries(1)[0])
    fork = torch.tensor([[[1, 0, 0], [1, 1, 0], [1, 0, 1]]], dtype=torch.bool)  # nodes 1 and 2: children of 0
    anc, depth = tree_ancestors(fork)
    assert depth.tolist() == [[0, 1, 1]] and anc[0, 2, :2].tolist() == [0, 2]
    with pytest.raises(ValueError, match="not a tree"):
        tree_ancestors(torch.tensor([[[1, 0, 0], [1, 1, 0], [0, 1, 1]]], dtype=torch.bool))  # node 2: two keys at depth 1
    assert invariant_split_grid(1, 4096, None, 512) == 1  # no SM count (CPU): one program walks every split
    assert invariant_split_grid(1, 4096, 132, 512) == 8
    assert invariant_split_grid(1, 4100, 132, 512) == 9
    assert invariant_split_grid(1000, 4096, 132, 512) == 1  # a full launch keeps one program per token


@pytest.mark.parametrize("int4", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_token_alone_equals_token_in_batch(int4, dtype):
    """A token's routed-experts output with ``invariant=True``: alone vs inside batches of 5 and 37 tokens
    (its pairs in other rows of other expert blocks) is bit-identical; and on test_triton_moe.py's bfloat16
    case (9 tokens, top 3) / its float32 ragged case (37 tokens, top 2) as close to the torch reference."""
    ref = _experts(int4, TPGroup(), "torch", dtype)
    tri = _experts(int4, TPGroup(), "triton", dtype)
    from ddtree_serve.kernels.triton_moe import fused_moe

    def run(x, w, ids):  # the layer's call (forward_triton) with the mode on
        if int4:
            return fused_moe(x, w, ids, tri.w13_packed, tri.w2_packed, tri.expert_start, w13_scale=tri.w13_scale,
                             w2_scale=tri.w2_scale, group_size=tri.group, invariant=True)
        return fused_moe(x, w, ids, tri.w13, tri.w2, tri.expert_start, invariant=True)

    if dtype == torch.float32:
        x = torch.randn(37, H, generator=torch.Generator().manual_seed(37))
        weights, ids = _routing(37, 2, 37, [0, 3, 5, 6])
        torch.testing.assert_close(run(x, weights, ids), ref(x, weights, ids), atol=1e-5, rtol=1e-5)
    else:
        x = torch.randn(9, H, generator=torch.Generator().manual_seed(3)).bfloat16()
        weights, ids = _routing(9, 3, 3, list(range(8)))
        torch.testing.assert_close(run(x, weights, ids).float(), ref(x, weights, ids).float(), atol=2e-2,
                                   rtol=2e-2)
    x = torch.randn(37, H, generator=torch.Generator().manual_seed(4)).to(dtype)
    weights, ids = _routing(37, 3, 4, list(range(8)))
    full = run(x, weights, ids)
    for t in (20, 36):
        assert torch.equal(run(x[t : t + 1], weights[t : t + 1], ids[t : t + 1])[0], full[t]), f"token {t} alone"
    part = run(x[16:21], weights[16:21], ids[16:21])
    assert torch.equal(part, full[16:21])


def test_moe_combine_adds_the_slots_in_order_in_float32():
    """The invariant combine is exactly ``((row 0 + row 1) + row 2) + ...`` in float32 for every token (rows of
    very different magnitudes, so another order changes bits). Checked in float32 only: the interpreter's
    float32 -> bfloat16 ``.to`` truncates where a GPU rounds to nearest even, so the final rounding to
    bfloat16 cannot be compared with torch's here."""
    from ddtree_serve.kernels.triton_moe import combine_slots

    g = torch.Generator().manual_seed(2)
    t, k = 7, 4
    part = torch.randn(t * k, 300, generator=g) * torch.logspace(-4, 4, t * k)[:, None]  # [T*k, H] float32
    want = part[0::k].clone()
    for s in range(1, k):
        want = want + part[s::k]
    assert torch.equal(combine_slots(part, k, torch.float32), want)
