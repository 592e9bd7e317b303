"""What the speculative loop's own step costs beside vanilla `generate`'s decode step, where nothing is drafted: the
floor every assistant sits on.

One process, one torch thread, the default model in ``--dtype``: vanilla `generate` and the loop with an assistant
that drafts nothing (`NullAssistant`, the bench's ``null``) each decode ``--tokens`` greedy tokens of one chat
prompt, alternately, ``--rounds`` times (the first round of each is a warm-up, left out). Reported, as medians over
the rounds:

- the whole call's wall time and its ratio to vanilla's;
- one layer's attention in µs: vanilla's cache update (`DynamicLayer.update`) plus its SDPA attention function,
  against the loop's paged attention (cache write and read included);
- the work outside the model's forward per step (generation loop, planning, verification, commits), in ms: the
  call's time less its forwards', over the steps of a ``--tokens`` call less those of an 8-token one (which takes
  out what each call pays once).

    python benchmarks/step_overhead.py --dtype bfloat16 --out docs/results/intel_step_overhead_bf16_after.json

Run from a checkout of another commit (its folder as the working directory) to measure that commit's loop.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from collections import defaultdict
from pathlib import Path

import torch
import transformers
import transformers.cache_utils as cache_utils
import transformers.integrations.sdpa_attention as sdpa
from transformers import AttentionInterface

import hf_specdec
import hf_specdec.attention.backend as backend
from hf_specdec.bench.methods import NullAssistant
from hf_specdec.bench.spec_bench import _cpu_name

PROMPT = "Explain how a hash map works, in detail, with examples."
SHORT = 8
SPENT: dict[str, float] = defaultdict(float)  # what the wrapped functions took in the current call, in seconds
CALLS: dict[str, int] = defaultdict(int)


def _timed(name: str, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            SPENT[name] += time.perf_counter() - start
            CALLS[name] += 1

    return wrapper


def _instrument(model) -> None:
    """Time the model's forward, vanilla's attention (cache update + SDPA) and the loop's paged attention."""
    sdpa_forward = _timed("sdpa", sdpa.sdpa_attention_forward)
    AttentionInterface._global_mapping["sdpa"] = sdpa_forward
    cache_utils.DynamicLayer.update = _timed("cache_update", cache_utils.DynamicLayer.update)
    backend.paged_attention = _timed("paged", backend.paged_attention)
    cls = type(model)
    cls.forward = _timed("model", cls.forward)


def _call(model, ids, tokens: int, method: str) -> dict:
    """One call's wall seconds, the seconds its forwards took, and µs per layer of attention."""
    SPENT.clear()
    CALLS.clear()
    extra = {"assistant": NullAssistant()} if method == "null" else {}
    start = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, do_sample=False, **extra)
    wall = time.perf_counter() - start
    if method == "null":
        attention_s, layers = SPENT["paged"], CALLS["paged"]
    else:
        attention_s, layers = SPENT["sdpa"] + SPENT["cache_update"], CALLS["sdpa"]
    return {"wall_s": wall, "outside_s": wall - SPENT["model"], "attention_us": 1e6 * attention_s / max(1, layers)}


def measure(dtype: torch.dtype, tokens: int, rounds: int) -> dict:
    model, tokenizer = hf_specdec.load_default_model()
    model = model.to(dtype)
    _instrument(model)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]  # fmt: skip
    runs: dict[str, dict[int, list[dict]]] = {m: {SHORT: [], tokens: []} for m in ("vanilla", "null")}
    with torch.no_grad():
        for r in range(rounds + 1):
            for n in (SHORT, tokens):
                for method in runs:
                    result = _call(model, ids, n, method)
                    if r:  # round 0 warms up
                        runs[method][n].append(result)
    out = {}
    for method, by_n in runs.items():
        med = {n: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for n, rs in by_n.items()}
        per_step = (med[tokens]["outside_s"] - med[SHORT]["outside_s"]) / (tokens - SHORT)
        out[method] = {"wall_s": round(med[tokens]["wall_s"], 4), "attention_us_per_layer":
                       round(med[tokens]["attention_us"], 1), "outside_ms_per_step": round(1e3 * per_step, 3)}  # fmt: skip
    out["null"]["speed_vs_vanilla"] = round(out["vanilla"]["wall_s"] / out["null"]["wall_s"], 4)
    return out


def _commit() -> str:
    """The commit of the checkout whose hf_specdec this process imported."""
    folder = Path(hf_specdec.__file__).parent
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=folder, capture_output=True, text=True).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = measure(getattr(torch, args.dtype), args.tokens, args.rounds)
    record = {"meta": {"model": "SmolLM2-135M-Instruct", "dtype": args.dtype, "tokens": args.tokens,
                       "rounds": args.rounds, "threads": 1, "cpu": _cpu_name(), "torch": torch.__version__,
                       "transformers": transformers.__version__, "commit": _commit(),
                       "date": time.strftime("%Y-%m-%dT%H:%M:%S")},
              "results": result}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
