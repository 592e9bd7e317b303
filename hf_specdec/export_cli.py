"""``hf-specdec export``: write a head in the layout a serving engine loads, with a model card that says how.

    hf-specdec export eagle --format eagle --out eagle-sglang          # the shipped EAGLE head, for SGLang
    hf-specdec export runs/eagle3 --format speculators --out spec --model meta-llama/Llama-3.1-8B-Instruct
    hf-specdec export medusa --format medusa --out medusa-vllm --verifier HuggingFaceTB/SmolLM2-135M-Instruct

HEAD is a head folder or Hub repo id in any layout hf-specdec reads (docs/formats.md; ``--format speculators`` takes
an EAGLE-3 head or a DFlash block drafter), or the name of a head that ships with hf-specdec (``eagle``,
``medusa``, ``dflash``). The head is loaded, bound to its target model (``--model``; default: the default model), which checks
that their sizes fit and records what the exported config names (the target's architectures; Medusa's vLLM layout
also stores a copy of the target's lm_head), then saved with ``save_pretrained(format=...)``. The exported folder
loads back into hf-specdec unchanged. The export names its verifier, the target an engine loads beside the head:
``--verifier``, else the name the target was loaded under when that is an existing folder or a Hub id (a bare name,
such as a shipped head's ``SmolLM2-135M-Instruct``, no engine could load: it is refused, naming ``--verifier``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .cli_args import UsageError, check_model_argument, positive_int
from .heads.checks import is_model_reference
from .heads.hub import base_model_name
from .kinds import HEAD_KINDS, HeadKind


def export_formats() -> dict[str, list[HeadKind]]:
    """Export format -> the head kinds written in it, in `HEAD_KINDS` order (each head class's ``export_formats``
    beyond its own ``hf-specdec``)."""
    formats: dict[str, list[HeadKind]] = {}
    for kind in HEAD_KINDS.values():
        for fmt in getattr(kind.load("head"), "export_formats", ()):  # none for a model's own layers (MTP)
            if fmt != "hf-specdec":
                formats.setdefault(fmt, []).append(kind)
    return formats


def add_arguments(parser: argparse.ArgumentParser) -> None:
    formats = export_formats()
    shipped = [kind.name for kind in HEAD_KINDS.values() if kind.shipped and any(kind in k for k in formats.values())]
    parser.add_argument("head", help="head folder or Hub repo id (any layout hf-specdec reads), or a shipped head: "
                        f"{', '.join(shipped)}")  # fmt: skip
    parser.add_argument(
        "--format",
        required=True,
        choices=list(formats),
        help="speculators: vLLM's speculators format (EAGLE-3 heads, DFlash drafters; `vllm serve DIR`); eagle: the "
        "upstream "
        "EAGLE / SpecForge layout (SGLang, vLLM); medusa: vLLM's Medusa layout",
    )
    parser.add_argument("--out", required=True, help="the folder to write (created; files in it are replaced)")
    parser.add_argument(
        "--model", default=None, help="the target model (folder or Hub id) the head drafts for (default: the default "
        "model)"
    )  # fmt: skip
    parser.add_argument(
        "--verifier",
        default=None,
        help="the target's name written into the export (a Hub id such as HuggingFaceTB/SmolLM2-135M-Instruct, or a "
        "folder the engine can read; default: the name the target was loaded under (--model, or the default model's "
        "converted folder) when it is an existing folder or a Hub id)",
    )
    parser.add_argument(
        "--repo-id",
        default=None,
        help="the Hub repo id the folder will be published as, for the model card's command lines (default: --out)",
    )
    parser.add_argument(
        "--speculative-tokens", type=positive_int, default=None,
        help="EAGLE: tokens drafted per step, written as the tree depth (speculators' speculative_tokens)",
    )  # fmt: skip


def _head_source(head: str, kinds: list[HeadKind], fmt: str) -> str:
    """A shipped head's folder for its name, else ``head`` itself; ``kinds``: those written in ``fmt``."""
    shipped = HEAD_KINDS.get(head)
    if shipped is None or shipped.shipped is None or Path(head).exists():
        return head
    if shipped not in kinds:
        raise UsageError(f"--format {fmt} writes {' or '.join(k.title for k in kinds)}s, but {head!r} is the shipped "
                         f"{shipped.title}")  # fmt: skip
    folder = shipped.shipped_dir()
    if not (folder / "config.json").is_file():
        raise UsageError(f"the shipped {shipped.title} is missing from this install ({folder})")
    return str(folder)


