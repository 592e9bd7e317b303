"""MLP speculator training by self-distillation (Wertheimer et al. 2024, arXiv:2404.19124, stage 2 of their recipe:
the base model frozen, the speculator learning the base model's own outputs).

Data comes from `hf_specdec.training.shards`: the target's own answers and its cached final hidden states, so a step
never runs the target. At a position t, stage 0 reads ``hidden[t]`` and the token at t + 1 (the root); stage k reads
stage k - 1's state and the token at t + 1 + k (teacher-forced with the target's tokens) and is trained with
cross-entropy against the token at t + 2 + k, the target's own next token (weight ``decay ** k``). Over a truncated
draft vocabulary (the ``draft_vocab`` most frequent answer tokens) a label outside it is left out of the loss and
counts as a miss in the held-out accuracy.

`tune_speculator_tree` then picks the tree: for a few candidate widths per depth it drafts the real trees
(`draft_tree_batch`, as decoding does) at held-out positions, measures how deep each is accepted along the target's
continuation and divides the resulting tau by the step cost measured on this machine (`step_cost_curve`).

    spec, report = train_mlp_speculator("out/data", "out", MLPSpeculatorTrainingConfig())
    tuning = tune_speculator_tree(spec, data, positions, model)

Checkpoints (speculator, optimizer, scheduler, step) go to ``out/checkpoints``; ``resume=True`` continues from the
latest one.
"""

from __future__ import annotations

import argparse
import copy
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..generation.proposers.mlp_speculator import check_widths, draft_tree_batch
from ..heads.mlp_speculator import MLPSpeculator
from .labels import IGNORE, draft_vocabulary, medusa_labels
from .run import REPORT_NAME, RunConfig, TrainingRun, check_mixed_precision, held_out_split, trainable_copy
from .shards import DistillationData, load_distillation_data, write_json
from .step_cost import step_cost_curve
from .trainer_cli import TrainerCommand, load_target, non_negative_int, positive_float, positive_int

# level widths tried by `tune_speculator_tree` (each also cut at every depth by the tree budget at run time)
DEFAULT_WIDTH_CANDIDATES = ((1, 1, 1, 1), (2, 2, 2, 2), (3, 2, 2, 2), (3, 3, 3, 3), (4, 4, 4, 4), (4, 6, 6, 6))


@dataclass
class MLPSpeculatorTrainingConfig(RunConfig):
    """Hyper-parameters of `train_mlp_speculator` (the schedule, held-out split and checkpoints: `RunConfig`'s).

    Args:
        inner_dim / n_predict / tie_weights / scale_input / top_k_tokens_per_head: the `MLPSpeculator` shape.
        draft_vocab: predict over the ``draft_vocab`` most frequent answer tokens only (None: the full vocabulary).
        decay: stage k's loss weight is ``decay ** k``.
    """

    inner_dim: int = 384
    n_predict: int = 4
    tie_weights: bool = True
    scale_input: bool = True
    top_k_tokens_per_head: tuple[int, ...] = (4, 3, 2, 2)
    draft_vocab: int | None = 8192
    decay: float = 0.8
    epochs: float = 3.0
    lr: float = 2e-3

    def __post_init__(self):
        check_mixed_precision(self.mixed_precision)
        self.top_k_tokens_per_head = tuple(int(k) for k in self.top_k_tokens_per_head)
        if len(self.top_k_tokens_per_head) != self.n_predict:
            raise ValueError(f"top_k_tokens_per_head needs n_predict={self.n_predict} entries")
        if self.positions_per_step < 1 or self.n_predict < 1:
            raise ValueError("positions_per_step and n_predict must be at least 1")


# ---------------------------------------------------------------------------------------------------- batches
def stage_inputs(data: DistillationData, positions: torch.Tensor, n: int) -> torch.Tensor:
    """`[P, n]` int64: the token at t + 1 + k fed to stage k at position t (clamped to the sequence; where it is
    clamped, stage k's label is ``IGNORE``)."""
    k = torch.arange(n).unsqueeze(0)  # [1, n]
    idx = torch.minimum(positions.unsqueeze(1) + 1 + k, data.seq_end[positions].unsqueeze(1) - 1)  # [P, n]
    return data.input_ids[idx]


