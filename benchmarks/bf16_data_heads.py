"""Does a head trained on bf16-built data guess the fp32 target as well as one trained on fp32-built data?

The second half of `bf16_data_build.py` (run that first with ``--keep DIR``). The shipped EAGLE head is fine-tuned
with the same settings and seeds on each build, the fp32 build and the bf16 build of the same ShareGPT prompts. Each
result is scored the way `hf-specdec eval-heads` scores heads: teacher-forced top-1 and chain τ on the fp32
target's greedy answers to the bench's sample. The spread between seeds on the same data is the noise that the
bf16 − fp32 difference is compared with. The shipped head itself is the row both started from.

    python benchmarks/bf16_data_heads.py --data /tmp/bf16_keep --steps 60 --seeds 0 1 \
        --json docs/results/intel_bf16_data_heads.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from hf_specdec.assistants import EAGLE
from hf_specdec.bench.head_eval import ALL, bench_answers_folder, evaluate_heads, load_bench_answers
from hf_specdec.models import cache_root, load_default_model
from hf_specdec.training.eagle import EagleTrainingConfig, train_eagle
from hf_specdec.training.shards import load_distillation_data


def overall(rows: list[dict], name: str) -> dict:
    row = next(r for r in rows if r["head"] == name and r["category"] == ALL)
    return {"top1": row["chain"]["top1"], "tau": row["chain"]["tau"], "positions": row["chain"]["positions"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", required=True, help="the --keep folder of bf16_data_build.py (float32/, bfloat16/)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = load_default_model()
    folder = bench_answers_folder(cache_root(), 4, 0, 128)  # built by `hf-specdec eval-heads` (cached)
    bench, categories = load_bench_answers(folder)
    heads = {"shipped": EAGLE.load()}
    reports = {}
    for dtype in ("float32", "bfloat16"):
        data = load_distillation_data([Path(args.data) / dtype / "self"])
        for seed in args.seeds:
            cfg = EagleTrainingConfig(window=512, positions_per_step=8, lr=3e-4, max_steps=args.steps, epochs=100,
                                      eval_every=0, checkpoint_every=0, keep_checkpoints=1, seed=seed,
                                      warmup_steps=min(20, args.steps // 4))  # fmt: skip
            with tempfile.TemporaryDirectory() as out:
                head, report = train_eagle(model, data, out, cfg, progress=False, init_head=EAGLE.load())
            name = f"{dtype}-seed{seed}"
            heads[name] = head.eval()
            reports[name] = {"steps": report["steps"], "training_time_s": report["training_time_s"],
                             "answer_tokens": int(data.answer_mask.sum()), "held_out": report.get("held_out")}  # fmt: skip
            print(name, reports[name], flush=True)
    rows = evaluate_heads(model, bench, heads, categories)
    result = {"bench_answers": str(folder), "settings": vars(args), "training": reports,
              "bench": {name: overall(rows, name) for name in heads}, "rows": rows}  # fmt: skip
    print(json.dumps(result["bench"], indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