def _load_target(name: str | None):
    """``(model, name)``: ``--model`` (fp32; no tokenizer needed), or the default model when None."""
    import torch
    from transformers import AutoModelForCausalLM

    from .models import DEFAULT_MODEL_NAME, load_default_model

    if name is None:
        return load_default_model()[0], DEFAULT_MODEL_NAME
    check_model_argument(name)
    try:
        return AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32).eval(), name
    except OSError as err:  # transformers' "not a local folder nor a Hub repo" / offline messages
        raise UsageError(f"--model {name}: {str(err).splitlines()[0]}") from err


def _load_head(args: argparse.Namespace):
    """The head ``HEAD`` names, as the class of a kind written in ``--format`` (speculators: an EAGLE head, else a
    DFlash block drafter); a head none of them reads is a `UsageError` giving each one's reason."""
    kinds = export_formats()[args.format]
    source = _head_source(args.head, kinds, args.format)
    classes = [kind.load("head") for kind in kinds]
    errors = []
    for head_class in classes:
        try:
            return head_class.from_pretrained(source, dtype=None)
        except (OSError, ValueError) as err:
            errors.append(f"{head_class.__name__}: {err}" if len(classes) > 1 else str(err))
    names = " or ".join(c.__name__ for c in classes)
    raise UsageError(f"cannot load {args.head} as {names}: {'; '.join(errors)}")


def _check_verifier_option(verifier: str | None) -> None:
    """``--verifier``, when given: a name an engine can load the target from (a Hub id or a folder)."""
    if verifier is not None and not is_model_reference(verifier):
        raise UsageError(f"--verifier {verifier}: neither an existing folder nor a Hub id (owner/name); pass the "
                         "target's Hub id (e.g. HuggingFaceTB/SmolLM2-135M-Instruct) or its folder")  # fmt: skip


def _verifier(args: argparse.Namespace, model) -> str:
    """The verifier the export names: ``--verifier``, else the name the target was loaded under when it is an
    existing folder (made absolute) or a Hub id; a bare name (``SmolLM2-135M-Instruct``) is refused, naming
    ``--verifier``."""
    if args.verifier is not None:
        return args.verifier
    name = base_model_name(model)
    if not is_model_reference(name):
        raise UsageError(f"--verifier: the target was loaded as {name!r}, neither an existing folder nor a Hub id "
                         "(owner/name), so the export cannot name it for an engine; pass --verifier with the "
                         "target's Hub id or folder")  # fmt: skip
    return str(Path(name).resolve()) if Path(name).is_dir() else name


def _tree_depth(head, tokens: int | None) -> None:
    """``--speculative-tokens``: an EAGLE head's tree depth; a DFlash head's is its block's (refused otherwise)."""
    if tokens is None:
        return
    if head.head_type == "dflash":
        if tokens != head.num_depths:
            raise UsageError(f"--speculative-tokens {tokens}: a DFlash head drafts its block's {head.num_depths} "
                             "tokens per step (block_size - 1); leave the option out")  # fmt: skip
        return
    head.tree = {**getattr(head, "tree", {}), "depth": tokens}


def export_main(args: argparse.Namespace) -> int:
    """Load the head and its target, bind them, save the export and print what was written and how to serve it."""
    import torch

    args.model = check_model_argument(args.model)
    _check_verifier_option(args.verifier)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file, not a folder")
    head = _load_head(args)
    model, name = _load_target(args.model)
    verifier = _verifier(args, model)
    try:
        head.bind(model)
    except ValueError as err:
        raise UsageError(str(err)) from err
    head.base_model_name_or_path = verifier
    _tree_depth(head, args.speculative_tokens)
    with torch.no_grad():
        try:
            card = {"repo_id": args.repo_id or str(out.resolve())}
            head.save_pretrained(out, format=args.format, model_card_kwargs=card)
        except ValueError as err:
            raise UsageError(f"--format {args.format}: {err}") from err
    written = ", ".join(sorted(p.name for p in out.iterdir()))
    print(f"wrote {out} ({written}): {type(head).__name__} for {name} in the {args.format} format", file=sys.stderr)
    card = (out / "README.md").read_text(encoding="utf-8")
    start = card.find("## Serve with")
    print(card[start : card.rfind("Written by")].strip() if start >= 0 else card)
    return 0
