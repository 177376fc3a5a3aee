"""Train a DFlash drafter on cached target features (arXiv 2602.06036; objective in ``objective.py``).

The target is frozen (its embedding and LM head are read once, never trained). AdamW with linear warm-up
and cosine decay; bf16 autocast on CUDA, float32 on CPU. Every ``save_every`` steps the output directory
gets a z-lab-format export (``config.json`` + bf16 ``model.safetensors``) and ``trainer_state.pt``
(float32 weights, optimizer, step, RNG) from which ``train`` resumes. ``init_drafter`` starts a fresh run
(new optimizer and schedule) from an exported drafter's weights (``warm_start.py``).
"""

from __future__ import annotations

import json
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from ddtree_serve.model_executor.model_config import ModelConfig
from ddtree_serve.model_executor.models.dflash import DFlashDraftModel
from ddtree_serve.model_executor.weight_loader import safetensors_files
from ddtree_serve.speculative.train.evaluate import offline_acceptance
from ddtree_serve.speculative.train.export import drafter_config, save_drafter
from ddtree_serve.speculative.train.objective import dflash_loss, lr_at, make_block_batch
from ddtree_serve.speculative.train.warm_start import (
    check_init_drafter,
    load_init_drafter,
    resolve_init_drafter,
    seed_attention,
)


@dataclass
class TrainConfig:
    data_dir: str
    out_dir: str
    target_path: str
    num_layers: int = 1
    block_size: int = 8
    mask_token_id: int | None = None  # None: the target tokenizer's highest special id that is not EOS/BOS
    steps: int = 1000
    batch_size: int = 8  # sequences per step; 0 = as many as fit in memory (``auto_batch_size``)
    anchors_per_seq: int = 32
    lr: float = 6e-4
    warmup: int = 50
    weight_decay: float = 0.01
    gamma: float = 4.0
    grad_clip: float = 1.0
    out_norm_scale: float = 0.1  # drafter final norm starts at this times the target's final norm weight
    loss_vocab: str = "full"  # "full" | "corpus" (softmax over tokens seen in the data: CPU saver)
    kd_weight: float = 0.0  # alpha: (1 - alpha) CE + alpha soft-CE against the stored target top-K (objective.py)
    kd_corpus_vocab: str = "drop"  # with loss_vocab corpus: "drop" teacher ids outside it | "add" them to it
    hard_labels: str = "token"  # "token": the recorded token | "greedy": the target's top-1 there (objective.py)
    seed: int = 0
    device: str = "auto"
    save_every: int = 100
    eval_every: int = 0  # 0: only at the end
    eval_budget: int = 16
    time_budget_s: float | None = None  # shrink the schedule to fit, measured on this run's first 5 steps
    init_drafter: str | None = None  # exported drafter directory ('default': the shipped one) seeding a fresh run
    conv_kernel_size: int = 0  # > 0: DFlash2's grouped dynamic convolution with this many taps (starts as identity)
    conv_group_size: int = 16  # channels per dynamic-kernel group of that convolution
    num_kv_heads: int = 0  # the drafter's KV heads (0: the target's); a warm start repeats the seed's (warm_start.py)


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def target_tensors(target_path: str) -> dict[str, torch.Tensor]:
    """The target's input embedding ``embed`` [V, H], LM head ``head`` [V, H] (the embedding when tied)
    and final norm weight ``norm`` [H], float32."""
    cfg = ModelConfig.load(target_path)
    found: dict[str, torch.Tensor] = {}
    names = {"model.embed_tokens.weight": "embed", "embed_tokens.weight": "embed", "lm_head.weight": "head",
             "model.norm.weight": "norm", "norm.weight": "norm"}
    for f in safetensors_files(target_path):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                key = names.get(k.removeprefix("language_model.").removeprefix("model.language_model."))
                if key is not None:
                    found[key] = h.get_tensor(k).float()
    if cfg.hf.get("tie_word_embeddings", False) or "head" not in found:
        found["head"] = found["embed"]
    return found