def speculator_loss(
    spec: MLPSpeculator, hidden: torch.Tensor, inputs: torch.Tensor, labels: torch.Tensor, decay: float
) -> tuple[torch.Tensor, ...]:
    """Teacher-forced loss of every stage.

    Args:
        spec: the speculator.
        hidden: `[P, H]` base hidden states at the positions.
        inputs: `[P, n]` tokens fed to the stages (`stage_inputs`).
        labels: `[n, P]` token ids each stage must guess (`medusa_labels`: token t + 2 + k), ``IGNORE`` where none.
        decay: stage k's weight is ``decay ** k``.
    Returns:
        ``(loss, per-stage loss [n], per-stage correct top-1 [n], per-stage labelled positions [n], per-stage
        positions in the cross-entropy [n])``: a label outside the draft vocabulary is a miss, left out of the loss.
    """
    n = labels.shape[0]
    logits = spec(hidden, inputs[:, :n]).float()  # [n, P, V']
    valid = labels >= 0  # [n, P]
    target = spec.emb_rows(labels.clamp(min=0))  # [n, P] draft index; V' (the OOV row) outside the draft vocabulary
    in_vocab = valid & (target < logits.shape[-1])
    target = torch.where(in_vocab, target, torch.full_like(target, IGNORE))
    per_pos = F.cross_entropy(logits.transpose(1, 2), target, ignore_index=IGNORE, reduction="none")  # [n, P]
    per_stage = per_pos.sum(1) / in_vocab.sum(1).clamp(min=1)
    weights = decay ** torch.arange(n, device=per_stage.device, dtype=per_stage.dtype)
    correct = ((logits.argmax(-1) == target) & in_vocab).sum(1)
    return (weights * per_stage).sum(), per_stage.detach(), correct, valid.sum(1), in_vocab.sum(1)


def _batch(data: DistillationData, positions: torch.Tensor, n: int, device) -> tuple[torch.Tensor, ...]:
    hidden = data.hidden[positions].to(device=device, dtype=torch.float32)  # [P, H]
    return hidden, stage_inputs(data, positions, n).to(device), medusa_labels(data, positions, n).to(device)


@torch.no_grad()
def evaluate_mlp_speculator(
    spec: MLPSpeculator, data: DistillationData, positions: torch.Tensor, decay: float = 0.8, chunk: int = 256
) -> dict:
    """Held-out teacher-forced metrics: per-stage top-1 accuracy (= the top-1 acceptance of stage k given the
    earlier stages were right), per-stage cross-entropy and the weighted loss.

    Returns:
        ``{"loss", "loss_per_stage", "top1_per_stage", "positions_per_stage"}`` (plain Python numbers).
    """
    was_training = spec.training
    spec.eval()
    device = spec.proj[0].weight.device
    n = spec.n_predict
    loss_sum, correct, counts, ce_counts = torch.zeros(n, dtype=torch.float64), torch.zeros(n), torch.zeros(n), 0
    for start in range(0, positions.numel(), chunk):
        hidden, inputs, labels = _batch(data, positions[start : start + chunk], n, device)
        _, per_stage, c, m, in_vocab = speculator_loss(spec, hidden, inputs, labels, decay)
        loss_sum += (per_stage * in_vocab).double().cpu()
        ce_counts = ce_counts + in_vocab.cpu()
        correct += c.cpu()
        counts += m.cpu()
    spec.train(was_training)
    per_stage = (loss_sum / torch.as_tensor(ce_counts).clamp(min=1)).tolist()
    return {
        "loss": float(sum(decay**k * x for k, x in enumerate(per_stage))),
        "loss_per_stage": [round(x, 4) for x in per_stage],
        "top1_per_stage": [round(c / max(1.0, m), 4) for c, m in zip(correct.tolist(), counts.tolist())],
        "positions_per_stage": [int(m) for m in counts.tolist()],
    }


