"""What a user's plain series of ``model.generate(ids, assistant=...)`` calls gets, in a new process: no
``packed_weights`` block, no warm-up call, each prompt once through vanilla ``generate`` and once through each method
(interleaved, process CPU time, one torch thread). ``hf-specdec bench`` measures the steady state instead (its run is
inside ``packed_weights`` after a warm-up call of every method), so this is the figure a notebook's first calls see.

Run two builds side by side on a 2-core machine to compare them (``PYTHONPATH`` of the other build's checkout):

    python benchmarks/plain_calls.py --methods eagle,ngram+eagle --per-category 2 --seed 1 --out new.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def run(methods: list[str], per_category: int, seed: int, max_new_tokens: int, keep_packed: str) -> dict:
    import torch

    import hf_specdec
    from hf_specdec.bench.questions import find_questions_file, load_questions, sample_questions
    from hf_specdec.bench.spec_bench import _eos_ids, build_prompts, count_new_tokens, first_difference
    from hf_specdec.generation import packed_linears
    from hf_specdec.generation.packed_linears import packed_bytes

    torch.set_num_threads(1)
    model, tok = hf_specdec.load_default_model()
    questions = sample_questions(load_questions(find_questions_file(None)), per_category, seed=seed)
    prompts = build_prompts(tok, questions)
    assistants = {m: hf_specdec.load_default_assistant(m) for m in methods}
    extra = {} if keep_packed == "default" else {"keep_packed": keep_packed == "true"}
    eos, calls = _eos_ids(model), []
    for i, prompt in enumerate(prompts):
        ids = prompt.ids[None]  # [1, n]
        kw = dict(max_new_tokens=max_new_tokens, do_sample=False)
        start = time.process_time()
        ref = model.generate(ids, **kw)
        row = {"prompt": i, "category": prompt.category, "vanilla_s": time.process_time() - start}
        row["tokens"] = count_new_tokens(ref, ids.shape[1], eos)
        for m in methods:
            start = time.process_time()
            out = model.generate(ids, assistant=assistants[m], **kw, **extra)
            row[f"{m}_s"] = time.process_time() - start
            row[f"{m}_mismatch"] = first_difference(out, ref, ids.shape[1]) is not None
        row["packed_mib"] = packed_bytes(model) / 2**20
        row["gemm_keys_being_timed"] = len(getattr(packed_linears, "_GEMM_TRIALS", ()))
        calls.append(row)
        ratios = "  ".join(f"{m} {row['vanilla_s'] / row[f'{m}_s']:.2f}x" for m in methods)
        print(f"prompt {i + 1}/{len(prompts)} ({prompt.category}): {ratios}", file=sys.stderr, flush=True)
    return {"methods": methods, "calls": calls, "summary": summarize(calls, methods)}


def summarize(calls: list[dict], methods: list[str]) -> dict:
    """Per method: total vanilla time over the method's (overall), the same without the first call, mismatches."""

    def overall(rows, m):
        return sum(r["vanilla_s"] for r in rows) / sum(r[f"{m}_s"] for r in rows)

    return {
        m: {
            "overall": round(overall(calls, m), 4),
            "first_call": round(overall(calls[:1], m), 4),
            "after_the_first": round(overall(calls[1:], m), 4) if len(calls) > 1 else None,
            "mismatches": sum(r[f"{m}_mismatch"] for r in calls),
        }
        for m in methods
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", default="eagle,ngram+eagle")
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--keep-packed", choices=("default", "true", "false"), default="default")
    parser.add_argument("--label", default="", help="a name for the build measured (stored in the JSON)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    import torch

    import hf_specdec
    from hf_specdec.bench.spec_bench import _cpu_name

    result = run(args.methods.split(","), args.per_category, args.seed, args.max_new_tokens, args.keep_packed)
    result["meta"] = {
        "label": args.label,
        "cpu": _cpu_name(),
        "torch": torch.__version__,
        "hf_specdec": getattr(hf_specdec, "__version__", None),
        "hf_specdec_path": str(Path(hf_specdec.__file__).parent),
        "seed": args.seed,
        "per_category": args.per_category,
        "keep_packed": args.keep_packed,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    print(json.dumps(result["summary"], indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
