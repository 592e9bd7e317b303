"""The ``hf-specdec`` command line.

hf-specdec generate "Explain speculative decoding."       # stream an answer, print tokens/s and τ
hf-specdec generate "..." --assistant medusa            # any of hf_specdec.assistants.available_assistants()
hf-specdec generate "..." --assistant draft --draft-layers 8 --do-sample --temperature 0.7 --top-p 0.9
hf-specdec bench [--full] [--methods ...] [--per-category N] [--batch 4] [--do-sample] [--out DIR] [--workload agentic]
hf-specdec eval-heads [--heads eagle,medusa,mlp_speculator] [--head-dir NAME=FOLDER]   # top-1 on bench answers
hf-specdec convert                                       # convert the default model now, print its folder
hf-specdec train medusa --out DIR [--model M --num-prompts N --max-new-tokens M --epochs E --num-heads 4 --resume]
hf-specdec train mlp-speculator --out DIR [--data FOLDER... --epochs E --inner-dim 384 --resume]
hf-specdec train eagle --out DIR [--version 3] [--model M --data sharegpt --soft-labels --unroll K --resume ...]
hf-specdec train dflash --out DIR [--model M --data sharegpt --block-size 8 --num-layers 1 --resume ...]
hf-specdec export HEAD --format speculators|eagle|medusa --out DIR [--model M --verifier NAME]   # for vLLM / SGLang
hf-specdec demo [--host H] [--port P] [--share] [--concurrency N] [--parallel]   # Gradio demo, http://127.0.0.1:7860
hf-specdec --version

The flags every subcommand shares are spelled once, as transformers' generate() arguments (`cli_args`):
--model, --device, --dtype, --threads, --max-new-tokens, --do-sample, --temperature, --top-p, --seed.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from .assistants import DEFAULT_ASSISTANT, available_assistants, describe_assistant
from .cli_args import (
    UsageError,
    add_device_argument,
    add_dtype_argument,
    add_max_new_tokens_argument,
    add_model_argument,
    add_quantization_argument,
    add_sampling_arguments,
    add_threads_argument,
    check_device_argument,
    check_draft_layers,
    check_model_argument,
    check_out_folder,
    check_sampling_arguments,
    load_model_argument,
    missing_folders,
    non_negative_int,
    positive_float,
    positive_int,
)
from .demo.cli import add_arguments as add_demo_arguments
from .demo.cli import run as run_demo

# besides the ready-made assistants: a draft model built from the target's layers, and vanilla generate
OTHER_ASSISTANTS = {"draft": "a layer-skip draft model (--draft-layers)", "none": "vanilla generate (no assistant)"}


def _add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("question", help="the user message (one chat turn)")
    ready_made = {name: describe_assistant(name) for name in available_assistants()}
    choices = {**ready_made, **OTHER_ASSISTANTS}
    parser.add_argument(
        "--assistant",
        choices=list(choices),
        default=DEFAULT_ASSISTANT,
        help="; ".join(f"{name}: {text}" for name, text in choices.items())
        + " (ready-made ones are for the default model; default %(default)s)",
    )
    add_max_new_tokens_argument(parser, 256, "most tokens to generate")
    parser.add_argument(
        "--draft-layers", type=positive_int, default=8, help="layers of the layer-skip draft (default 8)"
    )
    add_sampling_arguments(parser, "sample instead of greedy decoding")
    parser.add_argument("--system", default=None, help="system message (default: the chat template's)")
    parser.add_argument("--seed", type=int, default=None, help="torch.manual_seed before generating")
    add_threads_argument(parser)
    add_model_argument(parser)
    add_device_argument(parser)
    add_dtype_argument(parser)
    add_quantization_argument(parser)


def _check_generate_arguments(args: argparse.Namespace) -> None:
    """What argparse cannot check alone (an empty message, combinations, the model folder, the device)."""
    if not args.question.strip():
        raise UsageError('the question is empty: pass a message for the model, e.g. hf-specdec generate "Hi!"')
    check_sampling_arguments(args)
    check_model_argument(args.model)
    check_device_argument(args.device)


def generate_main(args: argparse.Namespace) -> int:
    """``hf-specdec generate``: stream one answer with an assistant and report tokens/s and τ on stderr."""
    import torch
    from transformers import TextStreamer

    import hf_specdec

    from .bench.spec_bench import count_new_tokens
    from .models import chat_prompt_ids, draft_model_from_layers

    _check_generate_arguments(args)
    t0 = time.perf_counter()
    model, tokenizer, name = load_model_argument(args.model, args.device, args.dtype, args.quantization)
    kwargs: dict = {"max_new_tokens": args.max_new_tokens, "return_dict_in_generate": True}
    if args.assistant not in OTHER_ASSISTANTS:
        kwargs["assistant"] = hf_specdec.load_default_assistant(args.assistant)  # checked against the model
    elif args.assistant == "draft":
        check_draft_layers(args.draft_layers, model)
        kwargs["assistant"] = draft_model_from_layers(model, args.draft_layers)
    if args.do_sample:
        kwargs["do_sample"] = True
        if args.temperature is not None:
            kwargs["temperature"] = args.temperature
        if args.top_p is not None:
            kwargs["top_p"] = args.top_p
    else:
        kwargs["do_sample"] = False
    print(f"[{name} loaded in {time.perf_counter() - t0:.1f} s; assistant: {args.assistant}]", file=sys.stderr)
    ids = chat_prompt_ids(tokenizer, args.question, system=args.system)
    if args.seed is not None:
        torch.manual_seed(args.seed)
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    t0 = time.perf_counter()
    ids = ids.to(model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), streamer=streamer, **kwargs)
    elapsed = time.perf_counter() - t0
    eos = model.generation_config.eos_token_id
    eos_ids = set(torch.as_tensor(eos).reshape(-1).tolist()) if eos is not None else set()
    n = count_new_tokens(out.sequences, ids.shape[1], eos_ids)
    line = f"{n} tokens in {elapsed:.2f} s: {n / elapsed:.1f} tokens/s"
    stats = getattr(out, "spec_stats", None)
    if stats is not None:
        line += f", τ = {stats.tau:.2f} (acceptance {stats.acceptance_rate:.2f}, {stats.steps} target steps)"
    print(f"\n[{line}]", file=sys.stderr)
    return 0


def convert_main(args: argparse.Namespace) -> int:
    """``hf-specdec convert``: convert the default model's GGUF now (if not cached) and print the folder."""
    from .models import default_model_dir

    print(default_model_dir())
    return 0


