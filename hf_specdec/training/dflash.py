"""Training a DFlash block drafter (`DFlashHead`) on self-distillation data, target frozen, as the speculators library
trains it: anchored blocks.

The data (`hf_specdec.training.shards`, built with ``aux_layers=head.feature_layers``) hold per token the target's
states at the head's feature layers and its final normed state. A training window of a sequence gives the context;
``anchors_per_window`` anchors are drawn among its positions whose next token is an answer token; each anchor's block
(the anchor's token, then mask tokens) sees the window's context before the anchor and its whole block, as it does
while drafting (`DFlashHead.forward`). Block slot d (d = 1..D, the depths one block drafts) is trained to predict the
target's choice d places after the anchor: the KL divergence from the target's distribution over the draft
vocabulary (``soft_labels``: softmax of its lm_head rows over its final state one position earlier, the library's
soft targets) or the cross-entropy against its arg-max, weighted ``exp(-(d - 1) / decay)`` (the library's position decay), at answer positions.

Held-out metric: per-depth chain acceptance of the head's arg-max block at held-out answer anchors (teacher-forced:
``chain_tau`` = 1 + the mean number of leading depths whose arg-max is the target's token; ``top1`` = depth 1).

    head, report = train_dflash(model, load_distillation_data(folder), "out/dflash", DFlashTrainingConfig())
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..heads.dflash import DFlashHead, default_feature_layers
from ..heads.hub import base_model_dims
from ..text_config import text_config
from .labels import (
    draft_vocabulary,
    head_positions,
    label_coverage,
    on_path_runs,
    spread_sample,
    window_positions,
    window_starts,
)
from .online_states import OnlineTeacherForcing
from .run import (
    REPORT_NAME,
    HeldOutSplit,
    RunConfig,
    TrainingRun,
    check_mixed_precision,
    start_head_training,
    trainable_copy,
)
from .shards import DistillationData
from .step_inputs import online_report, split_source, step_data, with_states

HEAD_DIR = "head"


@dataclass
class DFlashTrainingConfig(RunConfig):
    """Hyper-parameters of `train_dflash` (the schedule, split and checkpoints: `RunConfig`'s, with
    ``positions_per_step`` counting windows).

    Attributes:
        num_layers / block_size: the head's draft layers and block (anchor included).
        window: positions per training window (the anchors' context); anchors_per_window: blocks per window.
        decay: the loss weight of depth d is ``exp(-(d - 1) / decay)``.
        draft_vocab: size of the draft (and loss) vocabulary; 0 = the full vocabulary (through the target's lm_head).
        soft_labels: the target's distribution over the draft vocabulary as the target (else its arg-max).
        init_layer: None: the draft layers start at random; an index: draft layer i starts as the target's decoder
            layer ``init_layer + i`` (negative: counted from the end; `DFlashHead.copy_target_layers`).
        on_path: label depth d only where the tokens between the anchor and it are on the target's path
            (`block_targets`; matters for teacher-forced data only).
    """

    num_layers: int = 1
    block_size: int = 8
    window: int = 256
    anchors_per_window: int = 16
    decay: float = 4.0
    draft_vocab: int = 8192
    soft_labels: bool = True
    init_layer: int | None = None
    on_path: bool = False
    positions_per_step: int = 4
    epochs: float = 3.0
    max_grad_norm: float = 0.5
    eval_every: int = 100
    checkpoint_every: int = 50

    def __post_init__(self):
        check_mixed_precision(self.mixed_precision)
        if self.window < self.block_size + 1 or self.anchors_per_window < 1 or self.block_size < 2:
            raise ValueError(f"need block_size >= 2, window > block_size and anchors_per_window >= 1, got "
                             f"{self.block_size}, {self.window}, {self.anchors_per_window}")  # fmt: skip
        if self.decay <= 0:
            raise ValueError(f"decay must be > 0, got {self.decay}")


# ---------------------------------------------------------------------------------------------------- loss
def draw_anchors(data: DistillationData, t: torch.Tensor, valid: torch.Tensor, count: int, generator) -> torch.Tensor:
    """`[B, A]` window-relative anchors, A = ``count`` at most: positions with context before them whose next token
    is an answer token, drawn at random (sorted); -1 where a window has fewer."""
    n = data.input_ids.numel()
    ok = valid & data.answer_mask[(t + 1).clamp(max=n - 1)] & (t + 1 < data.seq_end[t])  # [B, W]
    ok[:, 0] = False  # an anchor needs context
    key = torch.rand(ok.shape, generator=generator).masked_fill(~ok, -1.0)
    top = key.topk(min(count, ok.shape[1]), dim=1)
    anchors = torch.where(top.values >= 0, top.indices, -1)
    return anchors.sort(dim=1).values


def block_targets(
    data: DistillationData,
    labels: torch.Tensor,
    t: torch.Tensor,
    anchors: torch.Tensor,
    depths: int,
    on_path: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(positions, target)``: `[B, A, D]` the absolute position d places after each anchor, and the draft-vocabulary
    index of the target's choice there (-100: none, or not an answer token, or an absent anchor).

    ``on_path``: depth d is labelled only where the d - 1 tokens between the anchor and it are on the target's path
    (`DistillationData.on_target_path`). In teacher-forced text the target's choice at depth d follows the text's
    tokens between, which the block never sees and the loop only verifies after its own: off the path the label is
    the target's answer to a continuation it would not have written (self-distilled data are on it everywhere)."""
    n = data.input_ids.numel()
    base = t.gather(1, anchors.clamp(min=0))  # [B, A]
    pos = base[..., None] + torch.arange(1, depths + 1)  # [B, A, D]
    safe = pos.clamp(max=n - 1)
    target = labels[(safe - 2).clamp(min=0)]  # labels[p - 2]: the target's choice at p
    keep = (anchors[..., None] >= 0) & (pos < data.seq_end[base][..., None]) & data.answer_mask[safe]
    if on_path:  # depth d + 1: tokens base + 1 .. base + d on the path (depth 1 has none between)
        keep[..., 1:] &= on_path_runs(data, base, depths - 1)  # [B, A, D - 1]
    return safe, target.masked_fill(~keep, -100)


def dflash_loss(
    head: DFlashHead,
    data: DistillationData,
    labels: torch.Tensor,
    windows: torch.Tensor,
    cfg: DFlashTrainingConfig,
    generator: torch.Generator,
    teacher_rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict]:
    """The depth-weighted block loss over the ``(start, end)`` windows `[B, 2]`, and its per-depth parts.
    ``teacher_rows``: `[V', H]` the target's lm_head rows of the draft vocabulary (soft labels)."""
    t, valid = window_positions(data, windows, cfg.window)  # [B, W]
    dtype, device = head.fc.weight.dtype, head.fc.weight.device
    feats = data.features(head.feature_layers)[t].to(device=device, dtype=dtype)  # [B, W, F]
    anchors = draw_anchors(data, t, valid, cfg.anchors_per_window, generator)  # [B, A]
    first, depths = (0 if head.sample_from_anchor else 1), head.num_depths
    logits = head(data.input_ids[t].to(device), feats, anchors.clamp(min=0).to(device))  # [B, A, k, V']
    logits = logits[:, :, first : first + depths]  # [B, A, D, V']
    pos, target = block_targets(data, labels, t, anchors, depths, cfg.on_path)  # [B, A, D]
    keep = (target >= 0).to(device)
    logp = torch.log_softmax(logits[keep].float(), dim=-1)  # [k, V']
    if teacher_rows is not None:
        states = data.hidden[(pos - 1)[keep.cpu()]].to(device=teacher_rows.device, dtype=teacher_rows.dtype)
        with torch.no_grad():
            soft = torch.softmax((states @ teacher_rows.T).float(), dim=-1)  # [k, V']
        nll = (torch.special.xlogy(soft, soft) - soft * logp).sum(-1)  # KL(target || head): 0 when learnt
    else:
        nll = F.nll_loss(logp, target.to(device)[keep], reduction="none")
    depth = torch.arange(depths, device=device).expand_as(keep)[keep]  # [k]
    weight = torch.exp(-depth.float() / cfg.decay)
    loss = (weight * nll).sum() / weight.sum().clamp(min=1e-9)
    parts = {f"depth{d + 1}": float(nll[depth == d].detach().mean()) for d in range(depths) if (depth == d).any()}
    return torch.nan_to_num(loss), parts


@torch.no_grad()
def dflash_block_hits(
    head: DFlashHead, data: DistillationData, seq_ids: torch.Tensor, max_positions: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(anchors [A], hits [A, D])``: at every answer anchor (the token before an answer token, as the loop drafts
    from its root), each sequence read whole, whether each depth d of the head's arg-max block is the target's token
    anchor + d; at most ``max_positions`` anchors spread over all the sequences (`labels.spread_sample`; None: all).
    The depths do not read each other's drafts, so the leading run of hits is what greedy verification of the
    block's chain accepts."""
    features, nxt = data.features(head.feature_layers), data.next_tokens()
    first, depths, w = (0 if head.sample_from_anchor else 1), head.num_depths, head.fc.weight
    bounds = data.seq_bounds[seq_ids].tolist()
    candidates = []
    for s, a, e in bounds:
        anchors = torch.arange(max(s + 1, a - 1), max(s + 1, e - 1))
        candidates.append(anchors[data.answer_mask[anchors + 1]])
    found, hits = [], []
    for (s, _, e), anchors in zip(bounds, spread_sample(candidates, max_positions)):
        if anchors.numel() == 0:
            continue
        t = torch.arange(s, e)
        logits = head(data.input_ids[t][None].to(w.device), features[t][None].to(w.device, w.dtype),
                      (anchors - s)[None].to(w.device))[0, :, first : first + depths]  # fmt: skip
        guess = head.draft_to_token(logits.argmax(-1)).cpu()  # [A, D]
        pos = anchors[:, None] + torch.arange(1, depths + 1)  # [A, D] the position depth d drafts
        want = torch.where(pos < e, nxt[(pos - 1).clamp(max=e - 1)], -2)
        found.append(anchors)
        hits.append(guess == want)
    if not found:
        return torch.zeros(0, dtype=torch.long), torch.zeros(0, head.num_depths, dtype=torch.bool)
    return torch.cat(found), torch.cat(hits)


def evaluate_dflash(head: DFlashHead, data: DistillationData, seq_ids: torch.Tensor, max_positions: int) -> dict:
    """Held-out chain acceptance of the head's arg-max blocks at answer anchors (`dflash_block_hits`).

    Returns:
        ``{"top1", "chain_tau", "per_depth", "positions"}``: depth-1 hit rate, 1 + mean leading hits, the share of
        anchors whose first d depths all hit, and the anchors scored (at most ``max_positions``).
    """
    was = head.training
    head.eval()
    anchors, hits = dflash_block_hits(head, data, seq_ids, max_positions)
    head.train(was)
    if anchors.numel() == 0:
        return {"top1": 0.0, "chain_tau": 1.0, "per_depth": [], "positions": 0}
    runs = torch.cumprod(hits.long(), dim=1).float()  # [A, D] 1 while every depth so far hit
    per_depth = [round(float(x), 4) for x in runs.mean(0)]
    return {"top1": per_depth[0], "chain_tau": round(1 + float(runs.sum(1).mean()), 4), "per_depth": per_depth,
            "positions": int(anchors.numel())}  # fmt: skip


# ---------------------------------------------------------------------------------------------------- training
def _head_to_train(
    model, data: DistillationData, online: OnlineTeacherForcing | None, train_seqs: torch.Tensor, cfg, init_head
) -> tuple[DFlashHead, torch.Tensor | None, float]:
    """``(head, draft vocabulary [V'] or None, its share of the answer labels)``: a trainable copy of ``init_head``
    bound to ``model`` (its shape must be the config's), else `_fresh_head`."""
    if init_head is None:
        return _fresh_head(model, data, online, train_seqs, cfg)
    if cfg.init_layer is not None:
        raise ValueError("init_layer starts a fresh head's layers as target layers; a head passed as init_head is "
                         "continued as it is: pass one or the other")  # fmt: skip
    layers = len(init_head.layers)
    if layers != cfg.num_layers:
        raise ValueError(f"the head to fine-tune has {layers} draft layer(s), the training config asks for "
                         f"{cfg.num_layers}")  # fmt: skip
    draft = init_head.draft_vocab_size or init_head.vocab_size
    if cfg.draft_vocab and draft != min(cfg.draft_vocab, init_head.vocab_size):
        raise ValueError(f"the head to fine-tune drafts over {draft} tokens, the config asks for {cfg.draft_vocab}")
    head = trainable_copy(init_head, list(model.modules()), block_size=cfg.block_size).bind(model)
    if head.d2t is None:
        return head, None, 1.0
    vocab = head.draft_to_token(torch.arange(head.d2t.numel()))  # [V']
    return head, vocab, label_coverage(data, head_positions(data, train_seqs), vocab)


def _fresh_head(
    model, data: DistillationData, online: OnlineTeacherForcing | None, train_seqs: torch.Tensor, cfg
) -> tuple[DFlashHead, torch.Tensor | None, float]:
    """``(head, draft vocabulary [V'] or None, its share of the answer labels)``: a fresh head reading the layers the
    data hold (online: the layers ``online`` computes; else `default_feature_layers`, which `train_dflash` then
    checks the data hold), its layers copied from the target's where ``cfg.init_layer`` says so."""
    vocab, coverage = None, 1.0
    vocab_size = base_model_dims(model)[1]
    if cfg.draft_vocab and cfg.draft_vocab < vocab_size:
        vocab, coverage = draft_vocabulary(data, head_positions(data, train_seqs), cfg.draft_vocab)
    config = text_config(model)
    held = online.aux_layers if online is not None else data.aux_layers
    layers = held or default_feature_layers(int(config.num_hidden_layers))
    head = DFlashHead.for_model(model, cfg.num_layers, cfg.block_size, draft_vocab=vocab, aux_layers=list(layers))
    if cfg.init_layer is not None:
        head.copy_target_layers(model, cfg.init_layer)
    return head, vocab, coverage


def train_dflash(
    model: torch.nn.Module,
    data: DistillationData | OnlineTeacherForcing,
    out_dir: str | Path,
    cfg: DFlashTrainingConfig | None = None,
    *,
    resume: bool = False,
    progress: bool = True,
    device: str | torch.device | None = None,
    init_head: DFlashHead | None = None,
) -> tuple[DFlashHead, dict]:
    """Train a fresh `DFlashHead` for ``model`` on ``data`` (built with the head's feature layers,
    `default_feature_layers`), or continue training ``init_head``; write ``out_dir/head`` and the report.

    Args:
        model: the target (frozen; its embeddings and lm_head are read).
        data: self-distillation data for ``model`` with ``aux_layers`` = the head's feature layers, or teacher-forced
            conversations whose states (those layers') the target computes at every step (`OnlineTeacherForcing`:
            nothing stored).
        out_dir: output folder: ``checkpoints/``, ``head/``, ``training_report.json``.
        cfg: hyper-parameters; resume: continue from the latest checkpoint (same settings); progress: tqdm bars.
        device: where the head trains (default: the target's); the returned head is on the CPU.
        init_head: start from this head (a float32 copy; the user's head is left as it is): fine-tuning a trained
            head on new data. Its draft layers, block and draft vocabulary must be the config's.
    Returns:
        ``(head, report)``.
    """
    cfg = cfg or DFlashTrainingConfig()
    data, online = split_source(data)  # online: the ids and masks, states computed per step
    out, train_seqs, eval_seqs, lm_weight, device = start_head_training(model, data, out_dir, cfg, device)
    vocab_size = int(lm_weight.shape[0])
    head, vocab, coverage = _head_to_train(model, data, online, train_seqs, cfg, init_head)
    with_states(data, online, train_seqs[:1])[0].features(head.feature_layers)  # refuses data without its layers
    head = head.to(device).train()
    for p in model.parameters():
        p.requires_grad_(False)
    vocab_ids = vocab if vocab is not None else torch.arange(vocab_size)
    batch_of = step_data(data, online, lm_weight, vocab_ids, head.num_depths)  # a block reads D tokens on
    starts = window_starts(data, train_seqs, cfg.window)
    split = HeldOutSplit(train_seqs, eval_seqs, starts, torch.zeros(0, dtype=torch.long))
    same = ("num_layers", "block_size", "window", "draft_vocab", "seed", "soft_labels", "init_layer", "on_path")
    run, total = TrainingRun.start(out, cfg, head, "head", starts.shape[0], resume, same)
    gen = torch.Generator().manual_seed(cfg.seed + 17)
    teacher = lm_weight[vocab if vocab is not None else slice(None)]  # [V', H]: no copy of a full-vocabulary lm_head
    rows = teacher.to(device, torch.float32) if cfg.soft_labels else None
    held_out, held_ids = with_states(data, online, eval_seqs)  # online: the held-out states, computed once

    def loss_of(windows: torch.Tensor) -> torch.Tensor:
        return dflash_loss(head, *batch_of(windows), cfg, gen, rows)[0]

    def evaluate() -> dict:
        return evaluate_dflash(head, held_out, held_ids, cfg.eval_positions) if eval_seqs.numel() else {}

    before, after = run.train(starts, total, loss_of, evaluate, desc="dflash head", metric="chain_tau",
                              progress=progress)  # fmt: skip
    head.to("cpu").eval()
    report = run.report(data, split, before, after)
    report.update(device=str(device), draft_vocab=None if vocab is None else int(vocab.numel()),
                  draft_vocab_answer_coverage=round(coverage, 4), train_windows=int(starts.shape[0]),
                  **online_report(online))  # fmt: skip
    head.model_card = {
        "training_data": report["training_data"],
        "held_out_chain_tau": (after or {}).get("chain_tau"),
        "notes": f"DFlash block drafter trained by hf-specdec ({cfg.num_layers} layer(s), block {cfg.block_size}, "
        f"target layers {list(head.feature_layers)}, {'soft' if cfg.soft_labels else 'arg-max'} targets"
        f"{' on the target path' if cfg.on_path else ''}, position "
        f"decay {cfg.decay}, {run.step} steps; draft layers started "
        f"{_started(cfg, init_head)}; target frozen).",
    }
    head.save_pretrained(out / HEAD_DIR)
    (out / REPORT_NAME).write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    return head, report


def _started(cfg: DFlashTrainingConfig, init_head: DFlashHead | None) -> str:
    """How the draft layers started, for the model card."""
    if init_head is not None:
        return f"as the head {init_head.source or 'passed in'} (fine-tuned)"
    return "at random" if cfg.init_layer is None else f"as target layer {cfg.init_layer}"


__all__ = [
    "DFlashTrainingConfig",
    "block_targets",
    "dflash_loss",
    "dflash_block_hits",
    "draw_anchors",
    "evaluate_dflash",
    "train_dflash",
]
