"""``ddtree-serve train-drafter``: train a DFlash drafter (arXiv 2602.06036) for a target model.

Stages (each resumable; rerun the same command to continue): ``data`` (the target answers the prompts
and its hidden states at the drafter's target layers are cached under ``--data-dir``), ``train``
(AdamW, warm-up + cosine, checkpoints in ``--out``), then a held-out evaluation printing tau.
"""

from __future__ import annotations

import argparse
import json
import time

HELP = "train a DFlash drafter for a target model (data generation, training, offline tau)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    p = parser
    p.add_argument("--model-path", default="default", help="target HF directory ('default' = SmolLM2-135M-Instruct)")
    p.add_argument("--out", required=True, help="output drafter directory (z-lab format + trainer_state.pt)")
    p.add_argument("--data-dir", required=True, help="cache of generated responses and target features")
    p.add_argument("--stage", choices=["all", "data", "train"], default="all")
    g = p.add_argument_group("data")
    g.add_argument("--prompts-jsonl", default=None, help="chat prompts (JSONL: messages | prompt | text); "
                   "default: built-in offline prompts (fortunes, jargon, Python docs, templates)")
    g.add_argument("--num-prompts", type=int, default=1200,
                   help="training prompts from --prompts-jsonl or the built-in set (0: none)")
    g.add_argument("--self-prompts", type=int, default=0,
                   help="also this many prompts written by the target itself (Magpie; cached in "
                   "DATA/self_prompts.jsonl; --num-eval more of them are held out)")
    g.add_argument("--self-prompt-temperature", type=float, default=1.0)
    g.add_argument("--num-eval", type=int, default=16, help="held-out prompts (answered greedily)")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--greedy-fraction", type=float, default=0.75, help="share of greedy responses (rest T=1)")
    g.add_argument("--shard-size", type=int, default=48)
    g.add_argument("--feat-dtype", choices=["float16", "bfloat16", "float32"], default="bfloat16")
    g.add_argument("--data-time-budget-min", type=float, default=None, help="stop starting new shards after this")
    g.add_argument("--teacher-topk", type=int, default=32,
                   help="store the target's top-K next-token log-probabilities per response token (~6 bytes x K "
                   "per token) for --kd-weight; 0: not stored")
    d = p.add_argument_group("drafter")
    d.add_argument("--num-layers", type=int, default=1)
    d.add_argument("--block-size", type=int, default=8)
    d.add_argument("--target-layer-ids", default=None, help="comma-separated; default: --init-drafter's, else evenly "
                   "spaced 1..N-3 (within 0..N-1)")
    d.add_argument("--num-target-features", type=int, default=5, help="how many target layers when not given")
    d.add_argument("--mask-token-id", type=int, default=None)
    d.add_argument("--conv-kernel-size", type=int, default=0,
                   help="taps of DFlash2's grouped dynamic causal convolution around each layer's attention and MLP "
                   "(z-lab's DFlash2 uses 2; starts as the identity, so a plain --init-drafter seeds it); 0 = off")
    d.add_argument("--conv-group-size", type=int, default=16,
                   help="channels per dynamic-kernel group of that convolution (must divide the hidden size)")
    d.add_argument("--num-kv-heads", type=int, default=0,
                   help="the drafter's KV heads (0 = the target's; a divisor of its attention heads); more KV heads "
                   "widen what each mask slot reads from the anchor and the context; an --init-drafter with fewer "
                   "seeds it by repeating its KV heads (the same function)")
    d.add_argument("--init-drafter", default=None,
                   help="start from this exported drafter's weights ('default' = the shipped drafter) with a fresh "
                   "optimizer and schedule; it must match --block-size, the data's target layers and the mask token "
                   "(taken from it when --mask-token-id is not given); fewer layers than --num-layers or no "
                   "convolution grows it (added parts start as identities); a --out that already holds "
                   "trainer_state.pt resumes instead")
    t = p.add_argument_group("training")
    t.add_argument("--steps", type=int, default=1000)
    t.add_argument("--batch-size", type=int, default=8, help="sequences per step (0: as many as fit in memory)")
    t.add_argument("--anchors-per-seq", type=int, default=32)
    t.add_argument("--lr", type=float, default=6e-4)
    t.add_argument("--warmup", type=int, default=50)
    t.add_argument("--weight-decay", type=float, default=0.01)
    t.add_argument("--gamma", type=float, default=4.0, help="loss weight exp(-(k-1)/gamma) at block position k")
    t.add_argument("--out-norm-scale", type=float, default=0.1,
                   help="initial drafter final norm = this x the target's final norm weight")
    t.add_argument("--loss-vocab", choices=["full", "corpus"], default="full",
                   help="'corpus': softmax over the tokens present in the data (CPU saver)")
    t.add_argument("--kd-weight", type=float, default=0.0,
                   help="alpha in [0, 1]: loss = (1 - alpha) CE(target token) + alpha soft-CE against the target's "
                   "stored top-K distribution (records without it: CE alone); 0 = hard labels only")
    t.add_argument("--hard-labels", choices=["token", "greedy"], default="token",
                   help="'greedy': the hard label is the target's most probable token at that position (its stored "
                   "top-1, --teacher-topk) instead of the recorded one: sampled responses then teach what a greedy "
                   "verifier accepts")
    t.add_argument("--train-time-budget-min", type=float, default=None, help="shorten the schedule to fit")
    t.add_argument("--save-every", type=int, default=100)
    t.add_argument("--eval-every", type=int, default=0)
    t.add_argument("--eval-budget", type=int, default=16, help="DDTree budget of the offline evaluation")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda[:i]")
    p.add_argument("--seed", type=int, default=0)
    for action in p._actions:  # every option's --help line names its default, as serve's do
        if action.option_strings and action.default is not argparse.SUPPRESS and not action.required \
                and action.dest != "help":
            shown = "none" if action.default is None else action.default
            action.help = f"{action.help + ' ' if action.help else ''}(default: {shown})"