def _add_train_medusa_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="output folder: heads, training_report.json, data/, checkpoints/")
    add_model_argument(parser)
    add_device_argument(parser, what="the target answers and the heads train (default: the GPU when there is one)")
    parser.add_argument("--data-dir", default=None, help="self-distillation data folder (default OUT/data)")
    parser.add_argument(
        "--data", nargs="+", default=None, help="existing data folder(s) to train on as they are (no build)"
    )
    # the defaults are the recipe of the heads shipped in the package: under an hour on 2 CPU cores, end to end
    parser.add_argument("--num-prompts", type=positive_int, default=960, help="generated prompts (default 960)")
    parser.add_argument(
        "--num-context-prompts",
        type=non_negative_int,
        default=640,
        help="stage-2 prompts: tasks over the model's own stage-1 answers (summarise, answer, translate back...; "
        "default 640; 0: none)",
    )
    add_max_new_tokens_argument(parser, 128, "answer length cap")
    parser.add_argument(
        "--gen-batch-size", type=positive_int, default=32, help="prompts per generate call (default 32)"
    )
    add_sampling_arguments(parser, "sample the answers (T=0.7, top-p 0.9) instead of greedy", values=False)
    parser.add_argument("--prompt-seed", type=int, default=0, help="seed of the prompt set and sampling (default 0)")
    parser.add_argument(
        "--epochs", type=positive_float, default=3.0, help="passes over the training positions (default 3)"
    )
    parser.add_argument("--max-steps", type=positive_int, default=None, help="cap on optimizer steps")
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
    parser.add_argument("--mixed-precision", choices=("no", "bf16", "fp16"), default="no", help="accelerate setting")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in OUT")
    add_threads_argument(parser)