# ---------------------------------------------------------------------------------------------------- trees
@torch.no_grad()
def tree_accepted_depths(
    spec: MLPSpeculator, data: DistillationData, positions: torch.Tensor, widths: Sequence[int], chunk: int = 256
) -> torch.Tensor:
    """`[P]` int64: how many draft tokens greedy verification would accept from the tree drafted at each position.

    At position t the root is the token at t + 1 and the target's continuation is ``input_ids[t + 2 ...]`` (greedy
    self-distillation data is what greedy decoding verifies); a node matches when its token is the continuation's
    token at its depth and its parent matches.
    """
    widths = check_widths(widths, spec)
    device = spec.proj[0].weight.device
    out = []
    for start in range(0, positions.numel(), chunk):
        pos = positions[start : start + chunk]
        roots = data.input_ids[pos + 1].to(device)  # [p]
        tokens, parent, _ = draft_tree_batch(spec, data.hidden[pos].to(device).float(), roots, widths)  # [p, N]
        labels = medusa_labels(data, pos, len(widths)).T.to(device)  # [p, D], IGNORE never matches a token
        match = torch.zeros_like(tokens, dtype=torch.bool)  # [p, N]
        depth_of = torch.zeros(tokens.shape[1], dtype=torch.long)
        lo = 0
        for d, width in enumerate(widths):
            hi = lo + width
            hit = tokens[:, lo:hi] == labels[:, d : d + 1]
            if d:
                hit &= match.gather(1, parent[:, lo:hi])
            match[:, lo:hi] = hit
            depth_of[lo:hi] = d + 1
            lo = hi
        out.append((match.long() * depth_of.to(device)).amax(1).cpu() if tokens.shape[1] else torch.zeros(len(pos)))
    return torch.cat(out).long() if out else torch.zeros(0, dtype=torch.long)


def _conditional_acceptance(accepted: torch.Tensor, depth: int) -> list[float]:
    """``q[k]`` = P(accepted depth > k | accepted depth >= k), reported with the chosen widths."""
    return [round(float((accepted > k).sum()) / max(1, int((accepted >= k).sum())), 4) for k in range(depth)]


def _fits(widths: list[int], spec: MLPSpeculator) -> bool:
    try:
        check_widths(widths, spec)
    except ValueError:
        return False
    return True


def tune_speculator_tree(
    spec: MLPSpeculator,
    data: DistillationData,
    positions: torch.Tensor,
    model: torch.nn.Module | None = None,
    candidates: Sequence[Sequence[int]] = DEFAULT_WIDTH_CANDIDATES,
    cost: dict[int, float] | None = None,
    context: int = 384,
) -> list[dict]:
    """Pick the level widths with the best predicted speedup ``tau / cost`` and store them in ``spec.tree``.

    Every candidate is cut at every depth too (the loop's tree budget may cut it so at run time): a cut at depth c accepts
    ``min(accepted, c)``. ``cost[n]`` is measured with `step_cost_curve` on ``model`` (the speculator drafting the
    widest candidate after every verify forward) unless given.

    Returns:
        one row per (candidate, depth): ``widths``, ``nodes``, ``tau``, ``cost``, ``predicted_speedup``; the chosen
        one is in ``spec.tree`` (``widths``, ``step_cost``, ``depth_acceptance``, ``held_out_tau``, ...).
    """
    candidates = [list(c)[: spec.n_predict] for c in candidates]
    candidates = [c for c in candidates if _fits(c, spec)]  # e.g. wider than the speculator's top-k allows
    if not candidates:
        raise ValueError(f"none of the candidate widths fits this speculator (top_k {spec.top_k_tokens_per_head})")
    depths = {tuple(c): tree_accepted_depths(spec, data, positions, c) for c in candidates}
    sizes = sorted({sum(c[:d]) for c in candidates for d in range(1, len(c) + 1)})
    if cost is None:
        if model is None:
            raise ValueError("tune_speculator_tree needs the target model to measure the step cost (or cost=...)")
        device = spec.proj[0].weight.device
        hidden, root = torch.randn(1, spec.emb_dim, device=device), torch.zeros(1, dtype=torch.long)
        widest = max(candidates, key=sum)
        cost = step_cost_curve(model, sizes, lambda: draft_tree_batch(spec, hidden, root, widest), context)
    rows = [{"widths": [], "nodes": 0, "tau": 1.0, "cost": 1.0, "predicted_speedup": 1.0}]
    for c in candidates:
        accepted = depths[tuple(c)]
        for d in range(1, len(c) + 1):
            tau = 1.0 + float(accepted.clamp(max=d).float().mean()) if accepted.numel() else 1.0
            c_n = float(cost[sum(c[:d])])
            rows.append({"widths": c[:d], "nodes": sum(c[:d]), "tau": round(tau, 4), "cost": round(c_n, 4),
                         "predicted_speedup": round(tau / c_n, 4)})  # fmt: skip
    best = max(rows, key=lambda r: r["predicted_speedup"])
    # the full-depth candidate containing the best cut: the tree budget cuts it per row at run time
    full = next((c for c in candidates if c[: len(best["widths"])] == best["widths"]), best["widths"]) or [1]
    spec.tree = {
        "widths": full,
        "step_cost": {str(n): round(float(c), 4) for n, c in sorted(cost.items())},
        "depth_acceptance": _conditional_acceptance(depths.get(tuple(full), torch.zeros(0)), len(full)),
        "held_out_tau": best["tau"],
        "best_cut": best["widths"],
        "predicted_speedup": best["predicted_speedup"],
        "chosen_by": "held-out tree acceptance x step cost measured on the training machine",
    }
    return rows