def _layer_ids(args: argparse.Namespace, model_path: str) -> list[int]:
    from ddtree_serve.model_executor.model_config import ModelConfig
    from ddtree_serve.model_executor.models.dflash import default_target_layer_ids

    if args.target_layer_ids:
        return [int(x) for x in args.target_layer_ids.split(",")]
    if args.init_drafter:  # data for a warm start is captured at the starting drafter's layers
        from ddtree_serve.speculative.train.warm_start import init_drafter_config, resolve_init_drafter

        return list(init_drafter_config(resolve_init_drafter(args.init_drafter))["dflash_config"]["target_layer_ids"])
    return default_target_layer_ids(ModelConfig.load(model_path).num_layers, args.num_target_features)


def _self_prompt_data(args: argparse.Namespace, model_path: str, device: str, budget: float | None) -> list:
    """Prompts written by the target (cached), then its answers to them under the shard tag ``self``."""
    from pathlib import Path

    from transformers import AutoTokenizer

    from ddtree_serve.speculative.train.datagen import make_runner
    from ddtree_serve.speculative.train.self_prompts import self_written_prompts

    Path(args.data_dir).mkdir(parents=True, exist_ok=True)
    runner = make_runner(model_path, 48 * 160, device)
    chats = self_written_prompts(runner, AutoTokenizer.from_pretrained(model_path), args.self_prompts + args.num_eval,
                                 Path(args.data_dir) / "self_prompts.jsonl", seed=args.seed,
                                 temperature=args.self_prompt_temperature)
    del runner
    return _answer(args, model_path, device, chats, budget, "self")


def _answer(args: argparse.Namespace, model_path: str, device: str, chats: list, budget: float | None,
            tag: str = "") -> list:
    """The target answers ``chats`` (the first ``--num-eval`` held out) into shards tagged ``tag``."""
    from ddtree_serve.speculative.train.datagen import generate_dataset

    if len(chats) <= args.num_eval:
        raise ValueError(f"need more than --num-eval={args.num_eval} prompts, got {len(chats)}")
    return generate_dataset(model_path, chats[args.num_eval:], chats[:args.num_eval], args.data_dir,
                            _layer_ids(args, model_path), max_tokens=args.max_new_tokens,
                            greedy_fraction=args.greedy_fraction, shard_size=args.shard_size, seed=args.seed,
                            feat_dtype=args.feat_dtype, device=device, time_budget_s=budget, shard_tag=tag,
                            teacher_topk=args.teacher_topk)


def run(args: argparse.Namespace) -> int:
    from ddtree_serve.server.startup import resolve_model_path
    from ddtree_serve.speculative.train.trainer import TrainConfig, pick_device, train

    model_path = resolve_model_path(args.model_path)
    device = str(pick_device(args.device))
    if args.stage in ("all", "data"):
        from ddtree_serve.speculative.train.prompts import builtin_prompts, load_jsonl_prompts

        t0, files = time.time(), []
        budget = args.data_time_budget_min * 60 if args.data_time_budget_min else None
        if args.num_prompts > 0:
            total = args.num_prompts + args.num_eval
            chats = (load_jsonl_prompts(args.prompts_jsonl, total) if args.prompts_jsonl
                     else builtin_prompts(total, args.seed))
            files = _answer(args, model_path, device, chats, budget)
        if args.self_prompts > 0:
            left = None if budget is None else max(budget - (time.time() - t0), 0.0)
            files = _self_prompt_data(args, model_path, device, left)
        print(f"[train-drafter] data: {len(files)} shard files under {args.data_dir}/feat", flush=True)
    if args.stage in ("all", "train"):
        cfg = TrainConfig(
            data_dir=args.data_dir, out_dir=args.out, target_path=model_path, num_layers=args.num_layers,
            block_size=args.block_size, mask_token_id=args.mask_token_id, steps=args.steps,
            batch_size=args.batch_size, anchors_per_seq=args.anchors_per_seq, lr=args.lr, warmup=args.warmup,
            weight_decay=args.weight_decay, gamma=args.gamma, out_norm_scale=args.out_norm_scale,
            loss_vocab=args.loss_vocab, kd_weight=args.kd_weight, hard_labels=args.hard_labels, seed=args.seed,
            init_drafter=args.init_drafter,
            conv_kernel_size=args.conv_kernel_size, conv_group_size=args.conv_group_size,
            num_kv_heads=args.num_kv_heads, device=device, save_every=args.save_every, eval_every=args.eval_every,
            eval_budget=args.eval_budget,
            time_budget_s=args.train_time_budget_min * 60 if args.train_time_budget_min else None,
        )
        result = train(cfg)
        print("[train-drafter] " + json.dumps(result), flush=True)
    return 0