def train_medusa_main(args: argparse.Namespace) -> int:
    """``hf-specdec train medusa``: self-distillation data from the model (the default one unless ``--model``), then
    Medusa-1 heads."""
    from .training import (
        MedusaTrainingConfig,
        build_default_data,
        load_distillation_data,
        train_medusa,
        tune_and_save_tree,
    )

    check_model_argument(args.model)
    check_device_argument(args.device)
    _check_out_folders(args)
    out = Path(args.out)
    data_dir = Path(args.data_dir) if args.data_dir else out / "data"
    t0 = time.perf_counter()
    model, tokenizer, model_name = load_model_argument(args.model, args.device)
    data_dirs = args.data or [data_dir]
    print(f"[{model_name} loaded in {time.perf_counter() - t0:.1f} s; data: {data_dirs}]", file=sys.stderr)
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
    data = load_distillation_data(folders)
    print(f"[data: {data.manifest['num_sequences']} answers, {data.manifest['num_tokens']} tokens]", file=sys.stderr)
    config = MedusaTrainingConfig(
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
    lm_head = model.get_output_embeddings()
    cpu = None if args.device is None else args.device == "cpu"  # None: accelerate's choice
    heads, report = train_medusa(
        data, out, lm_head, config, resume=args.resume, base_model_name_or_path=model_name, cpu=cpu
    )
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


_BENCH_WORKLOADS = {"spec-bench": "hf_specdec.bench.spec_bench", "agentic": "hf_specdec.bench.agentic"}


def _check_out_folders(args: argparse.Namespace) -> None:
    """``--out`` (and ``--data-dir`` when given) of a training or export command: folders that can be made and
    written, checked before any model is loaded."""
    check_out_folder(args.out, holds="what the command writes")
    if getattr(args, "data_dir", None):
        check_out_folder(args.data_dir, "--data-dir", holds="the self-distillation data")


def _train_mlp_speculator_main(args: argparse.Namespace) -> int:
    from .training import mlp_speculator as train_mlp

    _check_out_folders(args)
    return train_mlp.main(args)


def _export_main(args: argparse.Namespace) -> int:
    from . import export_cli

    _check_out_folders(args)
    return export_cli.export_main(args)


def _train_eagle_main(args: argparse.Namespace) -> int:
    """``train eagle``: ``--init-head shipped`` names the package's EAGLE head folder, then the trainer runs."""
    from .assistants import EAGLE
    from .training import eagle_cli

    _check_out_folders(args)
    if args.init_head == "shipped":
        args.init_head = str(EAGLE.folder)
    elif args.init_head is not None and not (Path(args.init_head) / "config.json").is_file():
        raise UsageError(f"--init-head {args.init_head}: no saved EagleHead there (config.json); pass one or 'shipped'")
    return eagle_cli.train_eagle_main(args)


def _train_dflash_main(args: argparse.Namespace) -> int:
    from .training import eagle_cli

    _check_out_folders(args)
    return eagle_cli.train_dflash_main(args)


def _add_trainer(train_sub, name: str, what: str, add_arguments: Callable, func: Callable) -> None:
    """``hf-specdec train NAME``: ``what`` is its help (and, capitalised, its description)."""
    parser = train_sub.add_parser(name, help=what, description=what[0].upper() + what[1:] + ".")
    add_arguments(parser)
    add_threads_argument(parser)
    parser.set_defaults(func=func)


def build_parser() -> argparse.ArgumentParser:
    from . import __version__
    from .bench.spec_bench import add_arguments as add_bench_arguments

    parser = argparse.ArgumentParser(
        prog="hf-specdec", description="Speculative decoding with token trees inside transformers' generate()."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    gen = sub.add_parser("generate", help="stream an answer with an assistant; prints tokens/s and τ")
    _add_generate_arguments(gen)
    gen.set_defaults(func=generate_main)
    bench = sub.add_parser("bench", help="Spec-Bench speedups over vanilla generate on the default model")
    add_bench_arguments(bench)
    bench.set_defaults(func=lambda a: __import__(_BENCH_WORKLOADS[a.workload], fromlist=["main"]).main(a))
    heads = sub.add_parser("eval-heads", help="draft heads' top-1 on the target's answers to the bench's questions")
    from .bench import head_eval

    head_eval.add_arguments(heads)
    add_threads_argument(heads)
    heads.set_defaults(func=head_eval.main)
    conv = sub.add_parser("convert", help="convert the default model to safetensors now; print its folder")
    conv.set_defaults(func=convert_main)
    train = sub.add_parser("train", help="train speculative heads for the default model")
    train_sub = train.add_subparsers(dest="head", metavar="HEAD", required=True)
    medusa = train_sub.add_parser("medusa", help="Medusa-1 heads by self-distillation (base model frozen)")
    _add_train_medusa_arguments(medusa)
    medusa.set_defaults(func=train_medusa_main)
    from .training import mlp_speculator as train_mlp

    mlp = train_sub.add_parser("mlp-speculator", help="an MLP speculator (IBM accelerator) by self-distillation")
    train_mlp.add_arguments(mlp)
    mlp.set_defaults(func=_train_mlp_speculator_main)
    from .training import eagle_cli

    what = "an EAGLE head (EAGLE-1/2, or EAGLE-3 with --version 3) on six-task self-distillation data"
    _add_trainer(train_sub, "eagle", what, eagle_cli.add_train_eagle_arguments, _train_eagle_main)
    what = "a DFlash block drafter (anchored blocks, target frozen) on six-task self-distillation data"
    _add_trainer(train_sub, "dflash", what, eagle_cli.add_train_dflash_arguments, _train_dflash_main)
    from . import export_cli

    export = sub.add_parser("export", help="write a head in the layout vLLM or SGLang serves, with a model card")
    export_cli.add_arguments(export)
    export.set_defaults(func=_export_main)
    demo = sub.add_parser(
        "demo", help="Gradio demo: vanilla generate vs speculative decoding side by side (extra: demo)"
    )
    add_demo_arguments(demo)
    demo.set_defaults(func=run_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; a value that cannot work is one ``hf-specdec: error: ...`` line and exit code 2 (argparse's
    convention), not a traceback. Ctrl-C during ``train`` is one line saying what was kept and how to go on (exit
    code 130); an output folder the run made and left empty is removed."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    training = args.command == "train"
    made = missing_folders(args.out) if training else []
    try:
        if getattr(args, "threads", None):  # --threads, the same for every subcommand
            import torch

            torch.set_num_threads(args.threads)
        return int(args.func(args) or 0)
    except UsageError as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    except KeyboardInterrupt:
        if not training:
            raise
        from .training.run import interrupted_summary

        parser.exit(130, f"\n{parser.prog}: {interrupted_summary(args.out, made)}\n")


if __name__ == "__main__":
    sys.exit(main())
