"""Layer-skip draft models against vanilla, with and without the budget's proposing cost (issue 68), and against
transformers' own ``assistant_model=`` with the same draft, in one process.

Per dtype: the default model, a cheap draft (``draft_model_from_layers(model, 6)``) and an expensive one (24 of 30
layers); per Spec-Bench prompt, vanilla ``generate`` then each method (interleaved, process CPU time, one torch
thread). ``draftN`` is ``assistant=draft`` as shipped; ``draftN_before`` the same call with
``HF_SPECDEC_PROPOSING_COST=0`` (the budget does not plan for the draft's own cost and every row feeds the draft every
step: the behaviour before it); ``hf_assistantN`` is ``assistant_model=draft``; ``loop_drafting_nothing`` is hf_specdec's
loop with an assistant that never drafts (the floor a draft that is switched off can reach). Every call is checked greedy-equal to
vanilla. The cost cache points at a fresh folder, so the first call of each draft learns from nothing.

    python benchmarks/draft_model_cost.py --prompts 6 --max-new-tokens 128 --out docs/results/draft_model_cost.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

LEARNING_STEPS = 8  # the first steps of a call: the plan may still be learning


NOTHING = "loop_drafting_nothing"  # hf_specdec's loop with an assistant that never drafts: the loop's own floor


def _methods(layers: list[int]) -> list[str]:
    return [NOTHING] + [f"{kind}{n}" for n in layers for kind in ("draft", "draft_before", "hf_assistant")]


def _nothing():
    """An assistant that drafts nothing, every step (the loop's plain steps, no proposer cost)."""
    from hf_specdec.generation.proposers.base import Proposer
    from hf_specdec.generation.tree import DraftTree

    class Nothing(Proposer):
        proposes_for_free = True

        def propose(self, rows):
            return [DraftTree.empty(r.tokens.device) for r in rows]

    return Nothing()


def _call(model, ids, method: str, drafts: dict, max_new_tokens: int):
    """One generate call of ``method``: ``(output ids [1, W + G], spec_stats or None)``."""
    kind = method.rstrip("0123456789")
    n = int(method[len(kind) :] or 0)
    kw = dict(max_new_tokens=max_new_tokens, do_sample=False)
    if method == NOTHING:
        out = model.generate(ids, assistant=_nothing(), return_dict_in_generate=True, **kw)
        return out.sequences, None
    if kind == "hf_assistant":
        return model.generate(ids, assistant_model=drafts[n], **kw), None
    os.environ["HF_SPECDEC_PROPOSING_COST"] = "0" if kind == "draft_before" else "1"
    out = model.generate(ids, assistant=drafts[n], return_dict_in_generate=True, **kw)
    return out.sequences, out.spec_stats


def _drafting(stats) -> dict:
    """Drafted nodes per step, over the call and after its first `LEARNING_STEPS` steps; draft levels per step."""
    if stats is None:
        return {}
    out = {"nodes_per_step": round(stats.drafted_tokens / max(1, stats.steps), 3)}
    proposing = stats.budget.get("proposing")
    if proposing:
        levels = proposing["levels_per_step"]
        late = levels[LEARNING_STEPS:]
        out["levels_per_step"] = round(sum(levels) / max(1, len(levels)), 3)
        out["levels_per_step_after_learning"] = round(sum(late) / len(late), 3) if late else None
        out["level_ratio"] = proposing["level_ratio"]
        out["probes"] = proposing["probes"]
    nodes = stats.budget.get("nodes_per_row", {})
    out["nodes_per_row"] = {str(k): v for k, v in nodes.items()}
    return out


def run(dtype_name: str, n_prompts: int, max_new_tokens: int, layers: list[int], seed: int, hf_prompts: int) -> dict:
    import torch

    import hf_specdec
    from hf_specdec.bench.questions import find_questions_file, load_questions, sample_questions
    from hf_specdec.bench.spec_bench import _eos_ids, build_prompts, count_new_tokens, first_difference

    torch.set_num_threads(1)
    model, tok = hf_specdec.load_default_model(dtype=getattr(torch, dtype_name))
    drafts = {n: hf_specdec.draft_model_from_layers(model, n) for n in layers}
    questions = sample_questions(load_questions(find_questions_file(None)), 1, seed=seed)[:n_prompts]
    prompts = build_prompts(tok, questions)
    methods, eos, calls = _methods(layers), _eos_ids(model), []
    for i, prompt in enumerate(prompts):
        ids = prompt.ids[None]  # [1, n]
        start = time.process_time()
        ref = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
        row = {"prompt": i, "category": prompt.category, "vanilla_s": time.process_time() - start}
        row["tokens"] = count_new_tokens(ref, ids.shape[1], eos)
        for m in methods:
            if m.startswith("hf_assistant") and i >= hf_prompts:
                continue
            start = time.process_time()
            out, stats = _call(model, ids, m, drafts, max_new_tokens)
            row[f"{m}_s"] = time.process_time() - start
            row[f"{m}_mismatch"] = first_difference(out, ref, ids.shape[1]) is not None
            row[f"{m}_drafting"] = _drafting(stats)
        calls.append(row)
        shown = "  ".join(f"{m} {row['vanilla_s'] / row[f'{m}_s']:.2f}x" for m in methods if f"{m}_s" in row)
        print(f"{dtype_name} prompt {i + 1}/{len(prompts)} ({prompt.category}): {shown}", file=sys.stderr, flush=True)
    return {"dtype": dtype_name, "methods": methods, "calls": calls, "summary": summarize(calls, methods)}


def _median_call(calls: list[dict], m: str) -> float | None:
    """The median of the calls' own ratios (one call slowed or sped by another process weighs less)."""
    import statistics

    ratios = [r["vanilla_s"] / r[f"{m}_s"] for r in calls if f"{m}_s" in r]
    return round(statistics.median(ratios), 4) if ratios else None


def summarize(calls: list[dict], methods: list[str]) -> dict:
    """Per method: vanilla's total time over the method's (overall, first call, after it), the lowest category,
    mismatches, and the drafting after the first call (mean levels and nodes per step after the learning steps)."""

    def ratio(rows, m):
        rows = [r for r in rows if f"{m}_s" in r]
        return round(sum(r["vanilla_s"] for r in rows) / sum(r[f"{m}_s"] for r in rows), 4) if rows else None

    out = {}
    for m in methods:
        cats = {
            c: ratio([r for r in calls if r["category"] == c], m) for c in dict.fromkeys(r["category"] for r in calls)
        }
        late = [r[f"{m}_drafting"] for r in calls[1:] if r.get(f"{m}_drafting")]
        out[m] = {
            "overall": ratio(calls, m),
            "first_call": ratio(calls[:1], m),
            "after_the_first": ratio(calls[1:], m),
            "median_call": _median_call(calls, m),
            "lowest_category": min(v for v in cats.values() if v is not None),
            "categories": {c: v for c, v in cats.items() if v is not None},
            "mismatches": sum(r.get(f"{m}_mismatch", False) for r in calls),
            "calls": sum(f"{m}_s" in r for r in calls),
        }
        for key in ("nodes_per_step", "levels_per_step_after_learning"):
            values = [d[key] for d in late if d.get(key) is not None]
            if values:
                out[m][f"{key}_later_calls"] = round(sum(values) / len(values), 3)
    return out


def _x(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def markdown(results: list[dict]) -> str:
    lines = [
        "| dtype | method | overall | median call | first call | later calls | lowest category | nodes/step (later calls) "
        "| draft levels/step after learning | mismatches | calls |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for res in results:
        for m, s in res["summary"].items():
            nodes, levels = (
                s.get("nodes_per_step_later_calls", "-"),
                s.get("levels_per_step_after_learning_later_calls", "-"),
            )
            lines.append(
                f"| {res['dtype']} | {m} | {s['overall']:.2f}x | {_x(s['median_call'])} | {s['first_call']:.2f}x | "
                f"{_x(s['after_the_first'])} | {s['lowest_category']:.2f}x | {nodes} | {levels} | {s['mismatches']} | {s['calls']} |"
            )
    return "\n".join(lines)


def _commit() -> str | None:
    import subprocess

    run = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent)
    return run.stdout.strip() or None


def _meta(args) -> dict:
    import torch
    import transformers

    import hf_specdec
    from hf_specdec.bench.spec_bench import _cpu_name

    return {
        "cpu": _cpu_name(),
        "cores": len(os.sched_getaffinity(0)),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "hf_specdec": getattr(hf_specdec, "__version__", None),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "prompts": args.prompts,
        "max_new_tokens": args.max_new_tokens,
        "layers": args.layers,
        "hf_assistant_prompts": args.prompts if args.hf_prompts is None else args.hf_prompts,
        "seed": args.seed,
        "torch_threads": 1,
        "timing": "process CPU time, each prompt through vanilla then every method (interleaved)",
        "note": args.note,
        "commit": _commit(),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--layers", default="6,24", help="layer-skip drafts to measure (layers kept)")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--hf-prompts", type=int, default=None, help="transformers' assistant_model= on the first N only"
    )
    parser.add_argument("--note", default="", help="stored in the record (e.g. that the machine was shared)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    os.environ["HF_SPECDEC_COST_CACHE"] = tempfile.mkdtemp(prefix="draft_cost_cache_")
    layers = [int(x) for x in args.layers.split(",")]
    hf_prompts = args.prompts if args.hf_prompts is None else args.hf_prompts
    results = [run(d, args.prompts, args.max_new_tokens, layers, args.seed, hf_prompts) for d in args.dtypes.split(",")]
    table = markdown(results)
    print(table)
    if args.out:
        record = {"meta": _meta(args), "results": results, "table": table}
        args.out.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
