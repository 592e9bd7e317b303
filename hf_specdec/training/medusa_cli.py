"""``hf-specdec train medusa``: self-distillation data from the target (`build_default_data`, or ``--data``), Medusa-1
heads trained on it (`train_medusa`) and their tree chosen from held-out acceptance and this machine's verify cost
(`tune_and_save_tree`). The defaults are the recipe of the heads shipped in the package: under an hour on 2 CPU
cores, end to end.

    hf-specdec train medusa --out DIR [--model M --num-prompts N --max-new-tokens M --epochs E --num-heads 4 --resume]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .default_data import build_default_data
from .medusa import MedusaTrainingConfig, train_medusa
from .medusa_tree import tune_and_save_tree
from .shards import load_distillation_data
from .trainer_cli import TrainerCommand, load_target, non_negative_int, positive_float, positive_int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``hf-specdec train medusa`` besides the shared ones: the data build, then the heads."""
    parser.add_argument("--num-prompts", type=positive_int, default=960, help="generated prompts (default 960)")
    parser.add_argument(
        "--num-context-prompts",
        type=non_negative_int,
        default=640,
        help="stage-2 prompts: tasks over the model's own stage-1 answers (summarise, answer, translate back...; "
        "default 640; 0: none)",
    )
    parser.add_argument(
        "--max-new-tokens", type=positive_int, default=128, help="answer length cap (default 128; max_new_tokens)"
    )
    parser.add_argument(
        "--gen-batch-size", type=positive_int, default=32, help="prompts per generate call (default 32)"
    )
    parser.add_argument(
        "--do-sample", action="store_true", help="sample the answers (T=0.7, top-p 0.9) instead of greedy"
    )
    parser.add_argument("--sample", dest="do_sample", action="store_true", help=argparse.SUPPRESS)  # older spelling
    parser.add_argument(
        "--prompt-seed", type=non_negative_int, default=0, help="seed of the prompt set and sampling (default 0)"
    )
    _add_head_arguments(parser)


def _add_head_arguments(parser: argparse.ArgumentParser) -> None:
    """The heads' shape, schedule and outputs."""
    parser.add_argument("--num-heads", type=positive_int, default=4, help="Medusa heads (default 4)")
    parser.add_argument("--num-layers", type=positive_int, default=1, help="ResBlocks per head (default 1)")
    parser.add_argument("--own-lm-heads", action="store_true", help="per-head lm_heads instead of the shared base one")
    parser.add_argument("--lr", type=positive_float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    parser.add_argument("--positions-per-step", type=positive_int, default=256, help="positions per step (default 256)")
    parser.add_argument("--distill", choices=("hard", "soft"), default="hard", help="target tokens or distribution")
    parser.add_argument(
        "--loss-vocab",
        type=non_negative_int,
        default=8192,
        help="train over the N most frequent answer tokens only (default 8192; 0: the full vocabulary)",
    )
    parser.add_argument(
        "--draft-vocab",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="draft over the loss vocabulary only, as trained (default: yes)",
    )
    parser.add_argument(
        "--no-tune-tree",
        action="store_true",
        help="skip choosing the tree from held-out acceptance and this machine's measured verify cost",
    )
    parser.add_argument(
        "--checkpoint-every",
        type=non_negative_int,
        default=200,
        help="steps between checkpoints (default 200; 0: only at the end)",
    )
    parser.add_argument(
        "--eval-every", type=non_negative_int, default=0, help="steps between held-out evaluations (0: at the end)"
    )


def _config(args: argparse.Namespace) -> MedusaTrainingConfig:
    """The `MedusaTrainingConfig` of the options."""
    return MedusaTrainingConfig(
        num_heads=args.num_heads,
        num_layers=args.num_layers,
        share_lm_head=not args.own_lm_heads,
        epochs=args.epochs,
        max_steps=args.max_steps,
        positions_per_step=args.positions_per_step,
        lr=args.lr,
        distill=args.distill,
        loss_vocab=args.loss_vocab or None,
        draft_vocab=bool(args.draft_vocab and args.loss_vocab),
        checkpoint_every=args.checkpoint_every,
        eval_every=args.eval_every,
        mixed_precision=args.mixed_precision,
    )


def main(args: argparse.Namespace) -> int:
    """``hf-specdec train medusa``: self-distillation data from the target (the default model unless ``--model``),
    or ``--data``; then Medusa-1 heads, their tree (unless ``--no-tune-tree``), all saved in ``--out``."""
    out = Path(args.out)
    data_dir = Path(args.data_dir) if args.data_dir else out / "data"
    t0 = time.perf_counter()
    model, tokenizer, model_name = load_target(args, args.device)
    print(
        f"[{model_name} loaded in {time.perf_counter() - t0:.1f} s; data: {args.data or [data_dir]}]", file=sys.stderr
    )
    if args.data:
        folders = [Path(f) for f in args.data]
    else:
        folders = build_default_data(
            model,
            tokenizer,
            data_dir,
            num_prompts=args.num_prompts,
            num_context_prompts=args.num_context_prompts,
            seed=args.prompt_seed,
            max_new_tokens=args.max_new_tokens,
            batch_size=args.gen_batch_size,
            do_sample=args.do_sample,
            base_model_name=model_name,
        )
    data = load_distillation_data(folders, max_tokens=args.data_tokens)
    print(f"[data: {data.manifest['num_sequences']} answers, {data.manifest['num_tokens']} tokens]", file=sys.stderr)
    config = _config(args)
    cpu = None if args.device is None else args.device == "cpu"  # None: accelerate's choice
    heads, report = train_medusa(
        data, out, model.get_output_embeddings(), config, resume=args.resume, base_model_name_or_path=model_name,
        cpu=cpu,
    )  # fmt: skip
    held = report["held_out"] or {}
    if not args.no_tune_tree:
        tuning = tune_and_save_tree(heads, data, out, model, config, report)
        print(tuning.markdown(), file=sys.stderr)
    print(
        f"[{report['steps']} steps in {report['training_time_s']:.0f} s; held-out top-1 per head "
        f"{held.get('top1_per_head')}; heads saved to {out}]",
        file=sys.stderr,
    )
    return 0


MEDUSA_COMMAND = TrainerCommand(
    "medusa", "Medusa-1 heads by self-distillation (base model frozen)", add_arguments, main,
    precisions=("no", "bf16", "fp16"),
)

__all__ = ["MEDUSA_COMMAND", "add_arguments", "main"]
