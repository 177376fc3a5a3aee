"""How much next-token information the target features of a drafter-training data directory carry (issue 49).

A depth-1 probe, not a drafter: for every response position ``a`` of the data's records it predicts the token
at ``a + 1`` (the drafter's first block position) from ``[features at a - shift ; embedding of the token at
a]`` through one fused block (``fc`` -> RMSNorm, concatenated with the embedding, a linear mix, one gated MLP
with a residual, the target's final norm) and the target's frozen LM head, trained with cross-entropy over
the tokens present in the data. Its held-out top-1 accuracy (full vocabulary) is the number to set beside a
drafter's depth-1 accuracy (``train-drafter``'s evaluation, ``top-1 acc by depth``) on the same held-out records.

- ``--shift 1`` (default) is what a DFlash drafter sees: the target has not run the anchor yet, so its features
  stop at ``a - 1``. ``--shift 0`` reads the target's own state after the anchor (early exit at layer l): an
  upper reference for what running l target layers on the anchor would give.
- ``--layers`` picks among the data's captured target layers (indices into ``meta.json``'s
  ``target_layer_ids``); ``--extra-dir D`` adds one more captured layer stored per shard as ``D/<shard name>``
  (a list of ``[S, H]`` tensors, index ``len(target_layer_ids)``); ``--layers none`` is the embedding alone.
- ``--norm chan`` standardises every feature channel first, with statistics of the first 50,000 training
  positions.

    OMP_NUM_THREADS=1 python benchmarks/probe_drafter_features.py --data-dir /work/drafter/data --shards 26 \\
        --steps 4000
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file

from ddtree_serve.server.startup import resolve_model_path


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float = 1e-5):
        super().__init__()
        self.weight, self.eps = nn.Parameter(weight.clone()), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Probe(nn.Module):
    """[feats (D) ; embedding (H)] -> a hidden state the target's LM head reads."""

    def __init__(self, feat_dim: int, hidden: int, inter: int, final_norm: torch.Tensor,
                 mean: torch.Tensor, std: torch.Tensor):
        super().__init__()
        self.fc = nn.Linear(feat_dim, hidden, bias=False) if feat_dim else None
        self.hidden_norm = RMSNorm(torch.ones(hidden))
        self.mix = nn.Linear(2 * hidden if feat_dim else hidden, hidden, bias=False)
        self.mlp_norm = RMSNorm(torch.ones(hidden))
        self.gate, self.up = nn.Linear(hidden, inter, bias=False), nn.Linear(hidden, inter, bias=False)
        self.down = nn.Linear(inter, hidden, bias=False)
        self.norm = RMSNorm(final_norm)
        self.register_buffer("mean", mean)
        self.register_buffer("std", std)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0.0, 0.02)

    def forward(self, feats: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """feats [n, D], emb [n, H] -> [n, H]."""
        z = emb
        if self.fc is not None:
            z = torch.cat([self.hidden_norm(self.fc((feats.float() - self.mean) / self.std)), emb], -1)
        h = self.mix(z)  # [n, H]
        x = self.mlp_norm(h)
        return self.norm(h + self.down(F.silu(self.gate(x)) * self.up(x)))


def load_positions(shard: Path, layers: list[int], hidden: int, shift: int, extra: Path | None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One shard -> (features [n, len(layers) * H] at a - shift, anchor tokens [n], next tokens [n])."""
    recs = torch.load(shard, weights_only=False)
    extra_feats = torch.load(extra / shard.name) if extra is not None else None
    n_stored = recs[0]["feats"].shape[1] // hidden
    xs, anchors, nexts = [], [], []
    for i, r in enumerate(recs):
        tok, pl = r["tokens"].long(), int(r["prompt_len"])
        if tok.numel() - 2 < pl:
            continue
        a = torch.arange(pl, tok.numel() - 1)  # [n] anchors with a next token
        parts = [r["feats"][a - shift, j * hidden:(j + 1) * hidden] if j < n_stored else extra_feats[i][a - shift]
                 for j in layers]
        xs.append(torch.cat(parts, 1) if parts else torch.zeros(len(a), 0, dtype=torch.bfloat16))
        anchors.append(tok[a])
        nexts.append(tok[a + 1])
    return torch.cat(xs), torch.cat(anchors), torch.cat(nexts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--model-path", default="default")
    ap.add_argument("--layers", default="all", help="comma-separated indices into the data's layers, 'all' or 'none'")
    ap.add_argument("--extra-dir", default=None, help="one more captured layer per shard (index = stored count)")
    ap.add_argument("--shift", type=int, default=1, choices=[0, 1])
    ap.add_argument("--norm", default="raw", choices=["raw", "chan"])
    ap.add_argument("--shards", type=int, default=26, help="the first N train shards")
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--out", default=None, help="write the result JSON here too")
    args = ap.parse_args()
    torch.manual_seed(0)
    t0 = time.time()
    model_dir = resolve_model_path(args.model_path)
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    weights = load_file(str(next(Path(model_dir).glob("*.safetensors"))))
    embed = weights["model.embed_tokens.weight"].float()  # [V, H]
    hidden = int(cfg["hidden_size"])
    meta = json.loads((Path(args.data_dir) / "meta.json").read_text())
    n_layers = len(meta["target_layer_ids"]) + (args.extra_dir is not None)
    layers = ([] if args.layers == "none" else list(range(n_layers)) if args.layers == "all"
              else [int(x) for x in args.layers.split(",")])
    if any(not 0 <= j < n_layers for j in layers):
        raise SystemExit(f"--layers {args.layers}: indices must lie in 0..{n_layers - 1} (the data's "
                         f"{len(meta['target_layer_ids'])} layers{', then --extra-dir' if args.extra_dir else ''})")
    extra = Path(args.extra_dir) if args.extra_dir else None
    feat_dir = Path(args.data_dir) / "feat"
    shards = sorted(feat_dir.glob("train_*.pt"))[:args.shards]
    train = [load_positions(s, layers, hidden, args.shift, extra) for s in shards]
    x, anchor, nxt = (torch.cat([t[k] for t in train]) for k in range(3))
    ev = [load_positions(s, layers, hidden, args.shift, extra) for s in sorted(feat_dir.glob("eval_*.pt"))]
    x_ev, anchor_ev, nxt_ev = (torch.cat([t[k] for t in ev]) for k in range(3))
    print(f"{len(nxt)} training positions from {len(shards)} shards, {len(nxt_ev)} held out "
          f"({time.time() - t0:.0f} s)", flush=True)

    vocab = torch.unique(torch.cat([nxt, anchor]))  # [Vc] the training softmax's tokens
    remap = torch.full((embed.shape[0],), -1, dtype=torch.long)
    remap[vocab] = torch.arange(len(vocab))
    dim = x.shape[1]
    mean, std = torch.zeros(dim), torch.ones(dim)
    if args.norm == "chan" and dim:  # statistics of the first 50,000 training positions
        sample = x[:50000].float()
        mean, std = sample.mean(0), sample.std(0) + 1e-3
    probe = Probe(dim, hidden, int(cfg["intermediate_size"]), weights["model.norm.weight"].float(), mean, std)
    opt = torch.optim.AdamW(probe.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator().manual_seed(0)

    @torch.no_grad()
    def accuracy() -> float:
        hits = 0
        for i in range(0, len(nxt_ev), 2048):
            h = probe(x_ev[i:i + 2048], embed[anchor_ev[i:i + 2048]])  # [n, H]
            hits += int((h @ embed.T).argmax(-1).eq(nxt_ev[i:i + 2048]).sum())
        return hits / len(nxt_ev)

    for step in range(1, args.steps + 1):
        lr = args.lr * min(1.0, step / 50) * (0.1 + 0.45 * (1 + math.cos(math.pi * step / args.steps)))
        for group in opt.param_groups:
            group["lr"] = lr
        idx = torch.randint(len(nxt), (args.batch,), generator=gen)
        h = probe(x[idx], embed[anchor[idx]])  # [batch, H]
        loss = F.cross_entropy(h @ embed[vocab].T, remap[nxt[idx]])
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(probe.parameters(), 1.0)
        opt.step()
        if step % 500 == 0 or step == args.steps:
            print(f"step {step}/{args.steps} loss {loss.item():.3f} held-out top-1 {accuracy():.4f} "
                  f"({time.time() - t0:.0f} s)", flush=True)
    result = {"layers": [meta["target_layer_ids"][i] if i < len(meta["target_layer_ids"]) else "extra"
                         for i in layers], "shift": args.shift, "norm": args.norm, "shards": len(shards),
              "positions": len(nxt), "steps": args.steps, "batch": args.batch, "top1_heldout": accuracy()}
    print(json.dumps(result))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
