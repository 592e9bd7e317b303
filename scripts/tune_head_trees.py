"""Size the trees of heads trained elsewhere (a GPU) on this machine, and write them where the package ships them.

    python scripts/tune_head_trees.py --eagle RUN/eagle --speculator RUN/spec --medusa RUN/medusa \
        --real-text-file local_text.json [--out hf_specdec/assets] [--data DIR]

The trees are chosen from held-out acceptance x the step cost measured here (`tune_eagle_tree`,
`tune_speculator_tree`, `tune_and_save_tree`), as the trainers do at the end of a CPU run. The held-out data is built
here with prompt seed 99 (no trainer seed; 16 seed-stage and 96 task prompts, ~6 minutes on 2 cores) unless --data
names folders. The speculator is stored in fp16, as shipped.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from hf_specdec import EagleHead, MedusaHeads, MLPSpeculator
from hf_specdec.models import load_default_model
from hf_specdec.training import MedusaTrainingConfig, load_distillation_data, tune_and_save_tree
from hf_specdec.training.eagle import tune_eagle_tree
from hf_specdec.training.mlp_speculator import tune_speculator_tree
from hf_specdec.training.run import held_out_split
from hf_specdec.training.task_data import build_task_data
from hf_specdec.training.text_sources import LocalText

NAMES = {"eagle": "eagle-smollm2-135m-instruct", "speculator": "mlp-speculator-smollm2-135m-instruct",
         "medusa": "medusa-smollm2-135m-instruct"}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--eagle", type=Path, help="train_eagle's output folder (holds head/ and training_report.json)")
    p.add_argument("--speculator", type=Path, help="train_mlp_speculator's output folder")
    p.add_argument("--medusa", type=Path, help="train_medusa's output folder")
    p.add_argument("--real-text-file", default=None, help="LocalText.save output (default: the installed packages)")
    p.add_argument("--data", nargs="+", default=None, help="held-out data folders instead of building them")
    p.add_argument("--out", type=Path, default=Path("hf_specdec/assets"))
    args = p.parse_args()
    model, tok = load_default_model()
    folders = args.data or build_task_data(
        model, tok, "tune-data-seed99", num_seed=16, num_tasks=96, seed=99, seed_max_new_tokens=160,
        real_text=LocalText.load(args.real_text_file) if args.real_text_file else True, max_new_tokens=128,
        batch_size=16, shard_size=16, hidden_dtype=torch.float16)  # fmt: skip
    data = load_distillation_data(folders)
    if args.eagle:
        head = EagleHead.from_pretrained(args.eagle / "head").bind(model)
        report = json.loads((args.eagle / "training_report.json").read_text())
        report["tree"] = tune_eagle_tree(model, head)
        head.save_pretrained(args.out / NAMES["eagle"])
        (args.out / NAMES["eagle"] / "training_report.json").write_text(json.dumps(report, indent=1) + "\n")
        print("eagle", head.tree)
    if args.speculator:
        spec = MLPSpeculator.from_pretrained(args.speculator)
        report = json.loads((args.speculator / "training_report.json").read_text())
        report["tree_tuning"] = tune_speculator_tree(spec, data, held_out_split(data, 0.99, 4096, 0).eval_pos, model)
        spec.half().save_pretrained(args.out / NAMES["speculator"])
        (args.out / NAMES["speculator"] / "training_report.json").write_text(json.dumps(report, indent=1) + "\n")
        print("speculator", spec.tree)
    if args.medusa:
        heads = MedusaHeads.from_pretrained(args.medusa)
        report = json.loads((args.medusa / "training_report.json").read_text())
        config = MedusaTrainingConfig(**{**report["config"], "eval_fraction": 0.99})  # all of it is held out here
        print(tune_and_save_tree(heads, data, args.out / NAMES["medusa"], model, config, report).markdown())


if __name__ == "__main__":
    main()
