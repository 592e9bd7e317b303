"""EAGLE's data-scaling curve: what each doubling of training tokens buys (docs/heads_training.md, "The data-scaling
curve on a CPU").

For each token count N, a fresh EAGLE-1 head is trained on the first N tokens of one data folder (whole
sequences in build order: what a build stopped at N tokens would have given, `load_distillation_data(max_tokens=)`),
with the same schedule at every point (``--epochs`` passes, so compute grows with the data). Each head is scored on

- a fixed held-out set: ShareGPT's held-out split (conversations no training data holds), teacher-forced through the
  float32 target; the top-1 / top-4 of the first draft token at every answer position (`evaluate_eagle`);
- the target's greedy answers to the bench's Spec-Bench sample (evaluation only, never trained on), for each
  ``--bench-seeds``: teacher-forced top-1 and chain τ, as ``hf-specdec eval-heads`` reports them.

Each point keeps its run folder under ``--work`` (``eagle-N-bf16/`` or ``-fp32/``: checkpoints, head, ``scaling_row.json``), so a
rerun resumes a stopped run and reuses finished ones, and two processes can train different points side by side
(build the held-out set first: ``--points`` left empty does only that). The JSON at ``--out`` lists every finished
point of the work folder. ``--online CONVERSATIONS`` trains each point online instead (`OnlineTeacherForcing`: the
same conversations teacher-forced by a bfloat16 copy of the target at every step, nothing stored; run folders
``eagle-N-bf16-online/``): equal data, so the two columns compare storing the states with computing them.

    python benchmarks/eagle_data_scaling.py --data DATA/fixed --work scaling --out docs/results/scaling.json \\
        --mixed-precision bf16 --points 500000 1000000 2000000 4000000
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from hf_specdec.bench.head_eval import bench_answers_folder, build_bench_answers, evaluate_heads, load_bench_answers
from hf_specdec.heads.hub import without_local_paths
from hf_specdec.models import cache_root, load_default_model
from hf_specdec.training.benchmark_questions import find_questions_file
from hf_specdec.training.conversation_data import build_conversation_data, online_conversation_data
from hf_specdec.training.eagle import EagleTrainingConfig, evaluate_eagle, train_eagle
from hf_specdec.training.online_states import OnlineTeacherForcing
from hf_specdec.training.shards import load_distillation_data

ROW_NAME = "scaling_row.json"


def held_out_set(model, tokenizer, work: Path, conversations: int) -> Path:
    """The fixed held-out data: the first ``conversations`` of ShareGPT's held-out split, teacher-forced through
    ``model`` (built once into ``work/heldout``)."""
    return build_conversation_data(model, tokenizer, work / "heldout", mode="fixed", split="held_out",
                                   num_conversations=conversations)[0]  # fmt: skip


def run_name(tokens: int, mixed_precision: str, online: bool = False, init_layer: int | None = None) -> str:
    """The run folder of a point: ``eagle-<tokens>-bf16`` or ``eagle-<tokens>-fp32``, ``-online`` appended for a
    point trained online, ``-init<L>`` for a head whose layer started as target layer L."""
    suffix = ("-online" if online else "") + ("" if init_layer is None else f"-init{init_layer}")
    return f"eagle-{tokens}-{'bf16' if mixed_precision == 'bf16' else 'fp32'}{suffix}"


def train_point(model, data, tokens: int, work: Path, cfg: EagleTrainingConfig) -> tuple[object, dict]:
    """``(head, training report)`` of the point ``tokens``, trained in ``work/eagle-<tokens>...`` (resumed there)
    on the data folder ``data``, or online (``data`` an `OnlineTeacherForcing`)."""
    from hf_specdec.heads.eagle import EagleHead

    online = isinstance(data, OnlineTeacherForcing)
    out = work / run_name(tokens, cfg.mixed_precision, online, cfg.init_layer)
    report_path = out / "training_report.json"
    if report_path.is_file() and (out / "head" / "config.json").is_file():
        head = EagleHead.from_pretrained(out / "head", dtype=torch.float32).bind(model)
        return head, json.loads(report_path.read_text())
    if online:
        return train_eagle(model, data.first_tokens(tokens), out, cfg, resume=True)
    wait_for_tokens(data, tokens)
    return train_eagle(model, load_distillation_data(data, with_aux=False, max_tokens=tokens), out, cfg, resume=True)


def wait_for_tokens(data_dir: Path, tokens: int, poll_s: float = 30.0) -> None:
    """Return once ``data_dir``'s finished shards hold ``tokens`` tokens, or its build is complete: a point can
    start beside a build still running in another process without training on less than it says."""
    while True:
        path = data_dir / "manifest.json"  # written once the build's first shard is
        manifest = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {"shards": []}
        built = sum(shard["num_tokens"] for shard in manifest["shards"])
        if built >= tokens or manifest.get("complete"):
            return
        print(f"waiting for the build: {built:,} of {tokens:,} tokens", flush=True)
        time.sleep(poll_s)


def score_point(model, tokenizer, head, report: dict, held: Path, bench_seeds: list[int]) -> dict:
    """The point's row: its training data and time, held-out top-1 / top-4, and per bench seed top-1 / chain τ."""
    held_data = load_distillation_data(held)
    scores = evaluate_eagle(head, held_data, torch.arange(held_data.seq_bounds.shape[0]), None)
    row = {
        "tokens": report["num_tokens"],
        "sequences": report["num_sequences"],
        "train_windows": report["train_positions"],
        "steps": report["steps"],
        "training_time_s": report["training_time_s"],
        "online": bool(report.get("online")),
        "target_forward_tokens": report.get("target_forward_tokens"),
        "mixed_precision": report["config"].get("mixed_precision", "no"),
        "init_layer": report["config"].get("init_layer"),
        "own_split_top1": (report.get("held_out") or {}).get("top1"),
        "held_out_top1": scores["top1"],
        "held_out_top4": scores["top4"],
        "held_out_positions": scores["positions"],
    }
    for seed in bench_seeds:
        folder = bench_answers_folder(cache_root(), 4, seed, 128)
        build_bench_answers(model, tokenizer, find_questions_file(), folder, 4, seed, 128)
        data, categories = load_bench_answers(folder)
        overall = [r for r in evaluate_heads(model, data, {"eagle": head}, categories) if r["category"] == "overall"]
        row[f"bench_seed{seed}_top1"] = overall[0]["top1"][0]
        row[f"bench_seed{seed}_chain_tau"] = overall[0]["chain"]["tau"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default=None, help="the training data folder (built in order, e.g. ShareGPT)")
    parser.add_argument(
        "--online",
        type=int,
        default=None,
        metavar="CONVERSATIONS",
        help="instead of --data: the first CONVERSATIONS ShareGPT training conversations (seed 0, 1,024 tokens), "
        "teacher-forced by a bfloat16 copy of the target while each point trains (nothing stored)",
    )
    parser.add_argument("--work", required=True, help="folder of the runs and the held-out set")
    parser.add_argument("--out", default=None, help="write every finished point of --work here (JSON)")
    parser.add_argument("--points", nargs="*", type=int, default=[], help="training tokens of each point")
    parser.add_argument("--epochs", type=float, default=2.0, help="passes over each point's data (default 2)")
    parser.add_argument("--mixed-precision", choices=("no", "bf16"), default="bf16")
    parser.add_argument("--held-out-conversations", type=int, default=160)
    parser.add_argument("--eval-fraction", type=float, default=0.02, help="of the sequences, held out by the trainer")
    parser.add_argument("--bench-seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--init-layer",
        type=int,
        default=None,
        help="start each head's layer as this target layer (run folders eagle-N-...-init<L>)",
    )
    args = parser.parse_args()
    if (args.data is None) == (args.online is None):
        parser.error("pass --data FOLDER or --online CONVERSATIONS")
    torch.set_num_threads(args.threads)
    work = Path(args.work)
    model, tokenizer = load_default_model()
    held = held_out_set(model, tokenizer, work, args.held_out_conversations)
    cfg = EagleTrainingConfig(window=512, positions_per_step=8, lr=1e-3, epochs=args.epochs, eval_every=0,
                              checkpoint_every=100, mixed_precision=args.mixed_precision,
                              eval_fraction=args.eval_fraction, init_layer=args.init_layer)  # fmt: skip
    data = Path(args.data) if args.data else online_data(model, tokenizer, args.online)
    for tokens in args.points:
        t0 = time.perf_counter()
        head, report = train_point(model, data, tokens, work, cfg)
        row = {"point": tokens, **score_point(model, tokenizer, head, report, held, args.bench_seeds)}
        row["wall_s"] = round(time.perf_counter() - t0, 1)
        folder = work / run_name(tokens, args.mixed_precision, args.online is not None, args.init_layer)
        (folder / ROW_NAME).write_text(json.dumps(row, indent=1) + "\n")
        print(json.dumps(row), flush=True)
    if args.out:
        rows = [json.loads(p.read_text()) for p in work.glob(f"eagle-*/{ROW_NAME}")]
        rows.sort(key=lambda r: (r.get("online", False), r.get("init_layer") is not None, r["mixed_precision"],
                                 r["point"]))  # fmt: skip
        Path(args.out).write_text(json.dumps({"data": data_entry(data), "epochs": args.epochs, "rows": rows},
                                             indent=1) + "\n")  # fmt: skip