# ---------------------------------------------------------------------------------------------------- training
def _draft_vocab(data: DistillationData, train_pos: torch.Tensor, cfg: MLPSpeculatorTrainingConfig):
    """``(token map [V'] or None, share of the stage-0 training labels it covers)``."""
    if cfg.draft_vocab is None or cfg.draft_vocab >= int(data.manifest["vocab_size"]):
        return None, 1.0
    return draft_vocabulary(data, train_pos, cfg.draft_vocab)


def _fresh_speculator(cfg: MLPSpeculatorTrainingConfig, data: DistillationData, token_map, base: str | None):
    spec = MLPSpeculator(
        emb_dim=int(data.hidden.shape[1]),
        inner_dim=cfg.inner_dim,
        vocab_size=int(data.manifest["vocab_size"]),
        n_predict=cfg.n_predict,
        top_k_tokens_per_head=list(cfg.top_k_tokens_per_head),
        tie_weights=cfg.tie_weights,
        scale_input=cfg.scale_input,
        draft_vocab_size=None if token_map is None else int(token_map.numel()),
        base_model_name_or_path=base,
    )
    if token_map is not None:
        spec.token_map.copy_(token_map)
    return spec


def train_mlp_speculator(
    data: str | os.PathLike | Sequence[str | os.PathLike] | DistillationData,
    out_dir: str | os.PathLike,
    config: MLPSpeculatorTrainingConfig | None = None,
    *,
    resume: bool = False,
    base_model_name_or_path: str | None = None,
    progress: bool = True,
    device: str | torch.device = "cpu",
    init_speculator: MLPSpeculator | None = None,
) -> tuple[MLPSpeculator, dict]:
    """Train an MLP speculator on cached self-distillation data and save it to ``out_dir`` (`save_pretrained`).

    Args:
        data: data folder(s) (`build_distillation_data`) or loaded `DistillationData`.
        out_dir: where the speculator (``config.json``, ``model.safetensors``, ``README.md``),
            ``training_report.json`` and ``checkpoints/`` go.
        config: hyper-parameters (default `MLPSpeculatorTrainingConfig()`).
        resume: continue from the latest checkpoint in ``out_dir`` (refused otherwise when checkpoints exist).
        base_model_name_or_path: recorded in the config (default: the data manifest's base model).
        progress: tqdm bar.
        device: where to train.
        init_speculator: start from this speculator (a copy; fine-tuning): its shape and draft vocabulary are kept,
            the config's must agree.
    Returns:
        ``(speculator, report)``: the trained speculator (CPU, eval mode) and the training report dict.
    """
    cfg = config or MLPSpeculatorTrainingConfig()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = data if isinstance(data, DistillationData) else load_distillation_data(data)
    split = held_out_split(data, cfg.eval_fraction, cfg.eval_positions, cfg.seed, on_path=True)
    torch.manual_seed(cfg.seed)
    if init_speculator is not None:
        spec = trainable_copy(init_speculator, n_predict=cfg.n_predict, inner_dim=cfg.inner_dim)
        token_map = spec.token_map
        labels = medusa_labels(data, split.train_pos, 1)[0]
        coverage = float(torch.isin(labels, token_map).float().mean()) if token_map is not None else 1.0
        spec = spec.to(device).train()
    else:
        token_map, coverage = _draft_vocab(data, split.train_pos, cfg)
        base = base_model_name_or_path or data.manifest.get("base_model")
        spec = _fresh_speculator(cfg, data, token_map, base).to(device).train()
    same = ("inner_dim", "n_predict", "tie_weights", "scale_input", "draft_vocab", "positions_per_step", "seed")
    run, total = TrainingRun.start(out, cfg, spec, "speculator", split.train_pos.numel(), resume, same)

    def loss_of(pos: torch.Tensor) -> torch.Tensor:
        return speculator_loss(spec, *_batch(data, pos, cfg.n_predict, device), cfg.decay)[0]

    def evaluate() -> dict:
        return evaluate_mlp_speculator(spec, data, split.eval_pos, cfg.decay)

    held = evaluate if split.eval_pos.numel() else None
    before, after = run.train(
        split.train_pos, total, loss_of, held, desc="mlp speculator", metric="top1_per_stage", progress=progress
    )
    spec = spec.to("cpu").eval()
    report = {"base_model": spec.base_model_name_or_path, **run.report(data, split, before, after)}
    report["draft_vocab_coverage"] = round(coverage, 4) if token_map is not None else None
    spec.model_card = _model_card(report, data.manifest, cfg)
    spec.save_pretrained(out)
    write_json(out / REPORT_NAME, report)
    return spec, report


