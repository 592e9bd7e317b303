"""What training any head on self-distillation data shares: the held-out split, the schedule, checkpoints and resume,
and the step loop (`TrainingRun`). A trainer brings its module, its loss over a batch of positions and its held-out
evaluation; `hf_specdec.training.medusa` is one.

    run, total = TrainingRun.start(out, cfg, heads, "heads", split.train_pos.numel(), resume, same=("num_heads", "seed"))
    before, after = run.train(split.train_pos, total, loss_of, evaluate, desc="medusa heads", metric="top1_per_head")
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import math
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..heads.derived import dense_weight
from ..models import PLAIN_RENDERING
from .labels import head_positions
from .shards import DistillationData

CHECKPOINT_DIR = "checkpoints"
REPORT_NAME = "training_report.json"


# ---------------------------------------------------------------------------------------------------- config
@dataclass
class RunConfig:
    """The settings every trainer's config shares (`TrainingRun` reads them); a trainer's config subclasses it,
    adds its own fields and may change a default.

    Attributes:
        epochs: passes over the training positions (fractional allowed); ``max_steps`` caps the steps.
        positions_per_step: what one optimizer step trains on (positions or windows, sampled without replacement
            per epoch).
        lr / weight_decay / warmup_steps / max_grad_norm: AdamW, linear warm-up then cosine decay to 10 %, gradient
            clipping (0: none).
        eval_fraction / eval_positions: held-out sequences and how many of their positions are scored.
        eval_every / checkpoint_every: in steps (0: only at the end); ``keep_checkpoints``: how many stay on disk.
        seed: split, sampling order and init.
        mixed_precision: ``"no"``, or ``"bf16"``: each step's loss is computed under ``torch.autocast`` in bfloat16
            on the training device (the weights, optimizer and held-out scores stay float32). On a CPU with AMX or
            AVX512-BF16 a step then costs about half (docs/heads_training.md); Medusa's trainer also takes
            ``"fp16"``, through accelerate.
    """

    epochs: float = 1.0
    max_steps: int | None = None
    positions_per_step: int = 256
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 20
    max_grad_norm: float = 1.0
    eval_fraction: float = 0.05
    eval_positions: int = 2048
    eval_every: int = 0
    checkpoint_every: int = 200
    keep_checkpoints: int = 2
    seed: int = 0
    mixed_precision: str = "no"


# ---------------------------------------------------------------------------------------------------- positions
def split_sequences(data: DistillationData, eval_fraction: float, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(train, eval)`` sequence indices: a seeded random ``eval_fraction`` of the sequences (at least one, when
    there are two or more) is held out."""
    n = data.seq_bounds.shape[0]
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    n_eval = min(n - 1, max(1, round(n * eval_fraction))) if n > 1 and eval_fraction > 0 else 0
    return order[n_eval:].sort().values, order[:n_eval].sort().values


