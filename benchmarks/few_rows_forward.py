"""What a verify forward of n tokens costs the default model in fp32 on this CPU, with MKL's GEMM forms only and with
the compiled few-rows GEMM beside them (`hf_specdec.build_cpu_kernels`), against a stock 1-token decode step.

One process, one torch thread: the model prefilled with 300 random tokens, then forwards of n = 1 ... 16 new tokens
(cropped off again), the two settings interleaved round by round inside `packed_linears` with copies kept, so each
GEMM form is timed and chosen as in a call. The first `WARM` rounds (the forms' timed trials) are left out; the
median over the rest is reported, in ms and as a ratio to a 1-token forward through stock `F.linear` (what vanilla
`generate` runs). Also the single GEMMs of the default model's shapes, in µs, and where a stock 1-token forward's
time goes (torch's profiler: its `aten::mm` part, and the rate at which that reads the weights).

    python benchmarks/few_rows_forward.py --out docs/results/amd_few_rows_forward.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import DynamicCache

import hf_specdec
from hf_specdec.generation import cost_cache
from hf_specdec.generation import packed_linears as pl
from hf_specdec.kernels import few_rows_gemm

CHOSEN: dict[str, dict[str, str]] = {}  # per setting: the form each linear shape and row count ran
ROWS = (1, 2, 3, 4, 5, 6, 8, 12, 16)
WARM, ROUNDS = 8, 20
SHAPES = {"q_proj": (576, 576), "k_proj": (192, 576), "up_proj": (1536, 576), "down_proj": (576, 1536),
          "lm_head": (49152, 576)}  # fmt: skip


def _prefilled_cache(model) -> DynamicCache:
    """A cache holding 300 random tokens: the context every timed forward runs on."""
    cache = DynamicCache()
    model(torch.randint(100, 20000, (1, 300)), cache=cache, use_cache=True)
    return cache


def _forward_ms(model, cache, n: int) -> float:
    x = torch.randint(100, 20000, (1, n))
    start = time.perf_counter()
    model(x, cache=cache, use_cache=True)
    seconds = time.perf_counter() - start
    cache.crop(-n)
    return seconds * 1e3


def forward_curves(model, kernel) -> dict:
    """Per setting and n: the median ms of an n-token forward, and its ratio to a stock 1-token forward."""
    times = {setting: {n: [] for n in ROWS} for setting in ("mkl_forms", "with_few_rows")}
    choices = {setting: ({}, {}) for setting in times}
    with torch.no_grad():
        cache = _prefilled_cache(model)
        for _ in range(WARM + ROUNDS):
            for setting, series in times.items():
                few_rows_gemm._MODULE[0] = kernel if setting == "with_few_rows" else None
                pl._GEMM_CHOICE, pl._GEMM_TRIALS = choices[setting]  # each setting's own timed choices
                with pl.packed_linears(model, keep=True):
                    for n in ROWS:
                        series[n].append(_forward_ms(model, cache, n))
    few_rows_gemm._MODULE[0] = kernel
    for setting, (chosen, _) in choices.items():
        pl._GEMM_CHOICE = chosen
        CHOSEN[setting] = pl.gemm_choices()
    stock_one = statistics.median(v for s in times.values() for v in s[1][WARM:])  # 1 row: F.linear in both
    return {
        setting: {n: {"ms": round(statistics.median(v[WARM:]), 2),
                      "x_stock_1_token": round(statistics.median(v[WARM:]) / stock_one, 3)} for n, v in series.items()}
        for setting, series in times.items()
    }  # fmt: skip


def _gemm_us(fn, reps: int = 30) -> float:
    for _ in range(5):
        fn()
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return round(statistics.median(samples) * 1e6, 1)


def gemm_table() -> dict:
    table = {}
    for name, (out, inp) in SHAPES.items():
        w = torch.randn(out, inp)
        panels = few_rows_gemm.pack_weight(w)
        row = {}
        for n in (1, 2, 3, 4, 8, 16):
            x = torch.randn(n, inp)
            row[n] = {"F.linear": _gemm_us(lambda x=x, w=w: F.linear(x, w)),
                      "weight_major": _gemm_us(lambda x=x, w=w: torch.mm(w, x.t())),
                      "few_rows": _gemm_us(lambda x=x, p=panels, o=out: few_rows_gemm.linear(x, p, o, None))}  # fmt: skip
        table[name] = row
    return table


def stock_step_profile(model, forwards: int = 5) -> dict:
    """Where a stock 1-token forward's time goes (torch's profiler, self CPU time): all of it and `aten::mm`'s part
    (the weights' products), in ms per forward, and what reading the fp32 weights once in the mm time comes to."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        cache = _prefilled_cache(model)
        for _ in range(3):
            _forward_ms(model, cache, 1)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(forwards):
                _forward_ms(model, cache, 1)
    events = prof.key_averages()
    total_ms = sum(e.self_cpu_time_total for e in events) / 1e3 / forwards
    mm_ms = sum(e.self_cpu_time_total for e in events if e.key == "aten::mm") / 1e3 / forwards
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # the tied lm_head counted once
    return {"forward_ms": round(total_ms, 1), "mm_ms": round(mm_ms, 1),
            "weights_gb_per_s_in_mm": round(weight_bytes / (mm_ms / 1e3) / 1e9, 1)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    pl.build_cpu_kernels()
    kernel = few_rows_gemm._MODULE[0]  # the loaded extension, switched off and on between rounds
    pl._KERNELS_LOOKED_UP[0] = True  # not looked up again (and loaded back) while switched off
    model, _ = hf_specdec.load_default_model()
    record = {
        "machine": {"cpu": cost_cache._cpu_name(), "arch": platform.machine(), "torch": torch.__version__,
                    "capability": torch.backends.cpu.get_cpu_capability(), "threads": 1},
        "model": "SmolLM2-135M-Instruct, float32, 300 tokens cached",
        "forward": forward_curves(model, kernel),
        "gemm_forms_chosen": CHOSEN,
        "gemm_us": gemm_table(),
        "stock_1_token_profile": stock_step_profile(model),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    for setting, curve in record["forward"].items():
        print(setting, {n: v["x_stock_1_token"] for n, v in curve.items()})


if __name__ == "__main__":
    main()
