"""A layer-skip draft three ways, interleaved with vanilla ``generate`` in one process (issue 68): hf_specdec's
``DraftModelAssistant`` with ``draft_model_from_layers(model, k)``, transformers' ``assistant_model=`` with the same
draft, and transformers' own self-speculation ``assistant_early_exit=k`` (LayerSkip: the model's first k layers and
its lm_head draft, no second model). The same Spec-Bench sample as ``hf-specdec bench`` (one question per category),
greedy, process CPU time, one torch thread; the report is the bench's (results.md / .json / .png in ``--out``).

    python benchmarks/early_exit.py --model gemma-3-270m-q4_k_m.gguf --layers 6 --out /tmp/early_exit
"""

from __future__ import annotations

import argparse
import time

import torch

import hf_specdec  # noqa: F401  (registers assistant=)
from hf_specdec.bench.methods import Method
from hf_specdec.bench.questions import load_questions, sample_questions
from hf_specdec.bench.report import write_results
from hf_specdec.bench.spec_bench import GREEDY, Setting, build_prompts, run_bench
from hf_specdec.cli_args import load_model_argument
from hf_specdec.generation.proposers.draft_model import DraftModelAssistant
from hf_specdec.models import chat_rendering, draft_model_from_layers
from hf_specdec.training.benchmark_questions import find_questions_file


def methods(layers: int) -> list[Method]:
    return [
        Method("vanilla", "model.generate (the baseline)", lambda ctx: {}),
        Method("draft", f"hf_specdec DraftModelAssistant(draft_model_from_layers(model, {layers}))",
               lambda ctx: {"assistant": DraftModelAssistant(ctx.draft)}, spec_stats=True, needs_draft=True),
        Method("hf-assisted", "transformers assistant_model= the same draft",
               lambda ctx: {"assistant_model": ctx.draft}, needs_draft=True),
        Method("hf-early-exit", f"transformers assistant_early_exit={layers} (LayerSkip self-speculation)",
               lambda ctx: {"assistant_early_exit": layers}),
    ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default=None, help="a model folder, Hub id or .gguf file (default: the default model)"
    )
    parser.add_argument("--layers", type=int, default=6, help="decoder layers of the draft / early exit")
    parser.add_argument("--per-category", type=int, default=1)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--questions", default=None, help="Spec-Bench JSONL (default: the package's)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer, name = load_model_argument(args.model, None, args.dtype)
    questions = sample_questions(load_questions(find_questions_file(args.questions)), args.per_category, args.seed)
    prompts = build_prompts(tokenizer, questions)
    start = time.perf_counter()
    records = run_bench(model, prompts, methods(args.layers), [Setting(GREEDY, {"do_sample": False})],
                        max_new_tokens=args.max_new_tokens, seed=args.seed,
                        draft_factory=lambda: draft_model_from_layers(model, args.layers),
                        log=print, clock=time.process_time)  # fmt: skip
    meta = {
        "model": name, "dtype": args.dtype, "threads": 1, "batch": 1, "max_new_tokens": args.max_new_tokens,
        "per_category": args.per_category, "questions": f"{len(prompts)} prompts, seed {args.seed}",
        "draft": f"first {args.layers} of {model.config.num_hidden_layers} decoder layers (layer-skip)",
        "prompt_format": chat_rendering(tokenizer), "clock": "CPU time of the process",
        "device": f"cpu, torch {torch.__version__}", "elapsed_s": round(time.perf_counter() - start, 1),
    }  # fmt: skip
    print(write_results(args.out, records, meta))


if __name__ == "__main__":
    main()