def _answer_tokens(manifest: dict) -> int:
    """Answer tokens of the data (also of a manifest whose build was stopped early: the sum over its shards)."""
    parts = manifest.get("parts") or [manifest]
    return sum(p.get("num_answer_tokens") or sum(s["num_answer_tokens"] for s in p.get("shards", [])) for p in parts)


def _model_card(report: dict, manifest: dict, cfg: MLPSpeculatorTrainingConfig) -> dict:
    """The model-card facts of a trained speculator, from its training report."""
    top1 = report["held_out"]["top1_per_stage"] if report["held_out"] else None
    return {
        "training_data": report["training_data"],
        "data_size": {
            "sequences": report["num_sequences"],
            "tokens": report["num_tokens"],
            "answer_tokens": _answer_tokens(manifest),
        },
        "training": {
            "steps": report["steps"],
            "time_s": report["training_time_s"],
            "lr": cfg.lr,
            "positions_per_step": cfg.positions_per_step,
            "draft_vocab": cfg.draft_vocab,
        },
        "held_out_top1_per_stage": top1,
        "tau": None,
        "speedup": None,
        "notes": f"Held-out teacher-forced top-1 per stage (stage k guesses token t + k + 2): {top1}."
        if top1
        else None,
    }


# ---------------------------------------------------------------------------------------------------- command line
SAVE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def save_in_dtype(spec: MLPSpeculator, out: str | Path, dtype: str) -> None:
    """``spec.save_pretrained(out)`` with its weights in ``dtype`` (a `SAVE_DTYPES` name); ``spec`` is unchanged."""
    cast = SAVE_DTYPES[dtype]
    (spec if cast == spec.emb[0].weight.dtype else copy.deepcopy(spec).to(cast)).save_pretrained(out)


