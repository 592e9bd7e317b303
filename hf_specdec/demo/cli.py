"""``hf-specdec demo``: the command-line options and entry point of the Gradio demo (gradio is imported only once
the demo starts, so the rest of the command line works without the ``demo`` extra).

    hf-specdec demo                                   # http://127.0.0.1:7860
    hf-specdec demo --host 0.0.0.0 --port 8000 --concurrency 8
    hf-specdec demo --model ./my-model                # your own model (prompt lookup: the heads are the default's)
    hf-specdec demo --dtype bfloat16                  # the default model in bf16 (vanilla in bf16 too)
    python -m hf_specdec.demo ...                     # the same without the console script
    python demo/app.py ...                            # the same, Spaces-style
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

from ..cli_args import (
    UsageError,
    add_device_argument,
    add_dtype_argument,
    add_model_argument,
    add_threads_argument,
    check_device_argument,
    check_model_argument,
    positive_int,
)
from .options import DEFAULT_CONCURRENCY
from .quiet import startup_quiet


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``hf-specdec demo`` options."""
    parser.add_argument("--host", default=None, help="interface to bind (default 127.0.0.1; 0.0.0.0 for all)")
    parser.add_argument("--port", type=_port, default=None, help="port (default: 7860 or the next free one)")
    parser.add_argument(
        "--share", action="store_true", help="also open a public gradio.live link (needs the internet; off by default)"
    )
    parser.add_argument(
        "--concurrency",
        type=positive_int,
        default=DEFAULT_CONCURRENCY,
        help="requests served at once (default %(default)s)",
    )
    parser.add_argument(
        "--parallel",
        action="store_true",
        help="run the generate() calls of concurrent requests at the same time (default: they take turns, so each "
        "tokens/s is measured on an otherwise idle CPU)",
    )
    parser.add_argument("--no-warmup", action="store_true", help="skip the warm-up run of each method at start")
    add_threads_argument(parser)
    add_model_argument(parser)
    add_device_argument(parser)
    add_dtype_argument(parser)


def _port(text: str) -> int:
    """argparse type: a TCP port, 1 to 65535."""
    value = int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port between 1 and 65535, got {value}")
    return value


def run(args: argparse.Namespace) -> int:
    """Start the demo with parsed `add_arguments` options (blocks until interrupted)."""
    import torch

    from ..cli_args import load_model_argument

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    args.model = check_model_argument(args.model)
    check_device_argument(args.device)
    print("hf-specdec demo: starting (importing gradio)…", flush=True)
    try:
        import gradio  # noqa: F401
    except ModuleNotFoundError as exc:
        raise SystemExit(
            "the hf-specdec demo needs gradio, which is not installed; run `bash scripts/install.sh demo` in an hf-specdec checkout (or pip install gradio)"
        ) from exc
    from .app import launch

    model = tokenizer = None
    dtype = getattr(args, "dtype", "float32")
    if args.model is not None or args.device is not None or dtype != "float32":
        t0 = time.perf_counter()
        print(f"hf-specdec demo: loading {args.model or 'the default model'} ({dtype})…", flush=True)
        with startup_quiet():
            model, tokenizer, _name = load_model_argument(args.model, args.device, dtype)
        print(f"  model loaded in {time.perf_counter() - t0:.1f} s", flush=True)
    launch(
        args.host,
        args.port,
        args.share,
        model=model,
        tokenizer=tokenizer,
        own_model=args.model is not None,
        concurrency=args.concurrency,
        warmup=not args.no_warmup,
        parallel=args.parallel,
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m hf_specdec.demo [--host H] [--port P] [--share] [--concurrency N]``."""
    parser = argparse.ArgumentParser(prog="hf-specdec demo", description="Gradio demo: vanilla vs speculative.")
    add_arguments(parser)
    try:
        return run(parser.parse_args(argv))
    except UsageError as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
