"""End-to-end GPU check: speculative ``generate`` against vanilla ``generate`` (SDPA) on CUDA, and the whole-model
verify cost of Llama-3.2-1B- and Llama-3.1-8B-shaped random models.

    python -m hf_specdec.bench.gpu OUT_DIR                 # needs a CUDA GPU; writes gpu_e2e.md + gpu_e2e.json
    python -m hf_specdec.bench.gpu OUT_DIR --dry-run-cpu   # a few tokens on the CPU: the same code path, no claims

**Generate.** The default model (SmolLM2-135M-Instruct) in each ``--dtypes`` on the GPU, the bench's quick sample
(one Spec-Bench question per category, the prompts of ``hf-specdec bench``), greedy, ``--max-new-tokens`` tokens.
For each batch size (``--batches``; a batch of b takes the sample's prompts in order, cycling) every method runs on
the same inputs right after vanilla ``generate`` with the model's own SDPA attention, ``--repeats`` times, fastest
kept, after one untimed call of each on the table's first inputs (CUDA and cuBLAS set-up and the Triton kernels'
compilation would otherwise be timed: docs/lab/measurements.md, "Figures that stood in the package's docstrings"):
the ready-made assistants (`hf_specdec.assistants`: n-gram and the shipped heads, moved to the GPU in the
model's dtype) with the default tree budget. A row reports tokens per second, the speedup over vanilla in the same
run, tau (`SpecStats.tau`) and how many outputs equal vanilla's token for token (all of them in fp32; bf16 rounding
may differ between a tree forward and a one-token forward).

**Verify cost.** A random-weight model of each ``--curve-shapes`` shape (bf16) verifies a random tree of n nodes
over ``--curve-context`` committed tokens, with our backend (plan included, as the loop runs it) and with stock
transformers SDPA (DynamicCache + 4D tree mask); the table gives both times, ``t(n) / t(1)`` and our one-token
forward over SDPA's (the target: within 5%).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import re
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from ..assistants import available_assistants, load_default_assistant
from ..generation.proposers.base import Proposer
from .kernels import _CudaTimer, _WallTimer
from .questions import find_questions_file, load_questions, sample_questions
from .spec_bench import build_prompts, count_new_tokens, left_pad

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
CURVE_SHAPES = {  # name: LlamaConfig fields
    "llama-3.2-1b": dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
    ),
    "llama-3.1-8b": dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
    ),
}  # fmt: skip
DEFAULT_METHODS = ("ngram", "ngram+medusa", "medusa", "eagle", "mlp_speculator")


# ------------------------------------------------------------------------------------------------ timing
def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------------------------------------ generate
def to_device(assistant: Proposer, device: torch.device, dtype: torch.dtype) -> Proposer:
    """Move the heads an assistant holds (and those of the assistants inside a fallback) to ``device`` / ``dtype``."""
    seen: set[int] = set()

    def visit(obj) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.nn.Module):
            obj.to(device=device, dtype=dtype)
        elif isinstance(obj, Proposer):
            for value in vars(obj).values():
                visit(value)
        elif isinstance(obj, (list, tuple)):
            for value in obj:
                visit(value)

    visit(assistant)
    return assistant


def sample_inputs(tokenizer, batch: int, count: int | None = None) -> list[list[torch.Tensor]]:
    """The bench's quick sample as groups of ``batch`` prompts (`[n]` ids each); batches larger than the sample
    cycle through it."""
    questions = sample_questions(load_questions(find_questions_file(None)), 1)
    prompts = [p.ids for p in build_prompts(tokenizer, questions)][:count]
    if batch == 1:
        return [[p] for p in prompts]
    return [[prompts[i % len(prompts)] for i in range(batch)]]


def timed_generate(model, ids, mask, max_new_tokens: int, assistant, repeats: int) -> tuple[float, object]:
    """Fastest seconds of ``repeats`` greedy calls (a fresh copy of ``assistant`` each) and the last output."""
    best, out = float("inf"), None
    for _ in range(repeats):
        kwargs = {} if assistant is None else {"assistant": assistant(), "return_dict_in_generate": True}
        synchronize(ids.device)
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, **kwargs)
        synchronize(ids.device)
        best = min(best, time.perf_counter() - t0)
    return best, out


def run_generate(model, tokenizer, device, dtype, batch, methods, max_new_tokens, repeats, prompts=None) -> list[dict]:
    """One table's rows: vanilla, then each method, each timed right after vanilla on the same inputs."""
    eos = {int(t) for t in torch.as_tensor(model.generation_config.eos_token_id).reshape(-1).tolist()}
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos)
    totals = {
        name: {"seconds": 0.0, "vanilla_s": 0.0, "tokens": 0, "same": 0, "calls": 0, "tau": []} for name in methods
    }
    vanilla_s, vanilla_tokens = 0.0, 0
    makers = {name: (lambda name=name: to_device(load_default_assistant(name), device, dtype)) for name in methods}
    first = sample_inputs(tokenizer, batch, prompts)[0]
    ids, mask = (t.to(device) for t in left_pad(first, pad))
    for make in [None, *makers.values()]:  # warm-up, untimed: set-up and compilation are not the method's speed
        timed_generate(model, ids, mask, max_new_tokens, make, 1)
    for group in sample_inputs(tokenizer, batch, prompts):
        ids, mask = (t.to(device) for t in left_pad(group, pad))
        base_s, base = timed_generate(model, ids, mask, max_new_tokens, None, repeats)
        vanilla_s += base_s
        vanilla_tokens += count_new_tokens(base, ids.shape[1], eos)
        for name, make in makers.items():
            seconds, out = timed_generate(model, ids, mask, max_new_tokens, make, repeats)
            row = totals[name]
            row["seconds"] += seconds
            row["vanilla_s"] += base_s
            row["tokens"] += count_new_tokens(out.sequences, ids.shape[1], eos)
            row["same"] += int(torch.equal(out.sequences.cpu(), base.cpu()))
            row["calls"] += 1
            row["tau"].append(out.spec_stats.tau)
    rows = [{"method": "vanilla (SDPA)", "tokens_per_s": vanilla_tokens / vanilla_s, "speedup": 1.0}]
    for name, row in totals.items():
        rows.append(
            {
                "method": name,
                "tokens_per_s": row["tokens"] / row["seconds"],
                "speedup": row["vanilla_s"] / row["seconds"],
                "tau": statistics.fmean(row["tau"]) if row["tau"] else None,
                "identical": f"{row['same']}/{row['calls']}",
            }
        )
    return rows