def online_data(model, tokenizer, conversations: int) -> OnlineTeacherForcing:
    """``--online``: the conversations the curve's data folders are built from (the first ``conversations`` in
    seed-0 order, 1,024 tokens each), teacher-forced by a bfloat16 copy of ``model`` while training."""
    import copy

    builder = copy.deepcopy(model).to(torch.bfloat16).eval()
    return online_conversation_data(builder, tokenizer, num_conversations=conversations, seed=0, max_tokens=1024)


def data_entry(data) -> dict:
    """The results file's description of the data: the data folder's manifest, or the online source's."""
    if isinstance(data, OnlineTeacherForcing):
        manifest = data.tokens.manifest
        entry = {key: manifest.get(key) for key in ("base_model", "prompt_recipe", "target_dtype")}
        entry.update(online=True, tokens=manifest["num_tokens"])
    else:
        manifest = json.loads((data / "manifest.json").read_text(encoding="utf-8"))
        entry = {key: manifest.get(key) for key in ("base_model", "prompt_recipe", "target_dtype", "hidden_dtype")}
        entry["built_tokens"] = sum(shard["num_tokens"] for shard in manifest["shards"])
    entry["base_model"] = without_local_paths(str(entry["base_model"]))  # a results file is public
    return entry


if __name__ == "__main__":
    main()
