"""What a new process's first calls cost with and without the GEMM forms an earlier process saved (`gemm_cache`).

One process learns on a fresh cache folder (the cost curve and the GEMM forms); then pairs of new processes run the
same calls from a copy of that folder, one with its GEMM-forms file and one without it (the cost curve kept in both),
in alternating order. Each call is timed in process CPU time, with the GEMMs run as timed trials and the verify steps
that ran them (`PlannedOutput.tuned`).

    python benchmarks/gemm_cache_first_calls.py --pairs 2 --out docs/results/intel_gemm_forms_cache.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPTS = (
    "Explain how a refrigerator works.",
    "Write a short poem about autumn leaves.",
    "What is the capital of Australia and why?",
    "Summarise the plot of Hamlet.",
)


def child(method: str, max_new_tokens: int) -> dict:
    """The calls of one new process (the cache folder comes from ``HF_SPECDEC_COST_CACHE``)."""
    import torch

    import hf_specdec
    from hf_specdec.generation import loop
    from hf_specdec.generation import packed_linears as gemms

    torch.set_num_threads(1)
    model, tok = hf_specdec.load_default_model()
    tuned_steps = [0]
    verify = loop._verify

    def counted(call, active, trees):
        out = verify(call, active, trees)
        tuned_steps[0] += bool(out[0].tuned)
        return out

    loop._verify = counted
    calls = []
    for prompt in PROMPTS:
        ids = hf_specdec.chat_prompt_ids(tok, prompt)
        trials, tuned_steps[0] = gemms.tuning_calls(), 0
        start = time.process_time()
        out = model.generate(
            ids, max_new_tokens=max_new_tokens, do_sample=False, return_dict_in_generate=True,
            assistant=hf_specdec.load_default_assistant(method),
        )  # fmt: skip
        calls.append(
            {
                "cpu_s": round(time.process_time() - start, 3),
                "new_tokens": int(out.sequences.shape[1] - ids.shape[1]),
                "verify_steps": out.spec_stats.steps,
                "tuned_steps": tuned_steps[0],
                "gemm_trials": gemms.tuning_calls() - trials,
            }
        )
    return {"calls": calls, "cpu_s": round(sum(c["cpu_s"] for c in calls), 3)}


def run_child(folder: Path, args) -> dict:
    env = {**os.environ, "HF_SPECDEC_COST_CACHE": str(folder), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, __file__, "--child", "--method", args.method, "--max-new-tokens", str(args.max_new_tokens)]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--method", default="ngram+eagle")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.method, args.max_new_tokens)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        learnt = Path(tmp) / "learnt"
        first = run_child(learnt, args)
        print("learning process:", first["cpu_s"], "CPU s", flush=True)
        runs = {"with": [], "without": []}
        for pair in range(args.pairs):
            for kind in ("with", "without") if pair % 2 == 0 else ("without", "with"):
                folder = Path(tmp) / f"{kind}-{pair}"
                shutil.copytree(learnt, folder)
                if kind == "without":
                    for f in folder.glob("gemm-forms-*.json"):
                        f.unlink()
                runs[kind].append(run_child(folder, args))
                print(pair, kind, runs[kind][-1]["cpu_s"], "CPU s", flush=True)
    import torch

    from hf_specdec.generation.cost_cache import machine_key

    record = {
        "what": "CPU seconds of a new process's calls, with / without the GEMM forms saved by an earlier process",
        "machine": platform.processor() or platform.machine(),
        "cpu": machine_key([torch.device("cpu")])["cpu"],
        "method": args.method,
        "max_new_tokens": args.max_new_tokens,
        "prompts": list(PROMPTS),
        "learning_process": first,
        "runs": runs,
        "mean_cpu_s": {k: round(sum(r["cpu_s"] for r in v) / len(v), 3) for k, v in runs.items()},
        "mean_gemm_trials": {
            k: sum(sum(c["gemm_trials"] for c in r["calls"]) for r in v) / len(v) for k, v in runs.items()
        },
    }
    text = json.dumps(record, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
