"""Medusa-1 training by self-distillation: the base model stays frozen, only the heads learn.

Data comes from `hf_specdec.training.shards` (the target's own answers and its cached final hidden states), so a
training step costs the heads' ResBlocks plus the lm_head projection, never a target forward. Head k, applied to the
hidden state at position t, is trained to predict token t + k + 2 (cross-entropy, weight ``decay ** k``; optionally
against the target's own distribution for that token, ``softmax(lm_head(hidden[t + k + 1]))``).

The lm_head is the cost (V = 49152 for SmolLM2: 57 MFLOP per position and head), so a step samples
``positions_per_step`` positions rather than whole sequences, and ``loss_vocab`` can restrict the training softmax to
the most frequent answer tokens. Held-out accuracy is always measured over the full vocabulary, as decoding sees it.

    heads, report = train_medusa("out/data", "out", lm_head=model.get_output_embeddings(), config=MedusaTrainingConfig())

Runs through `accelerate.Accelerator`, so the same code trains on CPU or GPU; checkpoints (heads, optimizer,
scheduler, step) go to ``out/checkpoints`` and ``resume=True`` continues from the latest one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..heads.medusa import MedusaHeads
from .labels import IGNORE, draft_vocabulary, medusa_labels
from .run import REPORT_NAME, RunConfig, TrainingRun, held_out_split, latest_checkpoint, trainable_copy
from .shards import DistillationData, load_distillation_data, write_json


@dataclass
class MedusaTrainingConfig(RunConfig):
    """Hyper-parameters of `train_medusa` (the schedule, held-out split and checkpoints: `RunConfig`'s).

    Args:
        num_heads / num_layers / share_lm_head: the `MedusaHeads` shape (share_lm_head reuses the frozen base lm_head).
        decay: head k's loss weight is ``decay ** k`` (Medusa: 0.8).
        distill: ``"hard"``: cross-entropy against the target's tokens; ``"soft"``: against the target's distribution.
        loss_vocab: train the softmax over the ``loss_vocab`` most frequent answer tokens only (None: full vocab).
        draft_vocab: with ``loss_vocab``, the heads also *draft* over that vocabulary only (``token_map``): decoding
            then projects onto ``loss_vocab`` lm_head rows per head instead of all of them (cheaper drafting; tokens
            outside it are never guessed).
        mixed_precision: ``"no"``, ``"bf16"`` or ``"fp16"`` (passed to `accelerate.Accelerator`).
    """

    num_heads: int = 4
    num_layers: int = 1
    share_lm_head: bool = True
    decay: float = 0.8
    distill: str = "hard"
    loss_vocab: int | None = None
    draft_vocab: bool = False
    mixed_precision: str = "no"

    def __post_init__(self):
        if self.distill not in ("hard", "soft"):
            raise ValueError(f"distill must be 'hard' or 'soft', got {self.distill!r}")
        if self.draft_vocab and self.loss_vocab is None:
            raise ValueError("draft_vocab needs loss_vocab (the size of the draft vocabulary)")
        if self.positions_per_step < 1 or self.num_heads < 1:
            raise ValueError("positions_per_step and num_heads must be at least 1")


# ---------------------------------------------------------------------------------------------------- loss
def _logits(heads: MedusaHeads, states: torch.Tensor, lm_weight, lm_bias, vocab: torch.Tensor | None) -> torch.Tensor:
    """`[n, P, V']` logits of the heads' states `[n, P, H]` over ``vocab`` (None: every token)."""
    if heads.share_lm_head:
        w = lm_weight if vocab is None else lm_weight[vocab]  # [V', H]
        b = None if lm_bias is None else (lm_bias if vocab is None else lm_bias[vocab])
        return F.linear(states.to(w.dtype), w, b)
    w = heads.lm_head_weight if vocab is None else heads.lm_head_weight[:, vocab]  # [n, V', H]
    return torch.bmm(states.to(w.dtype), w[: states.shape[0]].transpose(1, 2))


def medusa_loss(
    heads: MedusaHeads,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    lm_weight: torch.Tensor,
    lm_bias: torch.Tensor | None = None,
    decay: float = 0.8,
    vocab: torch.Tensor | None = None,
    teacher_hidden: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Medusa-1 loss over a batch of positions.

    Args:
        heads: the heads being trained.
        hidden: `[P, H]` base hidden states at the positions.
        labels: `[n, P]` target token of head k (`medusa_labels`), ``IGNORE`` where there is none.
        lm_weight / lm_bias: the base lm_head's `[V, H]` weight and `[V]` bias (or None).
        decay: head k's weight is ``decay ** k``.
        vocab: `[V']` token ids the softmax runs over (None: all); labels outside are ignored.
        teacher_hidden: `[n, P, H]` base hidden states at t + k + 1: the loss then uses the target's distribution
            ``softmax(lm_head(teacher_hidden))`` instead of the hard labels.
    Returns:
        ``(loss, per-head loss [n], per-head correct top-1 count [n], per-head scored positions [n])``; top-1 is over
        ``vocab``.
    """
    n = labels.shape[0]
    states = heads.head_states(hidden, n)  # [n, P, H]
    logits = _logits(heads, states, lm_weight, lm_bias, vocab).float()  # [n, P, V']
    if vocab is not None:
        remap = torch.full((lm_weight.shape[0],), IGNORE, dtype=torch.long, device=labels.device)
        remap[vocab] = torch.arange(vocab.numel(), device=labels.device)
        labels = torch.where(labels >= 0, remap[labels.clamp(min=0)], labels)
    valid = labels >= 0  # [n, P]
    counts = valid.sum(1)  # [n]
    if teacher_hidden is not None:
        with torch.no_grad():
            teacher = F.softmax(_teacher_logits(teacher_hidden, lm_weight, lm_bias, vocab).float(), dim=-1)
        per_pos = -(teacher * F.log_softmax(logits, dim=-1)).sum(-1)  # [n, P]
        per_pos = torch.where(valid, per_pos, torch.zeros_like(per_pos))
    else:
        per_pos = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=IGNORE, reduction="none")  # [n, P]
    per_head = per_pos.sum(1) / counts.clamp(min=1)
    weights = decay ** torch.arange(n, device=per_head.device, dtype=per_head.dtype)
    loss = (weights * per_head).sum()
    correct = ((logits.argmax(-1) == labels) & valid).sum(1)
    return loss, per_head.detach(), correct, counts


def _teacher_logits(teacher_hidden, lm_weight, lm_bias, vocab):
    w = lm_weight if vocab is None else lm_weight[vocab]
    b = None if lm_bias is None else (lm_bias if vocab is None else lm_bias[vocab])
    return F.linear(teacher_hidden.to(w.dtype), w, b)


def _batch(data: DistillationData, positions: torch.Tensor, num_heads: int, soft: bool, device, dtype):
    hidden = data.hidden[positions].to(device=device, dtype=dtype)  # [P, H]
    labels = medusa_labels(data, positions, num_heads).to(device)  # [n, P]
    teacher = None
    if soft:
        k = torch.arange(num_heads).unsqueeze(1)
        idx = (positions.unsqueeze(0) + k + 1).clamp(max=data.hidden.shape[0] - 1)  # [n, P]
        teacher = data.hidden[idx].to(device=device, dtype=dtype)  # [n, P, H]
    return hidden, labels, teacher


@torch.no_grad()
def evaluate_medusa(
    heads: MedusaHeads,
    data: DistillationData,
    positions: torch.Tensor,
    lm_weight: torch.Tensor,
    lm_bias: torch.Tensor | None = None,
    decay: float = 0.8,
    chunk: int = 256,
) -> dict:
    """Held-out metrics as decoding sees them: per-head top-1 accuracy and hard cross-entropy, the weighted loss.

    Heads with a truncated draft vocabulary (``token_map``) are scored over it: a label outside it counts as a miss
    (and is left out of the cross-entropy); otherwise over the full vocabulary.

    Args:
        heads: the heads (any device; the batch follows ``lm_weight``'s device).
        data: the cached data.
        positions: `[P]` positions to score (`head_positions` of the held-out sequences, possibly subsampled).
        lm_weight / lm_bias: the base lm_head.
        decay: loss weights, as in training.
        chunk: positions per forward (bounds the `[n, chunk, V]` logits).
    Returns:
        ``{"loss", "loss_per_head", "top1_per_head", "positions_per_head"}`` (plain Python numbers).
    """
    was_training = heads.training
    heads.eval()
    n = heads.num_heads
    loss_sum = torch.zeros(n, dtype=torch.float64)
    correct = torch.zeros(n, dtype=torch.long)
    counts = torch.zeros(n, dtype=torch.long)
    ce_counts = torch.zeros(n, dtype=torch.long)
    for start in range(0, positions.numel(), chunk):
        pos = positions[start : start + chunk]
        hidden, labels, _ = _batch(data, pos, n, False, lm_weight.device, lm_weight.dtype)
        vocab = None if heads.token_map is None else heads.token_map.to(lm_weight.device)
        _, per_head, c, m = medusa_loss(heads, hidden, labels, lm_weight, lm_bias, decay, vocab)
        loss_sum += (per_head * m).double().cpu()
        ce_counts += m.cpu()
        correct += c.cpu()
        counts += (labels >= 0).sum(1).cpu()
    heads.train(was_training)
    per_head = (loss_sum / ce_counts.clamp(min=1)).tolist()
    weights = [decay**k for k in range(n)]
    return {
        "loss": float(sum(w * x for w, x in zip(weights, per_head))),
        "loss_per_head": [round(x, 4) for x in per_head],
        "top1_per_head": [round(c / max(1, m), 4) for c, m in zip(correct.tolist(), counts.tolist())],
        "positions_per_head": counts.tolist(),
    }


# ---------------------------------------------------------------------------------------------------- training
def _frozen_lm_head(lm_head: nn.Module, data: DistillationData, device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The frozen base lm_head's weight `[V, H]` and bias `[V]` (or None) in fp32, checked against the data."""
    weight = lm_head.weight.detach().to(device=device, dtype=torch.float32)  # [V, H]
    bias = getattr(lm_head, "bias", None)
    bias = None if bias is None else bias.detach().to(device=device, dtype=torch.float32)
    vocab_size, hidden_size = weight.shape
    manifest = data.manifest
    if hidden_size != data.hidden.shape[1] or vocab_size != manifest["vocab_size"]:
        raise ValueError(
            f"the lm_head [{vocab_size}, {hidden_size}] does not fit the data (hidden size {data.hidden.shape[1]}, "
            f"vocabulary {manifest['vocab_size']}, from {manifest.get('base_model')}); pass the lm_head of the model "
            "that produced the data"
        )
    return weight, bias


def _fresh_heads(cfg: MedusaTrainingConfig, lm_weight: torch.Tensor, vocab: torch.Tensor | None, base: str | None):
    """Heads for ``cfg`` over the lm_head `[V, H]`, drafting over ``vocab`` `[V']` when ``cfg.draft_vocab``."""
    vocab_size, hidden_size = lm_weight.shape
    torch.manual_seed(cfg.seed)
    heads = MedusaHeads(
        hidden_size=hidden_size,
        num_heads=cfg.num_heads,
        num_layers=cfg.num_layers,
        vocab_size=vocab_size,
        share_lm_head=cfg.share_lm_head,
        draft_vocab_size=int(vocab.numel()) if cfg.draft_vocab and vocab is not None else None,
        base_model_name_or_path=base,
    )
    if heads.token_map is not None:
        heads.token_map.copy_(vocab.cpu())
    if not cfg.share_lm_head:
        with torch.no_grad():
            heads.lm_head_weight.copy_(lm_weight.cpu().unsqueeze(0).expand_as(heads.lm_head_weight))
    return heads


def train_medusa(
    data: str | os.PathLike | DistillationData,
    out_dir: str | os.PathLike,
    lm_head: nn.Module,
    config: MedusaTrainingConfig | None = None,
    *,
    resume: bool = False,
    base_model_name_or_path: str | None = None,
    progress: bool = True,
    cpu: bool | None = None,
    init_heads: MedusaHeads | None = None,
) -> tuple[MedusaHeads, dict]:
    """Train Medusa-1 heads on cached self-distillation data and save them to ``out_dir`` (`save_pretrained`).

    Args:
        data: the data folder (`build_distillation_data`) or loaded `DistillationData`.
        out_dir: where the heads (``config.json``, ``model.safetensors``, ``README.md``), ``training_report.json``
            and ``checkpoints/`` go.
        lm_head: the frozen base lm_head (``model.get_output_embeddings()``); only its weight and bias are used.
        config: hyper-parameters (default `MedusaTrainingConfig()`).
        resume: continue from the latest checkpoint in ``out_dir`` (refused otherwise when checkpoints exist).
        base_model_name_or_path: recorded in the heads' config (default: the data manifest's base model).
        progress: tqdm bar.
        cpu: force the CPU (default: accelerate's choice, i.e. the GPU when there is one).
        init_heads: start from these heads (a copy; fine-tuning): their shape and draft vocabulary are kept, the
            config's must agree.
    Returns:
        ``(heads, report)``: the trained heads (CPU, eval mode, not bound) and the training report dict.
    """
    from accelerate import Accelerator

    cfg = config or MedusaTrainingConfig()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = data if isinstance(data, DistillationData) else load_distillation_data(data)
    accelerator = Accelerator(cpu=bool(cpu), mixed_precision=cfg.mixed_precision)
    device = accelerator.device
    lm_weight, lm_bias = _frozen_lm_head(lm_head, data, device)
    split = held_out_split(data, cfg.eval_fraction, cfg.eval_positions, cfg.seed, on_path=True)
    vocab, coverage = None, 1.0
    if init_heads is not None and init_heads.token_map is not None:  # fine-tuning keeps the heads' draft vocabulary
        vocab = init_heads.token_map.to(device)
        coverage = float(torch.isin(medusa_labels(data, split.train_pos, 1)[0], init_heads.token_map).float().mean())
    elif cfg.loss_vocab is not None and cfg.loss_vocab < lm_weight.shape[0]:
        vocab, coverage = draft_vocabulary(data, split.train_pos, cfg.loss_vocab)
        vocab = vocab.to(device)
    if init_heads is not None:
        heads = trainable_copy(init_heads, num_heads=cfg.num_heads, num_layers=cfg.num_layers,
                               share_lm_head=cfg.share_lm_head)  # fmt: skip
    else:
        heads = _fresh_heads(cfg, lm_weight, vocab, base_model_name_or_path or data.manifest.get("base_model"))
    same = ("num_heads", "num_layers", "share_lm_head", "positions_per_step", "seed")
    run, total = TrainingRun.start(out, cfg, heads, "heads", split.train_pos.numel(), resume, same)
    prepared, run.optimizer = accelerator.prepare(heads, run.optimizer)
    run.module, run.backward, run.clip = (
        accelerator.unwrap_model(prepared),
        accelerator.backward,
        accelerator.clip_grad_norm_,
    )
    run.save = accelerator.is_main_process
    prepared.train()
    soft = cfg.distill == "soft"

    def loss_of(pos: torch.Tensor) -> torch.Tensor:
        hidden, labels, teacher = _batch(data, pos, cfg.num_heads, soft, device, torch.float32)
        with accelerator.autocast():
            return medusa_loss(run.module, hidden, labels, lm_weight, lm_bias, cfg.decay, vocab, teacher)[0]

    def evaluate() -> dict:
        return evaluate_medusa(run.module, data, split.eval_pos, lm_weight, lm_bias, cfg.decay)

    held = evaluate if split.eval_pos.numel() else None
    before, after = run.train(
        split.train_pos, total, loss_of, held, desc="medusa heads", metric="top1_per_head", progress=progress
    )
    heads = run.module.to("cpu").eval()
    report = {"base_model": heads.base_model_name_or_path, **run.report(data, split, before, after)}
    report["device"] = str(device)
    report["loss_vocab_coverage"] = round(coverage, 4) if vocab is not None else None
    heads.model_card = _model_card(report, data.manifest, cfg)
    if accelerator.is_main_process:
        heads.save_pretrained(out)
        write_json(out / REPORT_NAME, report)
    return heads, report


def _model_card(report: dict, manifest: dict, cfg: MedusaTrainingConfig) -> dict:
    """The model-card facts of trained heads, from their training report."""
    top1 = report["held_out"]["top1_per_head"] if report["held_out"] else None
    return {
        "training_data": report["training_data"],
        "base_model": report["base_model"],
        "data_size": {
            "sequences": report["num_sequences"],
            "tokens": report["num_tokens"],
            "answer_tokens": manifest.get("num_answer_tokens"),
        },
        "training": {
            "steps": report["steps"],
            "time_s": report["training_time_s"],
            "device": report["device"],
            "positions_per_step": cfg.positions_per_step,
            "lr": cfg.lr,
            "distill": cfg.distill,
            "loss_vocab": cfg.loss_vocab,
        },
        "held_out_top1_per_head": top1,
        "tau": None,
        "speedup": None,
        "notes": (
            f"Held-out top-1 accuracy per head (head k guesses token t + k + 2): {top1}." if top1 is not None else None
        ),
    }


__all__ = [
    "MedusaTrainingConfig",
    "evaluate_medusa",
    "latest_checkpoint",
    "medusa_loss",
    "train_medusa",
]
