"""The command-line vocabulary shared by the ``hf-specdec`` subcommands, and their argument types and checks.

One vocabulary: a thing has the same flag on every subcommand that has it, spelled as transformers' ``generate()``
argument where there is one (``max_new_tokens`` -> ``--max-new-tokens``): ``--model``, ``--device``, ``--threads``,
``--max-new-tokens``, ``--do-sample``, ``--temperature``, ``--top-p``, ``--seed``. Subcommands add these flags through
the ``add_*_argument(s)`` helpers below, so names, types and help read the same everywhere; an older spelling stays
accepted as a hidden alias (`add_hidden_alias`).

A value that cannot work is refused before any model is loaded, as one ``hf-specdec: error: ...`` line naming the
option, the value and what is expected (exit code 2, argparse's convention): argparse reports the types
(`positive_int`, `non_negative_int`, `int_at_least`, `any_int`, `positive_float`: every number has one) itself, and
`UsageError` carries the checks argparse cannot make alone (combinations, folders) to ``hf_specdec.cli.main``.
Those types and `UsageError` are defined with the trainers' command line (``hf_specdec.training.trainer_cli``, the
lowest layer that has one) and re-exported here.
"""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path

# defined with the trainers' command line (the lowest layer that has one), re-exported here for every subcommand
from .heads.hub import offline_miss
from .training.trainer_cli import CHAT_TEMPLATE_OPTION, load_model_option
from .training.trainer_cli import UsageError as UsageError
from .training.trainer_cli import any_int as any_int
from .training.trainer_cli import check_chat_template_option as check_chat_template_option
from .training.trainer_cli import int_at_least as int_at_least
from .training.trainer_cli import non_negative_int as non_negative_int
from .training.trainer_cli import positive_float as positive_float
from .training.trainer_cli import positive_int as positive_int


# ----------------------------------------------------------------------------------------- the shared flags
def add_hidden_alias(parser: argparse.ArgumentParser, alias: str, dest: str, **kwargs) -> None:
    """Accept ``alias`` (an older spelling) for the option stored in ``dest``, left out of ``--help``."""
    parser.add_argument(alias, dest=dest, help=argparse.SUPPRESS, **kwargs)


def add_model_argument(parser: argparse.ArgumentParser) -> None:
    """``--model``: a local model folder or Hub id instead of the default model (see `load_model_argument`)."""
    parser.add_argument(
        "--model",
        default=None,
        help="a local model folder or Hub id instead of the default model (SmolLM2-135M-Instruct)",
    )


def add_chat_template_argument(parser: argparse.ArgumentParser) -> None:
    """``--chat-template``: a Jinja chat template for the model's tokenizer (checked by `check_chat_template_option`;
    the train commands share the same option)."""
    parser.add_argument("--chat-template", **CHAT_TEMPLATE_OPTION)


def add_device_argument(
    parser: argparse.ArgumentParser, default: str | None = None, what: str = "the model runs"
) -> None:
    """``--device``: where ``what`` (a torch device name: cpu, cuda, cuda:1 ...)."""
    shown = default or "cpu"
    parser.add_argument(
        "--device", default=default, help=f"where {what} (a torch device: cpu, cuda ...; default {shown})"
    )


DTYPES = ("float32", "bfloat16", "float16")


def add_dtype_argument(parser: argparse.ArgumentParser) -> None:
    """``--dtype``: the model's parameter dtype, as transformers' ``from_pretrained(dtype=...)`` (see `torch_dtype`).
    Greedy output is vanilla's bit for bit in float32, and up to near-ties of vanilla's own logits in bfloat16 /
    float16 (docs/precision.md)."""
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default="float32",
        help="the model's dtype (default float32: greedy output is vanilla's bit for bit; bfloat16 / float16: equal "
        "up to near-ties of vanilla's own logits, see docs/precision.md)",
    )


QUANTIZATIONS = ("int8", "int4")


def add_quantization_argument(parser: argparse.ArgumentParser) -> None:
    """``--quantization``: torchao weight-only quantization of the model's linear layers, loaded the transformers way
    (``from_pretrained(quantization_config=TorchAoConfig(...))``; the ``quant`` extra)."""
    parser.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        default=None,
        help="torchao weight-only quantization: int8 (Int8WeightOnlyConfig) or int4 (IntxWeightOnlyConfig, groups of "
        "32); needs the quant extra (default: none; greedy output is vanilla's with the same quantized model)",
    )


def quantization_config(name: str | None):
    """The ``TorchAoConfig`` of a ``--quantization`` value (None: None).

    Raises:
        UsageError: torchao is not installed.
    """
    if name is None:
        return None
    try:
        from torchao.quantization import Int8WeightOnlyConfig, IntxWeightOnlyConfig, PerGroup
    except ImportError as err:
        raise UsageError(f"--quantization {name} needs torchao: pip install -e '.[quant]'") from err
    import torch
    from transformers import TorchAoConfig

    if name == "int8":
        return TorchAoConfig(Int8WeightOnlyConfig())
    return TorchAoConfig(IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32)))


def torch_dtype(name: str | None):
    """The torch dtype of a ``--dtype`` value (None: float32)."""
    import torch

    return getattr(torch, name or "float32")


def add_threads_argument(parser: argparse.ArgumentParser) -> None:
    """``--threads``: torch CPU threads (``hf_specdec.cli.main`` sets them before the subcommand runs)."""
    parser.add_argument(
        "--threads", type=positive_int, default=None, help="torch CPU threads (default: torch's choice)"
    )


