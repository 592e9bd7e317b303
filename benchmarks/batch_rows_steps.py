"""Where a batch's time goes, step by step: how many rows each verify step held, what such a step cost, and whether
the tree budget predicted its verify cost and its accepted tokens right.

Four Spec-Bench prompts decode as one batch (`hf_specdec.testing.spec_bench_batch`), with `null` (the loop drafting
nothing) and a ready-made assistant, interleaved, in one process with one torch thread and the target's linears
packed for the whole run (`hf_specdec.packed_weights`), after one warm-up call of each. Per call: process CPU
seconds; each row's verify steps; the batch's steps by how many rows were still decoding, and the median seconds of
such a step (steps that ran GEMM trials of a new row count left out); the budget's predicted verify seconds and
expected accepted tokens against the measured ones, over the steps that drafted.

    python benchmarks/batch_rows_steps.py --method eagle --reps 3 --out docs/results/intel_batch4_rows_eagle.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import Counter, defaultdict
from pathlib import Path

import torch

import hf_specdec
from hf_specdec.bench.methods import NullAssistant
from hf_specdec.generation import budget as budget_module
from hf_specdec.generation import loop
from hf_specdec.testing import spec_bench_batch


class StepLog:
    """What the patched loop and budget report for one call."""

    def __init__(self):
        self.steps: list[dict] = []
        self.predicted: dict | None = None
        self.audit = Counter()

    def install(self) -> None:
        verify, cut, verdicts = loop._verify, budget_module.TreeBudgeter.cut, budget_module.TreeBudgeter.record_verdicts
        log = self

        def timed_verify(call, active, trees):
            start = time.perf_counter()
            out = verify(call, active, trees)
            nodes = [t.num_nodes for t in trees]
            log.steps.append(
                {"rows": [r.index for r in active], "nodes": nodes, "accepted": [v.num_accepted for v in out[2]],
                 "seconds": time.perf_counter() - start, "tuned": bool(out[0].tuned)}
            )  # fmt: skip
            if log.predicted is not None and sum(nodes) and not out[0].tuned:
                log.audit["predicted_verify_s"] += log.predicted["verify_s"]
                log.audit["measured_verify_s"] += log.steps[-1]["seconds"]
            return out

        def audited_cut(self, candidates):
            cuts = cut(self, candidates)
            total = sum(c.num_nodes for c in cuts)
            log.predicted = {
                "verify_s": self.cost.curve()(len(candidates) + total),
                "accepted": sum(sum(c.probs) for c in cuts if c.probs),
            }
            return cuts

        def audited_verdicts(self, accepted):
            if log.predicted is not None and log.predicted["accepted"]:
                log.audit["predicted_accepted"] += log.predicted["accepted"]
                log.audit["measured_accepted"] += sum(len(a) for a in accepted)
                log.audit["drafting_steps"] += 1
            return verdicts(self, accepted)

        loop._verify = timed_verify
        budget_module.TreeBudgeter.cut = audited_cut
        budget_module.TreeBudgeter.record_verdicts = audited_verdicts

    def summary(self) -> dict:
        by_rows, seconds, row_steps = Counter(), defaultdict(list), Counter()
        for s in self.steps:  # the verify steps (the prefill is not one)
            by_rows[len(s["rows"])] += 1
            if not s["tuned"]:
                seconds[len(s["rows"])].append(s["seconds"])
            row_steps.update(s["rows"])
        return {
            "batch_steps": sum(by_rows.values()),
            "batch_steps_by_rows": dict(sorted(by_rows.items())),
            "median_ms_by_rows": {k: round(1e3 * statistics.median(v), 1) for k, v in sorted(seconds.items())},
            "steps_per_row": dict(sorted(row_steps.items())),
            "row_steps": sum(row_steps.values()),
            "steps_with_gemm_trials": sum(s["tuned"] for s in self.steps),
            "budget_audit": {k: round(v, 3) for k, v in sorted(self.audit.items())},
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", default="eagle")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tok = hf_specdec.load_default_model()
    ids, mask = spec_bench_batch(tok, 4)
    log = StepLog()
    log.install()

    def call(name: str) -> dict:
        assistant = NullAssistant() if name == "null" else hf_specdec.load_default_assistant(name)
        log.steps, log.predicted, log.audit = [], None, Counter()
        start = time.process_time()
        model.generate(
            ids, attention_mask=mask, max_new_tokens=args.max_new_tokens, do_sample=False, assistant=assistant
        )
        return {"method": name, "cpu_s": round(time.process_time() - start, 3), **log.summary()}

    runs = []
    with hf_specdec.packed_weights(model):
        call("null"), call(args.method)  # warm-up: packing, GEMM trials, the cost curve
        for rep in range(args.reps):
            for name in ("null", args.method) if rep % 2 == 0 else (args.method, "null"):
                runs.append(call(name))
                print(json.dumps(runs[-1]), flush=True)
    totals = {m: round(sum(r["cpu_s"] for r in runs if r["method"] == m), 3) for m in ("null", args.method)}
    record = {"what": __doc__.splitlines()[0], "method": args.method, "reps": args.reps,
              "max_new_tokens": args.max_new_tokens, "cpu_s_total": totals, "runs": runs}  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(totals))


if __name__ == "__main__":
    main()
