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
hf-specdec tune --model FOLDER_OR_ID --out DIR [--budget-minutes 30 --kind eagle --data sharegpt|FILE.json]
hf-specdec export HEAD --format speculators|eagle|medusa --out DIR [--model M --verifier NAME]   # for vLLM / SGLang
hf-specdec demo [--host H] [--port P] [--share] [--concurrency N] [--parallel]   # Gradio demo, http://127.0.0.1:7860
hf-specdec --version

The flags every subcommand shares are spelled once, as transformers' generate() arguments (`cli_args`):
--model, --device, --dtype, --threads, --max-new-tokens, --do-sample, --temperature, --top-p, --seed. The ``train``
commands are the `TrainerCommand`s of the head kinds (``hf_specdec.training.trainer_commands()``), each built by
`add_trainer_arguments` (the options every trainer shares, then the kind's own) and run by `run_trainer`.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Sequence

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
    check_chat_template_option,
    check_device_argument,
    check_draft_layers,
    check_model_argument,
    check_out_folder,
    check_sampling_arguments,
    load_model_argument,
    missing_folders,
    non_negative_int,
    positive_int,
)
from .demo.cli import add_arguments as add_demo_arguments
from .demo.cli import run as run_demo
from .training import TrainerCommand, add_trainer_arguments, trainer_commands

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
    parser.add_argument("--seed", type=non_negative_int, default=None, help="torch.manual_seed before generating")
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
    args.model = check_model_argument(args.model)
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


def build_kernels_main(args: argparse.Namespace) -> int:
    """``hf-specdec build-kernels``: compile the few-rows CPU GEMM for this machine (once; later calls find it)."""
    import time

    from .generation.packed_linears import build_cpu_kernels, kernel_folder

    print(
        f"building the few-rows CPU GEMM into {kernel_folder()} (about a minute, once per machine)...", file=sys.stderr
    )
    start = time.perf_counter()
    try:
        build_cpu_kernels(verbose=args.verbose)
    except RuntimeError as err:
        print(f"hf-specdec: not built: {err}; verify forwards keep MKL's kernels", file=sys.stderr)
        return 1
    print(f"built and loaded in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return 0


_BENCH_WORKLOADS = {"spec-bench": "hf_specdec.bench.spec_bench", "agentic": "hf_specdec.bench.agentic"}


def _check_out_folders(args: argparse.Namespace) -> None:
    """``--out`` (and ``--data-dir`` when given) of a training or export command: folders that can be made and
    written, checked before any model is loaded."""
    check_out_folder(args.out, holds="what the command writes")
    if getattr(args, "data_dir", None):
        check_out_folder(args.data_dir, "--data-dir", holds="the self-distillation data")


def _export_main(args: argparse.Namespace) -> int:
    from . import export_cli

    _check_out_folders(args)
    return export_cli.export_main(args)


def run_trainer(command: TrainerCommand, args: argparse.Namespace) -> int:
    """``hf-specdec train <kind>``: the shared values checked (``--out`` / ``--data-dir`` folders, ``--model``,
    ``--device``, ``--chat-template`` with the model's tokenizer), then the kind's own (``command.check``), all
    before any model is loaded; then its main."""
    _check_out_folders(args)
    args.model = check_model_argument(args.model)
    check_device_argument(args.device)
    check_chat_template_option(args)
    command.check(args)
    return command.main(args)


def _add_train_commands(sub) -> None:
    """``hf-specdec train <kind>``, one per trained head kind (`trainer_commands`), each built the one way
    (`add_trainer_arguments`: the shared options, then the kind's)."""
    train = sub.add_parser("train", help="train speculative heads for the default model")
    train_sub = train.add_subparsers(dest="head", metavar="HEAD", required=True)
    for command in trainer_commands():
        parser = train_sub.add_parser(command.name, help=command.help, description=command.description)
        add_trainer_arguments(parser, command)
        parser.set_defaults(func=functools.partial(run_trainer, command), trainer=command)


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
    kernels = sub.add_parser(
        "build-kernels", help="compile the CPU GEMM that verify forwards of a few rows run where it is faster"
    )
    kernels.add_argument("--verbose", action="store_true", help="show the compiler's output")
    kernels.set_defaults(func=build_kernels_main)
    _add_train_commands(sub)
    from . import tune

    tuner = sub.add_parser("tune", help="bench, train and pick the fastest assistant for your model on this machine")
    tune.add_arguments(tuner)
    tuner.set_defaults(func=tune.main)
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
