"""How Medusa heads for the default model improve with training data (docs/lab/changelog.md, "Data scaling").

Trains the shipped recipe (hyper-parameters from the heads' training_report.json) on random fractions of the
training sequences of its self-distillation data, and measures for each the exact τ of static Sequoia trees
(2, 16 and 64 nodes, chosen from held-out acceptance) on

- held-out sequences of the project's own data (the split training never sees), and
- the target's greedy answers to the bench's Spec-Bench sample (24 prompts, 128 tokens): evaluation only, never
  trained on.

Greedy verification accepts exactly the guesses that equal the target's greedy tokens, so τ over cached greedy
answers is what decoding with that tree would get. Fraction 1.0 measures the given heads without training.

    python benchmarks/medusa_data_scaling.py --data DATA DATA/context --heads hf_specdec/assets/medusa-smollm2-135m-instruct \
        --out scaling.json 1.0 0.5 0.25 0.125
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from hf_specdec.bench.questions import find_questions_file, load_questions, sample_questions
from hf_specdec.generation.tree_shapes import optimal_tree_choices
from hf_specdec.heads.medusa import MedusaHeads
from hf_specdec.models import DEFAULT_MODEL_NAME, chat_prompt_ids, load_default_model
from hf_specdec.training import MedusaTrainingConfig, build_distillation_data, load_distillation_data, train_medusa
from hf_specdec.training.labels import head_positions
from hf_specdec.training.medusa_tree import acceptance_table, guess_matches, tree_tau
from hf_specdec.training.run import split_sequences
from hf_specdec.training.shards import DistillationData

TREE_SIZES = (2, 16, 64)


def subset(data: DistillationData, seq_ids: torch.Tensor) -> DistillationData:
    """The sequences ``seq_ids`` of ``data`` as a dataset of their own."""
    bounds = data.seq_bounds[seq_ids]
    index = torch.cat([torch.arange(int(s), int(e)) for s, _, e in bounds.tolist()])
    lens, plens = bounds[:, 2] - bounds[:, 0], bounds[:, 1] - bounds[:, 0]
    return DistillationData.from_lengths(data.input_ids[index], data.hidden[index], lens, plens, dict(data.manifest))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("fractions", nargs="+", type=float)
    parser.add_argument("--data", nargs="+", required=True, help="the heads' self-distillation data folders")
    parser.add_argument("--heads", required=True, help="trained heads folder (its training_report.json = recipe)")
    parser.add_argument("--work", default="scaling_work", help="folder for the Spec-Bench answers and the runs")
    parser.add_argument("--out", default="scaling.json")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    work = Path(args.work)
    model, tokenizer = load_default_model()
    lm_head = model.get_output_embeddings()

    bench_dir = work / "spec_bench_answers"
    if not (bench_dir / "manifest.json").is_file():
        questions = sample_questions(load_questions(find_questions_file()), per_category=4, seed=0)
        prompts = [chat_prompt_ids(tokenizer, q["turns"][0])[0].tolist() for q in questions]
        build_distillation_data(model, prompts, bench_dir, max_new_tokens=128, base_model_name=DEFAULT_MODEL_NAME)
    bench = load_distillation_data(bench_dir)
    bench_positions = head_positions(bench, torch.arange(bench.seq_bounds.shape[0]))

    data = load_distillation_data(args.data)
    report = json.loads((Path(args.heads) / "training_report.json").read_text())
    config = MedusaTrainingConfig(**report["config"])
    train_ids, eval_ids = split_sequences(data, config.eval_fraction, config.seed)
    held_positions = head_positions(data, eval_ids)
    shuffled = train_ids[torch.randperm(train_ids.numel(), generator=torch.Generator().manual_seed(1))]

    rows = []
    for fraction in args.fractions:
        t0 = time.perf_counter()
        if fraction >= 1.0:
            heads, chosen = MedusaHeads.from_pretrained(args.heads), train_ids
        else:
            chosen = shuffled[: round(fraction * shuffled.numel())].sort().values
            run_config = dataclasses.replace(config, eval_positions=512)
            heads, _ = train_medusa(subset(data, chosen), work / f"run_{fraction}", lm_head, run_config, cpu=True)
        held = guess_matches(heads, data, held_positions, lm_head, k=8)
        on_bench = guess_matches(heads, bench, bench_positions, lm_head, k=8)
        acceptance = acceptance_table(held)
        row = {
            "fraction": fraction,
            "answers": int(chosen.numel()),
            "train_positions": int(head_positions(data, chosen).numel()),
            "train_s": round(time.perf_counter() - t0, 1),
            "top1_held_out": [round(float(held[:, d, 0].float().mean()), 3) for d in range(heads.num_heads)],
            "top1_spec_bench": [round(float(on_bench[:, d, 0].float().mean()), 3) for d in range(heads.num_heads)],
        }
        for n in TREE_SIZES:
            choices = optimal_tree_choices(acceptance, n)
            row[f"tau{n}_held_out"] = round(tree_tau(choices, held), 3)
            row[f"tau{n}_spec_bench"] = round(tree_tau(choices, on_bench), 3)
        print(json.dumps(row), flush=True)
        rows.append(row)
    Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