def add_max_new_tokens_argument(parser: argparse.ArgumentParser, default: int, what: str = "tokens generated") -> None:
    """``--max-new-tokens``, as transformers' ``max_new_tokens``."""
    parser.add_argument(
        "--max-new-tokens", type=positive_int, default=default, help=f"{what} (default {default}; max_new_tokens)"
    )


def add_sampling_arguments(parser: argparse.ArgumentParser, do_sample_help: str, values: bool = True) -> None:
    """``--do-sample`` (old spelling ``--sample``, hidden), and with ``values`` ``--temperature`` and ``--top-p``, as
    transformers' ``do_sample``, ``temperature`` and ``top_p``; `check_sampling_arguments` checks them together."""
    parser.add_argument("--do-sample", action="store_true", help=do_sample_help)
    add_hidden_alias(parser, "--sample", "do_sample", action="store_true")
    if values:
        parser.add_argument(
            "--temperature", type=positive_float, default=None, help="sampling temperature > 0 (with --do-sample)"
        )
        parser.add_argument(
            "--top-p", type=positive_float, default=None, help="nucleus sampling top_p in (0, 1] (with --do-sample)"
        )


def check_sampling_arguments(args: argparse.Namespace) -> None:
    """``--temperature`` / ``--top-p`` need ``--do-sample``; top_p is a probability."""
    temperature, top_p = getattr(args, "temperature", None), getattr(args, "top_p", None)
    if not args.do_sample and (temperature is not None or top_p is not None):
        raise UsageError("--temperature and --top-p apply to sampling: add --do-sample")
    if top_p is not None and top_p > 1:
        raise UsageError(f"--top-p is a probability in (0, 1], got {top_p}")


def check_device_argument(device: str | None) -> None:
    """``--device``: a device torch knows and this machine has."""
    if device is None:
        return
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError) as err:
        raise UsageError(f"--device {device}: not a torch device (cpu, cuda, cuda:1 ...)") from err
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {device}: torch sees no CUDA device on this machine")


def check_out_folder(out: str, option: str = "--out", holds: str = "the results") -> None:
    """``--out`` (or another folder option): a folder ``holds`` can be written to, tried by making it and a file in
    it, then removing what the check made, so that a path that cannot hold them fails before any model is loaded."""
    path = Path(out).expanduser()
    if path.exists() and not path.is_dir():
        raise UsageError(f"{option} {out}: a file is there; pass a folder for {holds}")
    made = [p for p in (path, *path.parents) if not p.exists()]  # deepest first
    probe = path / ".hf-specdec-write-check"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
    except OSError as err:
        raise UsageError(
            f"{option} {out}: cannot create that folder or write in it ({err.strerror or err}); pass a folder you "
            "can write to"
        ) from err
    finally:
        for p in (probe, *made):
            with contextlib.suppress(OSError):
                p.rmdir() if p.is_dir() else p.unlink()


def missing_folders(out: str) -> list[Path]:
    """The folders of ``out`` (itself, then its parents) that do not exist yet, deepest first: what a run writing
    there will have made."""
    path = Path(out).expanduser()
    return [p for p in (path, *path.parents) if not p.exists()]


def check_model_argument(name: str | None) -> str | None:
    """``--model``: a path that looks like a folder must exist (else transformers reports a Hub repo-id error); a Hub
    id while the Hub is switched off (``HF_HUB_OFFLINE``) must be in the local cache. Returns the name to load: a
    ``.gguf`` file becomes its converted safetensors folder (`models.gguf_model_dir`, converted once), any other name
    is returned as given."""
    if name is None:
        return None
    from .models import gguf_model_dir, is_gguf_file

    if is_gguf_file(name):
        return str(gguf_model_dir(name))
    path = Path(name).expanduser()
    looks_local = path.is_absolute() or name.startswith((".", "~")) or name.count("/") > 1  # Hub ids: org/name
    if looks_local and not path.is_dir():
        raise UsageError(f"--model {name}: no such folder or .gguf file (pass a local model folder, a .gguf file or "
                         "a Hub id like org/name)")
    not_cached = None if path.is_dir() else offline_miss(name)
    if not_cached:
        raise UsageError(f"--model {name}: {not_cached}")
    return name


def load_model_argument(
    name: str | None,
    device: str | None = None,
    dtype: str | None = None,
    quantization: str | None = None,
    chat_template: str | None = None,
):
    """``(model, tokenizer, name)`` of ``--model`` (`models.load_causal_lm`: in ``--dtype``, fp32 by default, eval
    mode, on ``--device``, weight-only quantized as ``--quantization`` asks), or of the default model when None;
    ``--chat-template`` set on the tokenizer when given.

    Raises:
        UsageError: transformers cannot load ``name`` (`load_model_option`).
    """
    name = check_model_argument(name)
    config = quantization_config(quantization)
    extra = {} if config is None else {"quantization_config": config}
    return load_model_option(name, device, chat_template, dtype=torch_dtype(dtype), **extra)


def check_draft_layers(draft_layers: int, model) -> None:
    """``--draft-layers``: a layer-skip draft keeps fewer decoder layers than ``model`` has."""
    layers = model.config.num_hidden_layers
    if draft_layers >= layers:
        raise UsageError(f"--draft-layers {draft_layers}: the model has {layers} layers; pass 1..{layers - 1}")