def target_embed_and_head(target_path: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's input embedding [V, H] and LM head [V, H] (the same tensor when tied), float32."""
    t = target_tensors(target_path)
    return t["embed"], t["head"]


def default_mask_token_id(target_path: str) -> int:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target_path)
    skip = set(ModelConfig.load(target_path).eos_token_ids) | {tok.bos_token_id, tok.eos_token_id, tok.pad_token_id}
    ids = [i for i in tok.all_special_ids if i not in skip]
    if getattr(tok, "mask_token_id", None) is not None:
        return int(tok.mask_token_id)
    if not ids:
        raise ValueError("the target tokenizer has no spare special token; pass --mask-token-id")
    return int(max(ids))


def free_memory_bytes(device: torch.device) -> int:
    """Free memory on ``device``: CUDA's free bytes, or the host's available physical memory."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def auto_batch_size(free_bytes: int, seq_len: int, anchors: int, block: int, hidden: int, n_feats: int,
                    heads: int, num_layers: int, vocab: int, fraction: float = 0.5, cap: int = 64) -> int:
    """Sequences per step that fit in ``fraction`` of ``free_bytes`` (at least 1, at most ``cap``).

    Float32 bytes per sequence, forward + backward (x3 for saved activations and their gradients):
    target features ``S x n*H`` (bf16 cache -> fp32 copy), per layer the attention scores
    ``heads x Q x (S + Q)`` and ~16 hidden-sized tensors over ``S + Q`` rows, and the loss logits
    ``Q x V`` (``Q = anchors * block``)."""
    q = anchors * block
    per_seq = 4 * (seq_len * n_feats * hidden * 2
                   + 3 * num_layers * (heads * q * (seq_len + q) + 16 * (seq_len + q) * hidden)
                   + 3 * q * vocab)
    return max(1, min(cap, int(free_bytes * fraction) // per_seq))


def load_records(data_dir: str, prefix: str) -> list[dict]:
    recs: list[dict] = []
    for f in sorted((Path(data_dir) / "feat").glob(f"{prefix}_*.pt")):
        recs += torch.load(f)
    return recs


def corpus_vocab(recs: list[dict], with_teacher: bool = False, with_top1: bool = False) -> torch.Tensor:
    """Sorted ids [V'] of the tokens present in the records (``--loss-vocab corpus``), plus every stored
    teacher id when ``with_teacher``, or only the teacher top-1 ids (greedy labels) when ``with_top1``."""
    ids = [r["tokens"].long() for r in recs]
    if with_teacher:
        ids += [r["teacher_ids"].long().reshape(-1) for r in recs if "teacher_ids" in r]
    elif with_top1:
        ids += [r["teacher_ids"][:, 0].long() for r in recs if "teacher_ids" in r]
    return torch.unique(torch.cat(ids))


def build_drafter(config_dict: dict, device: torch.device, seed: int) -> DFlashDraftModel:
    """A trainable float32 drafter for ``config_dict``: small random weights, unit norms, zero biases; its
    convolutions (if any) start as the identity and draw no random numbers, so a conv drafter starts as the
    plain drafter of the same seed."""
    mcfg = ModelConfig(path="", hf=config_dict, architecture="DFlashDraftModel", eos_token_ids=(),
                       dtype=torch.float32)
    with torch.device(device):
        model = DFlashDraftModel(mcfg)
    g = torch.Generator(device="cpu").manual_seed(seed)
    for name, p in model.named_parameters():
        if "_conv." in name:  # set to the identity by the module itself
            continue
        if name.endswith("norm.weight"):
            p.data.fill_(1.0)
        elif name.endswith("bias"):
            p.data.zero_()
        else:
            p.data.copy_(torch.randn(p.shape, generator=g) * 0.02)
    for layer in model.layers:
        for conv in (layer.attention_conv, layer.mlp_conv):
            if conv is not None:
                conv.identity_()
    return model.requires_grad_(True)


def train(cfg: TrainConfig) -> dict[str, float]:
    """Run (or resume) training; returns the final evaluation."""
    device = pick_device(cfg.device)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = json.loads((Path(cfg.data_dir) / "meta.json").read_text())
    target_hf = ModelConfig.load(cfg.target_path).hf
    state_path = out / "trainer_state.pt"
    st = torch.load(state_path, weights_only=False) if state_path.exists() else None
    init = resolve_init_drafter(cfg.init_drafter) if cfg.init_drafter else None
    if init and st is not None:
        _check_resume_origin(st, init, state_path)
    saved = out / "config.json" if st is not None and (out / "config.json").exists() else None
    mask_id = cfg.mask_token_id
    if mask_id is None:  # a resumed run or a warm start keeps its drafter's mask token unless one is asked for
        known = saved or (Path(init) / "config.json" if init else None)
        mask_id = (json.loads(known.read_text())["dflash_config"]["mask_token_id"] if known
                   else default_mask_token_id(cfg.target_path))
    if cfg.conv_kernel_size < 0:
        raise ValueError(f"--conv-kernel-size must be >= 0 (0: off), got {cfg.conv_kernel_size}")
    dcfg = drafter_config(target_hf, cfg.num_layers, cfg.block_size, meta["target_layer_ids"], mask_id,
                          cfg.conv_kernel_size, cfg.conv_group_size, cfg.num_kv_heads)
    seed = saved or (Path(init) / "config.json" if init else None)  # its layer kinds carry over (warm_start.py)
    if seed is not None:
        dcfg = seed_attention(json.loads(seed.read_text()), dcfg, f"the drafter at {seed.parent}")
    if saved is not None:  # resuming under other flags would train the weights as another drafter
        check_init_drafter(json.loads(saved.read_text()), dcfg, f"the drafter being resumed in {out}")
    model = build_drafter(dcfg, device, cfg.seed)
    tt = target_tensors(cfg.target_path)
    embed_w, head_w = tt["embed"].to(device), tt["head"].to(device)
    if "norm" in tt:  # output feeds the target's LM head: its final norm, scaled down so that the first
        model.norm.weight.data.copy_(cfg.out_norm_scale * tt["norm"])  # logits are not confidently wrong
    if init and st is None:
        grown = load_init_drafter(model, dcfg, init)
        more = f"; {grown} layer(s) added on top, starting as identities" if grown else ""
        print(f"[train] starting from the weights of {init} (fresh optimizer and schedule{more})", flush=True)
    train_recs, eval_recs = load_records(cfg.data_dir, "train"), load_records(cfg.data_dir, "eval")
    if not train_recs:
        raise ValueError(f"no training data under {cfg.data_dir}/feat")
    if not 0.0 <= cfg.kd_weight <= 1.0:
        raise ValueError(f"--kd-weight must be in [0, 1], got {cfg.kd_weight}")
    if cfg.hard_labels not in ("token", "greedy"):
        raise ValueError(f"--hard-labels must be 'token' or 'greedy', got {cfg.hard_labels!r}")
    kd, greedy = cfg.kd_weight > 0, cfg.hard_labels == "greedy"
    if (kd or greedy) and not any("teacher_ids" in r for r in train_recs):
        print("[train] --kd-weight / --hard-labels greedy: no record carries teacher data (--teacher-topk); "
              "training on the recorded tokens with CE alone", flush=True)
    subset = None
    if cfg.loss_vocab == "corpus":
        subset = corpus_vocab(train_recs, kd and cfg.kd_corpus_vocab == "add", greedy).to(device)
    batch_size = cfg.batch_size
    if batch_size == 0:
        batch_size = auto_batch_size(free_memory_bytes(device), max(int(r["tokens"].numel()) for r in train_recs),
                                     cfg.anchors_per_seq, cfg.block_size, dcfg["hidden_size"],
                                     len(meta["target_layer_ids"]), dcfg["num_attention_heads"], cfg.num_layers,
                                     int(subset.numel()) if subset is not None else dcfg["vocab_size"])
        print(f"[train] batch size {batch_size} (by free memory on {device})", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    step, total, elapsed = 0, cfg.steps, 0.0
    origin = init  # the drafter this run started from (None: random), kept in trainer_state.pt
    gen = torch.Generator().manual_seed(cfg.seed)
    if st is not None:
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["optim"])
        # --steps above the saved total extends the run: the cosine schedule is stretched to the new horizon
        step, total, elapsed = st["step"], max(st["total"], cfg.steps), st["elapsed"]
        gen.set_state(st["gen"])
        origin = st.get("init_drafter")
        print(f"[train] resumed from {state_path} at step {step}/{total}", flush=True)
    order_rng = random.Random(f"{cfg.seed}:{step}")
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast(
        "cpu", enabled=False)
    (out / "train_config.json").write_text(json.dumps(asdict(cfg), indent=2))
    bar = tqdm(total=total, initial=step, desc="train", unit="step", mininterval=5.0)
    t_start, ema, first = time.time(), None, float("nan")
    run_steps, run_step_s = 0, 0.0
    while step < total:
        t0 = time.time()
        batch = make_block_batch(order_rng.sample(train_recs, min(batch_size, len(train_recs))),
                                 cfg.anchors_per_seq, cfg.block_size, mask_id, cfg.gamma, gen, teacher=kd,
                                 greedy_labels=greedy)
        lr = lr_at(step, total, cfg.lr, cfg.warmup)
        for g in opt.param_groups:
            g["lr"] = lr
        with autocast:
            hid = model.forward_train(batch.ctx_feats.to(device), batch.ctx_positions.to(device),
                                      embed_w[batch.block_ids.to(device)], batch.block_positions.to(device),
                                      batch.attn_mask.to(device))
            loss, stats = dflash_loss(hid, head_w, batch.labels.to(device), batch.weights.to(device), subset,
                                      cfg.kd_weight, batch.teacher_ids, batch.teacher_logp, batch.has_teacher)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        step += 1
        dt = time.time() - t0
        elapsed += dt
        if ema is None:
            ema = first = stats["loss"]
        ema = 0.9 * ema + 0.1 * stats["loss"]
        rows = int((batch.weights > 0).sum())
        bar.update(1)
        bar.set_postfix(loss=f"{ema:.3f}", acc1=f"{stats['acc_k1']:.2f}", lr=f"{lr:.1e}", tok_s=f"{rows / dt:.0f}")
        run_steps += 1
        run_step_s += dt
        if cfg.time_budget_s and run_steps == 5:  # measured on this run's steps (fresh or resumed)
            fit = int(step + (cfg.time_budget_s - (time.time() - t_start)) / max(run_step_s / run_steps, 1e-6))
            if fit < total:
                total = max(fit, step + 1)
                bar.total = total
                print(f"\n[train] time budget: schedule shortened to {total} steps", flush=True)
        if step % cfg.save_every == 0 or step == total:
            _checkpoint(model, opt, dcfg, out, step, total, elapsed, gen, origin)
        if cfg.eval_every and step % cfg.eval_every == 0 and step < total and eval_recs:
            _evaluate(model, embed_w, head_w, eval_recs, cfg.eval_budget, step)
    bar.close()
    _checkpoint(model, opt, dcfg, out, step, total, elapsed, gen, origin)
    result = _evaluate(model, embed_w, head_w, eval_recs, cfg.eval_budget, step) if eval_recs else {}
    result.update(steps=step, train_seconds=elapsed, loss_ema=ema if ema is not None else float("nan"),
                  loss_first=first)
    (out / "eval.json").write_text(json.dumps(result, indent=2))
    return result


def _check_resume_origin(state: dict, init: str, state_path: Path) -> None:
    """Resuming wins over ``--init-drafter``: rerunning the command that started from ``init`` resumes (the
    flag is ignored); a run that did not start from ``init`` refuses it rather than silently continuing."""
    if state.get("init_drafter") != init:
        started = state.get("init_drafter") or "random weights"
        raise ValueError(f"{state_path} exists (step {state['step']}, started from {started}): resuming wins over "
                         f"--init-drafter {init}; drop --init-drafter to resume, or pass a new --out to start "
                         "from that drafter")
    print(f"[train] --init-drafter ignored: resuming {state_path} (this run started from {init})", flush=True)


def _checkpoint(model, opt, dcfg, out: Path, step: int, total: int, elapsed: float, gen: torch.Generator,
                origin: str | None = None) -> None:
    save_drafter(model, dcfg, out)
    st = {"model": model.state_dict(), "optim": opt.state_dict(), "step": step, "total": total, "elapsed": elapsed,
          "gen": gen.get_state(), "init_drafter": origin}
    tmp = out / "trainer_state.tmp"
    torch.save(st, tmp)
    tmp.replace(out / "trainer_state.pt")


def _evaluate(model, embed_w, head_w, recs, budget: int, step: int) -> dict[str, float]:
    model.eval()
    res = offline_acceptance(model, embed_w, head_w, recs, budget)
    model.train()
    depth = " ".join(f"{res[k]:.2f}" for k in sorted(k for k in res if k.startswith("acc_d")))
    print(f"\n[eval] step {step}: tau chain {res['tau_chain']:.3f}, ddtree@{budget} {res['tau_ddtree']:.3f}; "
          f"top-1 acc by depth {depth}", flush=True)
    return res