def start_head_training(model: nn.Module, data: DistillationData, out_dir, cfg, device):
    """What every head trainer does first: make ``out_dir``, seed torch with ``cfg.seed``, hold out
    ``cfg.eval_fraction`` of the sequences, read the target's lm_head weight `[V, H]` (`heads.derived.dense_weight`)
    and pick the training device (default: the lm_head's). Returns ``(out, train_seqs, eval_seqs, lm_weight,
    device)``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    train_seqs, eval_seqs = split_sequences(data, cfg.eval_fraction, cfg.seed)
    lm_weight = dense_weight(model.get_output_embeddings().weight)
    device = torch.device(device) if device is not None else lm_weight.device
    return out, train_seqs, eval_seqs, lm_weight, device


@dataclass
class HeldOutSplit:
    """Training and held-out sequences, and the positions trained on / scored."""

    train_seqs: torch.Tensor  # [S_train] sequence indices
    eval_seqs: torch.Tensor  # [S_eval]
    train_pos: torch.Tensor  # [P_train] positions t (token t + 2 is an answer token)
    eval_pos: torch.Tensor  # [P_eval] at most ``eval_positions`` of the held-out ones


def held_out_split(
    data: DistillationData, eval_fraction: float, eval_positions: int, seed: int, on_path: bool = False
) -> HeldOutSplit:
    """`split_sequences`, then their `head_positions` (a seeded sample of at most ``eval_positions`` held out).
    ``on_path``: only positions whose next token is on the target's path (`DistillationData.on_target_path`), for
    heads that guess beyond it (elsewhere every label of theirs is ignored)."""
    train_seqs, eval_seqs = split_sequences(data, eval_fraction, seed)
    train_pos, eval_pos = head_positions(data, train_seqs), head_positions(data, eval_seqs)
    if on_path:
        keep = data.on_target_path()  # [N] bool
        train_pos, eval_pos = train_pos[keep[train_pos]], eval_pos[keep[eval_pos]]
    if train_pos.numel() == 0:
        raise ValueError("the data holds no answer tokens to train on (every answer is shorter than 2 tokens)")
    if eval_pos.numel() > eval_positions:
        pick = torch.randperm(eval_pos.numel(), generator=torch.Generator().manual_seed(seed + 1))
        eval_pos = eval_pos[pick[:eval_positions]].sort().values
    return HeldOutSplit(train_seqs, eval_seqs, train_pos, eval_pos)


def trainable_copy(module: nn.Module, shared: Sequence[nn.Module] = (), **must_match) -> nn.Module:
    """A float32 copy of a trained head whose parameters all train: fine-tuning starts from it, the user's head is
    left as it was. Modules in ``shared`` (the target's, which a bound head refers to) are not copied.
    ``must_match``: ``name=value`` pairs the head's attribute ``name`` must equal (the run's config), else an error
    naming both."""
    for name, value in must_match.items():
        have = getattr(module, name)
        if value is not None and have != value:
            raise ValueError(f"the head to fine-tune has {name}={have!r}, the training config asks for {value!r}")
    head = copy.deepcopy(module, {id(m): m for m in shared}).float()
    for p in head.parameters():
        p.requires_grad_(True)
    return head


# ---------------------------------------------------------------------------------------------------- schedule
def lr_lambda(warmup: int, total: int) -> Callable[[int], float]:
    """Linear warm-up over ``warmup`` steps, then cosine decay to 10% at ``total``."""

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return f


def step_counts(num_positions: int, positions_per_step: int, epochs: float, max_steps: int | None) -> tuple[int, int]:
    """``(steps per epoch, total steps)``."""
    per_epoch = math.ceil(num_positions / positions_per_step)
    total = max(1, math.ceil(epochs * per_epoch))
    return per_epoch, min(total, max_steps) if max_steps is not None else total


def step_precision(mixed_precision: str, module: nn.Module) -> contextlib.AbstractContextManager:
    """The context a training step's loss is computed in (`RunConfig.mixed_precision`): bfloat16 autocast on the
    device of ``module``'s parameters for ``"bf16"``; nothing otherwise (``"fp16"`` is accelerate's, in Medusa's
    trainer)."""
    if mixed_precision != "bf16":
        return contextlib.nullcontext()
    device = next(module.parameters()).device
    return torch.autocast(device.type, dtype=torch.bfloat16)


def check_mixed_precision(value: str) -> None:
    """Refuse a `RunConfig.mixed_precision` that the plain-torch trainers (EAGLE, DFlash, the MLP speculator) cannot
    honour."""
    if value not in ("no", "bf16"):
        raise ValueError(f"mixed_precision must be 'no' or 'bf16' for this trainer, got {value!r}")


# ---------------------------------------------------------------------------------------------------- checkpoints
def _checkpoints(out_dir: Path) -> list[Path]:
    folder = out_dir / CHECKPOINT_DIR
    found = [(int(p.stem.split("-")[1]), p) for p in folder.glob("step-*.pt") if p.stem.split("-")[1].isdigit()]
    return [p for _, p in sorted(found)]


def latest_checkpoint(out_dir: str | os.PathLike) -> Path | None:
    """The newest ``checkpoints/step-N.pt`` under ``out_dir``, or None."""
    found = _checkpoints(Path(out_dir))
    return found[-1] if found else None


def save_checkpoint(out_dir: Path, state: dict, keep: int) -> Path:
    """Write ``state`` as ``checkpoints/step-N.pt`` (atomically) and keep only the newest ``keep``."""
    folder = out_dir / CHECKPOINT_DIR
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"step-{state['step']:07d}.pt"
    tmp = path.with_suffix(".pt.tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)
    for old in _checkpoints(out_dir)[:-keep] if keep > 0 else []:
        old.unlink(missing_ok=True)
    return path


def interrupted_summary(out: str | os.PathLike, made: Sequence[Path] = ()) -> str:
    """One line on what a training run stopped by Ctrl-C kept in its output folder ``out`` and how to go on; the
    folders in ``made`` (those the run created, deepest first) are removed when they hold no file."""
    out = Path(out)
    ckpt = latest_checkpoint(out) if out.is_dir() else None
    if ckpt is not None:
        step = int(ckpt.stem.split("-")[1])
        return (
            f"interrupted: kept {out} with its latest checkpoint {ckpt.relative_to(out)} (step {step}); run the same "
            "command with --resume to continue from it"
        )
    files = sorted(p for p in out.rglob("*") if p.is_file()) if out.is_dir() else []
    if files:
        shown = ", ".join(str(p.relative_to(out)) for p in files[:3]) + (", ..." if len(files) > 3 else "")
        return (
            f"interrupted before the first checkpoint: kept {out} ({len(files)} files: {shown}); run the same command "
            "again: a data build resumes after its last finished shard, training starts from step 0"
        )
    removed = []
    for folder in made:  # deepest first; only folders without a file in them
        if folder.is_dir() and not any(p.is_file() for p in folder.rglob("*")):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    if removed:
        return (
            f"interrupted before anything was written: removed the empty folder {removed[-1]} that the run made; "
            "nothing to resume: run the same command again to start"
        )
    return f"interrupted before anything was written to {out}; nothing to resume: run the same command again to start"


# ---------------------------------------------------------------------------------------------------- the run
@dataclass
class TrainingRun:
    """One training run's state: what is trained, its optimizer and schedule, where it checkpoints, and progress.

    Attributes:
        out: output folder (``checkpoints/`` inside).
        config: the trainer's config (a `RunConfig`).
        module: what is trained (unwrapped); its state goes into checkpoints under ``module_key``.
        module_key: the checkpoint key of ``module``'s state (``"heads"``, ``"speculator"``, ...).
        optimizer / scheduler: as built by the trainer.
        backward / clip: how to backpropagate and clip gradients (accelerate's, or plain torch by default).
        save: whether this process writes checkpoints (accelerate's main process).
        step / elapsed / history / losses: progress (restored by `resume`).
    """

    out: Path
    config: RunConfig
    module: nn.Module
    module_key: str
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    backward: Callable[[torch.Tensor], None] = torch.Tensor.backward
    clip: Callable[..., object] = torch.nn.utils.clip_grad_norm_
    save: bool = True
    step: int = 0
    elapsed: float = 0.0
    history: list[dict] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)  # this process's per-step training losses

    @classmethod
    def start(
        cls, out: Path, config: RunConfig, module: nn.Module, module_key: str, rows: int, resume: bool,
        same: Sequence[str],
    ) -> tuple[TrainingRun, int]:  # fmt: skip
        """``(run, total steps)``: a run over ``rows`` training rows (positions or windows) with every trainer's
        optimizer (AdamW over ``module``'s trainable parameters) and schedule (`lr_lambda` over the `step_counts`
        total), resumed from the latest checkpoint in ``out`` as `resume` says (``resume``, ``same``)."""
        _, total = step_counts(rows, config.positions_per_step, config.epochs, config.max_steps)
        params = [p for p in module.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(config.warmup_steps, total))
        run = cls(Path(out), config, module, module_key, optimizer, scheduler)
        run.resume(resume, same)
        return run, total

    def resume(self, resume: bool, same: Sequence[str]) -> None:
        """Continue from the latest checkpoint in ``out`` (refused unless ``resume``, and unless the config fields
        ``same`` match); no checkpoint: a fresh start."""
        ckpt = latest_checkpoint(self.out)
        if ckpt is None:
            return
        if not resume:
            raise FileExistsError(
                f"{self.out} already holds training checkpoints ({ckpt.name}); pass resume=True (CLI: --resume) to "
                "continue, or use another output folder"
            )
        state = torch.load(ckpt, map_location="cpu", weights_only=True)
        saved, now = state["config"], dataclasses.asdict(self.config)
        default = {f.name: f.default for f in dataclasses.fields(self.config)}  # a setting newer than the checkpoint
        for key in same:
            was = saved.get(key, default[key])
            if was != now[key]:
                raise ValueError(
                    f"cannot resume from {ckpt}: it was trained with {key}={was!r}, now {key}="
                    f"{now[key]!r}; use the same settings or another output folder"
                )
        self.module.load_state_dict(state[self.module_key])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step, self.elapsed, self.history = (
            int(state["step"]),
            float(state["elapsed"]),
            json.loads(state["history"]),
        )

    def checkpoint(self) -> None:
        state = {
            self.module_key: {k: v.detach().cpu() for k, v in self.module.state_dict().items()},
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "step": self.step,
            "elapsed": self.elapsed,
            "config": dataclasses.asdict(self.config),
            "history": json.dumps(self.history),
        }
        if self.save:
            save_checkpoint(self.out, state, self.config.keep_checkpoints)

    def _one_step(self, loss_of: Callable[[torch.Tensor], torch.Tensor], positions: torch.Tensor) -> None:
        with step_precision(self.config.mixed_precision, self.module):
            loss = loss_of(positions)
        self.backward(loss)
        if self.config.max_grad_norm:
            self.clip(self.module.parameters(), self.config.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.losses.append(loss.item())

    def train(
        self,
        train_pos: torch.Tensor,
        total: int,
        loss_of: Callable[[torch.Tensor], torch.Tensor],
        evaluate: Callable[[], dict] | None,
        *,
        desc: str,
        metric: str,
        progress: bool = True,
    ) -> tuple[dict | None, dict | None]:
        """Run from ``step`` to ``total`` steps over shuffled ``train_pos`` `[P, ...]` (``positions_per_step`` rows a step, a
        seeded order per epoch, so a resumed run sees the same batches), evaluating every ``eval_every`` steps and
        checkpointing every ``checkpoint_every`` and at the end.

        Args:
            loss_of: the scalar training loss of a batch of positions `[p]`.
            evaluate: held-out metrics (None: no held-out data); ``metric`` names the one shown while training.
        Returns:
            ``(before, after)``: held-out metrics before the first step (None on resume) and after the last.
        """
        from tqdm.auto import tqdm

        cfg = self.config
        before = None
        if self.step == 0 and evaluate is not None:
            before = evaluate()
            self.history.append({"step": 0, **before})
        per_epoch = math.ceil(train_pos.shape[0] / cfg.positions_per_step)
        bar = tqdm(total=total, initial=self.step, desc=desc, unit="step", disable=not progress)
        t_start, order, order_epoch = time.perf_counter() - self.elapsed, None, -1
        while self.step < total:
            epoch, index = divmod(self.step, per_epoch)
            if epoch != order_epoch:  # the same order after a resume: seeded by (seed, epoch)
                gen = torch.Generator().manual_seed(cfg.seed * 7919 + epoch)
                order, order_epoch = train_pos[torch.randperm(train_pos.shape[0], generator=gen)], epoch
            self._one_step(loss_of, order[index * cfg.positions_per_step : (index + 1) * cfg.positions_per_step])
            self.elapsed = time.perf_counter() - t_start
            bar.update(1)
            bar.set_postfix(loss=f"{self.losses[-1]:.3f}", lr=f"{self.scheduler.get_last_lr()[0]:.2e}")
            if cfg.eval_every and self.step % cfg.eval_every == 0 and self.step < total and evaluate is not None:
                self.history.append({"step": self.step, **evaluate()})
                bar.write(f"step {self.step}: held-out {metric} {self.history[-1][metric]}")
            if cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0:
                self.checkpoint()
        bar.close()
        self.elapsed = time.perf_counter() - t_start
        after = evaluate() if evaluate is not None else None
        if after is not None:
            self.history.append({"step": self.step, **after})
        self.checkpoint()
        return before, after

    def report(self, data: DistillationData, split: HeldOutSplit, before: dict | None, after: dict | None) -> dict:
        """The report fields every trainer writes (``training_report.json``); trainers add their own."""
        manifest, losses = data.manifest, self.losses
        return {
            "training_data": data_description(manifest),
            "data_dir": str(data.folder) if data.folder is not None else None,
            "prompt_recipe_seed": (manifest.get("prompt_recipe") or {}).get("seed"),
            "num_prompts": manifest.get("num_prompts"),
            "num_sequences": int(data.seq_bounds.shape[0]),
            "num_tokens": int(data.input_ids.numel()),
            "train_sequences": int(split.train_seqs.numel()),
            "eval_sequences": int(split.eval_seqs.numel()),
            "train_positions": int(split.train_pos.shape[0]),
            "eval_positions": int(split.eval_pos.numel()),
            "generation": manifest.get("generation"),
            "prompt_format": prompt_format(manifest),
            "steps": self.step,
            "training_time_s": round(self.elapsed, 1),
            "config": dataclasses.asdict(self.config),
            "train_loss_first_steps": round(sum(losses[:10]) / max(1, len(losses[:10])), 4),
            "train_loss_last_steps": round(sum(losses[-10:]) / max(1, len(losses[-10:])), 4),
            "held_out_before": before,
            "held_out": after,
            "history": self.history,
        }


def data_description(manifest: dict) -> str:
    """One line on the self-distillation data of ``manifest`` (for reports and model cards). Parts built the same
    way (the GPU recipe writes one per chunk of conversations or of task prompts, each task chunk with its own prompt
    seed) are summed into one clause naming their seeds; a local path of the base model keeps its last component
    only (a card is public)."""
    from ..heads.hub import without_local_paths

    groups: dict[
        tuple, list
    ] = {}  # (teacher-forced or "online", how, max new tokens, kind) -> [sequences, answers, planned, seeds]
    for part in manifest.get("parts") or [manifest]:
        recipe = part.get("prompt_recipe") or {}
        gen = part.get("generation") or {}
        shards = part.get("shards") or ([part] if part.get("online") else [])  # online: nothing stored
        stage = f", {recipe['stage']} stage" if recipe.get("stage") else ""
        teacher_forced = "online" if part.get("online") else bool(part.get("teacher_forced"))
        key = (teacher_forced, "sampled" if gen.get("do_sample") else "greedy",
               gen.get("max_new_tokens"), f"{recipe.get('kind', 'templates x topics')}{stage}")  # fmt: skip
        counts = groups.setdefault(key, [0, 0, 0, []])
        counts[0] += sum(sh["num_sequences"] for sh in shards)
        counts[1] += sum(sh.get("num_answer_tokens", 0) for sh in shards)
        counts[2] += part.get("num_prompts") or recipe.get("num_prompts") or 0
        if recipe.get("seed") not in counts[3]:
            counts[3].append(recipe.get("seed"))
    described = []
    for (teacher_forced, how, max_new, kind), (sequences, answers, planned, seeds) in groups.items():
        kind = f"{kind}, seed{'s' if len(seeds) > 1 else ''} {', '.join(str(seed) for seed in seeds)}"
        if teacher_forced:  # the conversations' own answers, labelled with the target's arg-max
            when = " while the head trained (online)" if teacher_forced == "online" else ""
            described.append(f"{sequences:,} of {planned:,} planned conversations teacher-forced through the target"
                             f"{when} ({answers:,} answer tokens labelled with its arg-max; {kind})")  # fmt: skip
        else:
            described.append(f"{sequences:,} {how} answers (max {max_new} new tokens, {answers:,} answer tokens) to "
                             f"{sequences:,} of {planned:,} planned prompts ({kind})")  # fmt: skip
    base = without_local_paths(str(manifest.get("base_model")))
    plain = f"; rendered as {PLAIN_RENDERING}" if PLAIN_RENDERING in (prompt_format(manifest) or "") else ""
    return f"distillation of {base}: " + "; ".join(described) + "; no benchmark questions" + plain


def prompt_format(manifest: dict) -> str | None:
    """How the text of ``manifest``'s data was rendered: each part's recipe ``chat_template``
    (`models.chat_rendering`; ``True`` in data recorded before it was named), the distinct ones joined; None where no
    part records it."""
    found: list[str] = []
    for part in manifest.get("parts") or [manifest]:
        value = (part.get("prompt_recipe") or {}).get("chat_template")
        value = "the tokenizer's chat template" if value is True else value
        if value and value not in found:
            found.append(value)
    return "; ".join(found) or None