# `hf-specdec train mlp-speculator`: the defaults are the recipe of the speculator shipped in the package
RECIPE = dict(num_prompts=256, num_context_prompts=0, prompt_seed=1, max_new_tokens=128, gen_batch_size=16)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``hf-specdec train mlp-speculator`` besides the shared ones (`trainer_cli`)."""
    d = MLPSpeculatorTrainingConfig()
    parser.add_argument("--num-prompts", type=positive_int, default=RECIPE["num_prompts"], help="generated prompts")
    parser.add_argument("--num-context-prompts", type=non_negative_int, default=RECIPE["num_context_prompts"],
                        help="stage-2 prompts: tasks over the model's own answers (0: none)")  # fmt: skip
    parser.add_argument(
        "--prompt-seed", type=non_negative_int, default=RECIPE["prompt_seed"], help="seed of the prompt set"
    )
    parser.add_argument(
        "--max-new-tokens", type=positive_int, default=RECIPE["max_new_tokens"], help="answer length cap"
    )
    parser.add_argument(
        "--gen-batch-size", type=positive_int, default=RECIPE["gen_batch_size"], help="prompts per generate"
    )
    parser.add_argument(
        "--inner-dim", type=non_negative_int, default=d.inner_dim, help=f"stage state size (default {d.inner_dim})"
    )
    parser.add_argument("--n-predict", type=positive_int, default=d.n_predict, help=f"stages (default {d.n_predict})")
    parser.add_argument("--no-tie-weights", action="store_true", help="one emb / head / norm per stage")
    parser.add_argument(
        "--draft-vocab", type=non_negative_int, default=d.draft_vocab, help="draft vocabulary size (0: full)"
    )
    parser.add_argument("--lr", type=positive_float, default=d.lr, help=f"AdamW learning rate (default {d.lr})")
    parser.add_argument(
        "--positions-per-step", type=positive_int, default=d.positions_per_step, help="positions per step"
    )
    parser.add_argument(
        "--checkpoint-every", type=non_negative_int, default=d.checkpoint_every, help="steps between checkpoints"
    )
    parser.add_argument(
        "--eval-every", type=non_negative_int, default=0, help="steps between held-out evaluations (0: at the end)"
    )
    parser.add_argument("--no-tune-tree", action="store_true", help="skip choosing the tree widths on this machine")
    parser.add_argument(
        "--save-dtype",
        choices=sorted(SAVE_DTYPES),
        default="float16",
        help="dtype of the saved weights (default float16, as shipped: half the file; training runs in float32)",
    )


def main(args: argparse.Namespace) -> int:
    """``hf-specdec train mlp-speculator``: self-distillation data from the target (the default model unless
    ``--model``; it stays on the CPU), or ``--data``; then the speculator (on ``--device``, default cpu), then its
    tree widths from held-out acceptance and this machine's step cost."""
    import sys

    from .default_data import build_default_data

    out = Path(args.out)
    model, tokenizer, model_name = load_target(args)
    if args.data:
        folders = [Path(f) for f in args.data]
    else:
        folders = build_default_data(model, tokenizer, Path(args.data_dir) if args.data_dir else out / "data",
                                     num_prompts=args.num_prompts, num_context_prompts=args.num_context_prompts,
                                     seed=args.prompt_seed, max_new_tokens=args.max_new_tokens,
                                     batch_size=args.gen_batch_size, base_model_name=model_name)  # fmt: skip
    data = load_distillation_data(folders, max_tokens=args.data_tokens)
    n = args.n_predict
    config = MLPSpeculatorTrainingConfig(
        inner_dim=args.inner_dim, n_predict=n, tie_weights=not args.no_tie_weights,
        top_k_tokens_per_head=(4, 3, 2, 2, 2, 2, 2, 2)[:n] if n <= 8 else (2,) * n, draft_vocab=args.draft_vocab or None,
        epochs=args.epochs, max_steps=args.max_steps, lr=args.lr, positions_per_step=args.positions_per_step,
        checkpoint_every=args.checkpoint_every, eval_every=args.eval_every, mixed_precision=args.mixed_precision,
    )  # fmt: skip
    spec, report = train_mlp_speculator(
        data, out, config, resume=args.resume, base_model_name_or_path=model_name, device=args.device or "cpu"
    )
    if not args.no_tune_tree:
        eval_pos = held_out_split(data, config.eval_fraction, config.eval_positions, config.seed, on_path=True).eval_pos
        report["tree_tuning"] = tune_speculator_tree(spec, data, eval_pos, model)
        write_json(out / REPORT_NAME, report)
    save_in_dtype(spec, out, args.save_dtype)
    top1 = (report["held_out"] or {}).get("top1_per_stage")
    print(f"[{report['steps']} steps in {report['training_time_s']:.0f} s; held-out top-1 per stage {top1}; tree "
          f"{spec.tree.get('widths')}; saved to {out}]", file=sys.stderr)  # fmt: skip
    return 0


MLP_SPECULATOR_COMMAND = TrainerCommand(
    "mlp-speculator", "an MLP speculator (IBM accelerator) by self-distillation", add_arguments, main
)


__all__ = [
    "MLP_SPECULATOR_COMMAND",
    "save_in_dtype",
    "DEFAULT_WIDTH_CANDIDATES",
    "RECIPE",
    "add_arguments",
    "main",
    "MLPSpeculatorTrainingConfig",
    "evaluate_mlp_speculator",
    "speculator_loss",
    "stage_inputs",
    "train_mlp_speculator",
    "tree_accepted_depths",
    "tune_speculator_tree",
]