# ------------------------------------------------------------------------------------------------ verify cost
def run_curve(shape: str, dtype, device, context: int, nodes: Sequence[int], timer) -> dict:
    """Our backend's and SDPA's verify forward (µs) of a random model of ``shape``, per tree size."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from ..training.step_cost import verify_cost_curve

    if device.type == "cuda":
        config = LlamaConfig(**CURVE_SHAPES[shape])
    else:  # the dry run: the same code on a model small enough for a CPU
        config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=512)  # fmt: skip
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").eval()
    try:
        times, diff = verify_cost_curve(model, context, nodes, timer)
    finally:
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    ours, sdpa = times["hf_specdec"], times["sdpa"]
    first = nodes[0]
    return {
        "shape": shape,
        "context": context,
        "ours_us": {str(n): ours[n] for n in nodes},
        "sdpa_us": {str(n): sdpa[n] for n in nodes},
        "ours_over_sdpa_one_token": ours[first] / sdpa[first],
        "max_abs_logit_diff_largest_tree": diff,
    }


# ------------------------------------------------------------------------------------------------ report
def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    from .host import cpu_name

    return f"CPU ({cpu_name()})"


def markdown(report: dict) -> str:
    lines = [f"# End-to-end GPU check: {report['device']}, {report['date']}", "", report["environment"], ""]
    for table in report["generate"]:
        lines += [
            f"## generate, {table['dtype']}, batch {table['batch']} ({table['max_new_tokens']} new tokens, "
            f"{table['prompts']} prompts, fastest of {table['repeats']})",
            "",
            "| method | tokens/s | speedup vs vanilla | tau | identical to vanilla |",
            "|---|---:|---:|---:|---:|",
        ]
        for r in table["rows"]:
            tau = "" if r.get("tau") is None else f"{r['tau']:.2f}"
            lines.append(
                f"| {r['method']} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f} | {tau} | {r.get('identical', '')} |"
            )
        lines.append("")
    for curve in report["curves"]:
        lines += [
            f"## verify cost, random {curve['shape']} (bf16), context {curve['context']}: one-token forward ours / "
            f"SDPA = {curve['ours_over_sdpa_one_token']:.3f}",
            "",
            "| nodes | ours (us) | ours t(n)/t(1) | SDPA (us) | SDPA t(n)/t(1) |",
            "|---:|---:|---:|---:|---:|",
        ]
        nodes = list(curve["ours_us"])
        o1, s1 = curve["ours_us"][nodes[0]], curve["sdpa_us"][nodes[0]]
        for n in nodes:
            o, s = curve["ours_us"][n], curve["sdpa_us"][n]
            lines.append(f"| {n} | {o:.0f} | {o / o1:.2f} | {s:.0f} | {s / s1:.2f} |")
        lines.append("")
    return "\n".join(lines)


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hf_specdec.bench.gpu", description=__doc__.split("\n")[0])
    parser.add_argument("out_dir", nargs="?", default="docs/results", help="where the report goes")
    parser.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=list(DTYPES))
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--methods", default=",".join(DEFAULT_METHODS), help="comma-separated ready-made assistants")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=None, help="at most this many prompts of the sample")
    parser.add_argument("--curve-shapes", nargs="*", default=list(CURVE_SHAPES), choices=list(CURVE_SHAPES))
    parser.add_argument("--curve-context", type=int, default=1024)
    parser.add_argument("--curve-nodes", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32, 64, 128])
    parser.add_argument("--dry-run-cpu", action="store_true", help="a few tokens on the CPU (no timing claims)")
    args = parser.parse_args(argv)
    if not args.dry_run_cpu and not torch.cuda.is_available():
        print("hf_specdec.bench.gpu: no CUDA device; pass --dry-run-cpu to check the code path", file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.dry_run_cpu else "cuda")
    methods = [m.strip() for m in args.methods.split(",") if m.strip() in available_assistants()]
    from ..models import load_default_model

    date = datetime.date.today().isoformat()
    report = {
        "device": device_name(device),
        "date": date,
        "environment": f"torch {torch.__version__}, CUDA {torch.version.cuda}, methods {methods}",
        "generate": [],
        "curves": [],
    }
    for dtype_name in args.dtypes:
        model, tokenizer = load_default_model(dtype=DTYPES[dtype_name], device=device)
        for batch in args.batches:
            rows = run_generate(
                model, tokenizer, device, DTYPES[dtype_name], batch, methods, args.max_new_tokens, args.repeats,
                args.prompts,
            )  # fmt: skip
            prompts = len(sample_inputs(tokenizer, 1, args.prompts)) if batch == 1 else batch
            report["generate"].append(
                dict(dtype=dtype_name, batch=batch, rows=rows, max_new_tokens=args.max_new_tokens, prompts=prompts,
                     repeats=args.repeats)
            )  # fmt: skip
            print(markdown({**report, "generate": report["generate"][-1:], "curves": []}), flush=True)
        del model
        gc.collect()
    timer = _CudaTimer(warmup=3, iters=10) if device.type == "cuda" else _WallTimer()
    context = args.curve_context if device.type == "cuda" else 16
    nodes = args.curve_nodes if device.type == "cuda" else [1, 2, 4]
    for shape in args.curve_shapes:
        report["curves"].append(run_curve(shape, torch.bfloat16, device, context, nodes, timer))
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"gpu_e2e_{slug(report['device'])}_{date}" if device.type == "cuda" else "gpu_e2e_dry_run"
    (out / f"{stem}.json").write_text(json.dumps(report, indent=1))
    (out / f"{stem}.md").write_text(markdown(report))
    print(markdown(report))
    print(f"wrote {out / stem}.md and .json", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
