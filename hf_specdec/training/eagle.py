"""Training an EAGLE-1/2 head (Li et al. 2024, arXiv:2401.15077, section 4.3) or an EAGLE-3 head (Li et al. 2025,
arXiv:2503.01840) on self-distillation data, target frozen.

The data (`hf_specdec.training.shards`) holds, per sequence, the token ids and the target's final normed hidden states
``f_t`` (teacher forcing over the target's own answers, and over the prompts). The head reads the pairs
``(f_t, token_{t+1})`` of a window with causal attention, as it does while drafting, and at every pair is trained to

- regress the next feature: SmoothL1(``out_t``, ``f_{t+1}``) (``reg_weight``, EAGLE's L_reg), and
- predict the target's next token: cross-entropy of the logits ``lm_head(out_t)`` against the target's choice at
  ``t + 1`` (``token_weight``, EAGLE's L_cls). In answers that is the next answer token (the answers are greedy); in
  prompts, the target's arg-max ``lm_head(f_{t+1})``. Both are restricted to the head's draft vocabulary (the most
  frequent tokens of the training data), which is also what the head drafts over, so the target's lm_head costs
  ``V'`` rows per position instead of ``V``.

Input features get EAGLE's uniform noise (``noise`` x the features' standard deviation) so that the head tolerates its
own, imperfect features when it drafts several steps ahead. Held-out metric: top-1 = how often the head's arg-max at
pair t equals the target's token t + 2 at answer positions (the first draft token's acceptance under greedy decoding).

EAGLE-3 (``version=3``) reads the states of three target layers (low, middle, high: the data must be built with
``aux_layers=head.feature_layers``, 2, L // 2, L - 3), fused by ``fc``, and is trained on the token loss alone, with
*training-time test*: the window is unrolled ``unroll`` draft steps. Step 0 reads the target's fused features; step j
reads, at each root pair r, the head's own step-(j - 1) output beside the real token r + j + 1, and attends to the
step-0 pairs up to r plus its own chain (steps 1..j of root r), exactly what a depth-(j + 1) draft node sees at run
time; its loss (weight ``0.8 ** j``) is the target's token r + j + 2. Low-layer states carry the identity of each
context token, which one layer needs to copy from the prompt (an induction match on the token, the value its
successor) and which the final states of human-written text carry little of; whether that closes the default
model's copy gap on the benchmark is measured in docs/lab/heads_experiments.md (not at a CPU budget, so far).

    head, report = train_eagle(model, load_distillation_data(folders), "out/eagle", EagleTrainingConfig())
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..heads.eagle import EagleHead
from .labels import (
    draft_vocabulary,
    head_positions,
    label_coverage,
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
FEATURE_SAMPLE_SEQUENCES = 16  # online data: the sequences the input features' spread is measured on


@dataclass
class EagleTrainingConfig(RunConfig):
    """Hyper-parameters of `train_eagle` (EAGLE's defaults where they apply; the schedule, held-out split and
    checkpoints: `RunConfig`'s, with ``positions_per_step`` counting windows).

    Attributes:
        window: pairs per training window (a longer sequence is cut into windows).
        reg_weight / token_weight: weights of the feature regression and the token loss.
        noise: uniform noise on the input features, as a fraction of their standard deviation.
        draft_vocab: size of the draft (and loss) vocabulary; 0 = the full vocabulary.
        version: 1 (EAGLE-1/2: feature regression + token loss) or 3 (EAGLE-3: fused low/mid/high features, token
            loss over ``unroll`` training-time-test steps; ``reg_weight`` is not used).
        unroll: draft steps unrolled per window (training-time test); None: 3 for EAGLE-3, 1 for EAGLE-1. With
            ``unroll`` > 1 an EAGLE-1 head is trained on the token loss of every step (its own fed-back features from
            step 1 on) beside the feature regression of step 0.
        soft_labels: the token loss is the cross-entropy against the target's distribution over the draft vocabulary
            (``softmax`` of its lm_head rows over ``f_{t+1}``, as EAGLE's own training) instead of its arg-max.
        init_layer: None: a fresh head's layer starts at random; an index: as the target's decoder layer
            ``init_layer`` (negative: from the end; EAGLE-1 only, `EagleHead.copy_target_layers`).
    """

    window: int = 256
    reg_weight: float = 1.0
    token_weight: float = 0.5
    noise: float = 0.1
    draft_vocab: int = 8192
    version: int = 1
    unroll: int | None = None
    soft_labels: bool = False
    init_layer: int | None = None
    positions_per_step: int = 4
    epochs: float = 3.0
    max_grad_norm: float = 0.5
    eval_every: int = 100
    checkpoint_every: int = 50

    def __post_init__(self):
        check_mixed_precision(self.mixed_precision)
        if self.window < 2 or self.positions_per_step < 1:
            raise ValueError(
                f"window must be >= 2 and positions_per_step >= 1, got {self.window}, {self.positions_per_step}"
            )
        if self.reg_weight < 0 or self.token_weight < 0 or self.reg_weight + self.token_weight == 0:
            raise ValueError("reg_weight and token_weight must be >= 0, not both 0")
        if self.version not in (1, 3):
            raise ValueError(f"version must be 1 (EAGLE-1/2) or 3 (EAGLE-3), got {self.version}")
        if self.unroll is None:
            self.unroll = 3 if self.version == 3 else 1
        if self.unroll < 1:
            raise ValueError(f"unroll must be >= 1, got {self.unroll}")
        if self.init_layer is not None and self.version != 1:
            raise ValueError("init_layer starts an EAGLE-1 head's layer as a target layer; EAGLE-3's layer reads the "
                             "embeddings and features side by side (twice as wide): it cannot")  # fmt: skip
        if (self.version == 3 or self.unroll > 1) and self.token_weight == 0:
            raise ValueError("training-time test (EAGLE-3, or unroll > 1) trains on the token loss: token_weight > 0")


# ---------------------------------------------------------------------------------------------------- loss
def eagle_loss(
    head: EagleHead,
    data: DistillationData,
    labels: torch.Tensor,
    windows: torch.Tensor,
    cfg: EagleTrainingConfig,
    feature_std: float,
    generator: torch.Generator | None = None,
    teacher_rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict]:
    """The weighted EAGLE loss over the ``(start, end)`` windows `[B, 2]` (`window_starts`), and its parts (floats).
    ``teacher_rows``: `[V', H]` the target's lm_head rows of the draft vocabulary (needed by ``cfg.soft_labels``)."""
    if cfg.soft_labels and teacher_rows is None:
        raise ValueError("soft_labels needs the target's lm_head rows (teacher_rows)")
    rows = teacher_rows if cfg.soft_labels else None
    t, valid = window_positions(data, windows, cfg.window)  # [B, W], on the CPU with the data
    dtype, device = head.fc.weight.dtype, head.fc.weight.device
    feats = data.features(head.feature_layers)[t].to(device=device, dtype=dtype)  # [B, W, F]
    if cfg.noise and head.training:
        u = torch.rand(feats.shape, generator=generator, dtype=dtype, device=device)
        feats = feats + (u * 2 - 1) * cfg.noise * feature_std
    if head.version == 3 or cfg.unroll > 1:
        tok, parts, out = _unrolled_token_loss(head, data, labels, t, valid, feats, cfg.unroll, rows)
        if head.version == 3:
            return tok, parts
    else:
        tokens = data.input_ids[t + 1].to(device)  # [B, W]
        out, logits = head(tokens, feats)  # [B, W, H], [B, W, V']
        tok = _token_loss(logits, labels[t], valid, data.hidden[t + 1], rows)
        parts = {"token": float(tok.detach())}
    target = data.hidden[t + 1].to(device=device, dtype=dtype)  # [B, W, H]
    v = valid.to(device)
    reg = F.smooth_l1_loss(out[v], target[v])
    loss = cfg.reg_weight * reg + cfg.token_weight * tok
    return loss, {"reg": float(reg.detach()), **parts}


def _token_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    valid: torch.Tensor,
    teacher: torch.Tensor | None,
    teacher_rows: torch.Tensor | None,
) -> torch.Tensor:
    """Cross-entropy of ``logits`` `[B, W, V']` against the draft-vocabulary ``labels`` `[B, W]` (-100: none) where
    ``valid`` `[B, W]`; with ``teacher_rows`` `[V', H]`, against the target's distribution over the draft vocabulary
    (``softmax(teacher @ teacher_rows.T)``, ``teacher`` `[B, W, H]` the target's next states, on the CPU) at the
    labelled positions instead."""
    lab = labels.to(logits.device).masked_fill(~valid.to(logits.device), -100)
    if teacher_rows is None:
        tok = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), lab.reshape(-1), ignore_index=-100)
        return torch.nan_to_num(tok)  # a batch without any label
    keep = lab >= 0
    with torch.no_grad():
        states = teacher[keep.cpu()].to(teacher_rows.device, teacher_rows.dtype)  # [k, H]
        p = torch.softmax((states @ teacher_rows.T).float(), dim=-1)  # [k, V']
    return torch.nan_to_num(-(p * torch.log_softmax(logits[keep].float(), dim=-1)).sum(-1).mean())


def _unrolled_token_loss(
    head: EagleHead,
    data: DistillationData,
    labels: torch.Tensor,
    t: torch.Tensor,
    valid: torch.Tensor,
    feats: torch.Tensor,
    unroll: int,
    teacher_rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict, torch.Tensor]:
    """Training-time test over windows of root pairs ``t`` `[B, W]` (``valid`` `[B, W]`, step-0 features ``feats``
    `[B, W, F]`): the token loss of ``unroll`` draft steps, step j weighted ``0.8 ** j`` (module docstring); also
    returns step 0's output states `[B, W, H]` (for EAGLE-1's feature regression)."""
    n = data.input_ids.numel()
    steps = torch.arange(unroll)  # [U]
    index = (t[..., None] + steps).clamp(max=n - 1)  # [B, W, U] root + j
    ok = valid[..., None] & (t[..., None] + steps + 1 < data.seq_end[t][..., None])  # step j's token in the sequence
    tokens = data.input_ids[(index + 1).clamp(max=n - 1)].to(feats.device)  # [B, W, U] token r + j + 1
    losses, first = [], []
    for j, logits in enumerate(unrolled_draft_logits(head, feats, tokens, outputs=first)):
        teacher = data.hidden[(index[..., j] + 1).clamp(max=n - 1)] if teacher_rows is not None else None  # [B, W, H]
        losses.append(_token_loss(logits, labels[index[..., j]], ok[..., j], teacher, teacher_rows))
    weights = [0.8**j for j in range(unroll)]
    loss = sum(w * x for w, x in zip(weights, losses)) / sum(weights)
    parts = {"token": float(losses[0].detach()), **{f"token_step{j}": float(x.detach()) for j, x in enumerate(losses)}}
    return loss, parts, first[0]


def unrolled_draft_logits(
    head: EagleHead, feats: torch.Tensor, tokens: torch.Tensor, outputs: list | None = None
) -> list[torch.Tensor]:
    """The logits of ``U`` chained draft steps from every root pair of a window (training-time test).

    Args:
        feats: `[B, W, F]` the target's features of pairs 0..W-1 (positions 0..W-1).
        tokens: `[B, W, U]` beside root r's step j, the token r + j + 1.
        outputs: if given, each step's output states `[B, W, H]` are appended to it.
    Returns:
        ``U`` tensors `[B, W, V']`: step j's logits at root r, computed as a depth-(j + 1) draft node sees it: step 0
        reads the target's feature, step j > 0 the head's step-(j - 1) output, at position r + j; it attends to the
        step-0 pairs up to r and to the steps 1..j of its own root.
    """
    b, w, unroll = tokens.shape
    device = feats.device
    causal = torch.ones(w, w, dtype=torch.bool, device=device).tril()  # [W, W] step-0 pairs up to the root
    diagonal = torch.eye(w, dtype=torch.bool, device=device)  # [W, W] the root's own chain
    keys = values = feats.new_zeros(b, head.config.num_key_value_heads, 0, head.head_dim)
    x, out_logits = feats, []
    for j in range(unroll):
        pos = (torch.arange(w, device=device) + j).expand(b, w)  # [B, W]
        mask = torch.cat([causal] + [diagonal] * j, dim=1).expand(b, w, (j + 1) * w)  # [B, W, (j + 1) W]
        x, k, v = head.layer_forward(tokens[..., j], x, pos, mask, keys, values)  # [B, W, H], [B, kvh, W, D] x 2
        keys, values = torch.cat([keys, k], dim=2), torch.cat([values, v], dim=2)
        out_logits.append(head.logits(x))
        if outputs is not None:
            outputs.append(x)
    return out_logits


@torch.no_grad()
def evaluate_eagle(head: EagleHead, data: DistillationData, seq_ids: torch.Tensor, max_positions: int | None) -> dict:
    """Held-out top-1 / top-4 of the first draft token at answer positions, each sequence read whole.

    Returns:
        ``{"top1", "top4", "positions"}``: how often the target's next answer token (t + 2) is the head's arg-max /
        among its 4 best at pair t, over at most ``max_positions`` positions spread over all the sequences
        (`labels.spread_sample`; None: every position).
    """
    was = head.training
    head.eval()
    features = data.features(head.feature_layers)  # [N, F]
    nxt = data.next_tokens()
    bounds = [(s, a, e) for s, a, e in data.seq_bounds[seq_ids].tolist() if e - s >= 3]
    scored = []
    for s, a, e in bounds:
        pos = torch.arange(max(s, a - 2), e - 2)
        scored.append(pos[data.answer_mask[pos + 2] & (nxt[pos + 1] >= 0)])  # token t + 2 is a known answer token
    hit1 = hit4 = total = 0
    for (s, _, e), pos in zip(bounds, spread_sample(scored, max_positions)):
        if pos.numel() == 0:
            continue
        t = torch.arange(s, e - 1)
        w = head.fc.weight
        feats = features[t][None].to(w.device, w.dtype)  # [1, T, F]
        _, logits = head(data.input_ids[t + 1][None].to(w.device), feats)
        top = head.draft_to_token(logits[0, pos - s].topk(4, dim=-1).indices).cpu()  # [p, 4]
        want = nxt[pos + 1]
        hit1 += int((top[:, 0] == want).sum())
        hit4 += int((top == want[:, None]).any(-1).sum())
        total += int(pos.numel())
    head.train(was)
    return {"top1": round(hit1 / max(total, 1), 4), "top4": round(hit4 / max(total, 1), 4), "positions": total}


# ---------------------------------------------------------------------------------------------------- training
def train_eagle(
    model: torch.nn.Module,
    data: DistillationData | OnlineTeacherForcing,
    out_dir: str | Path,
    cfg: EagleTrainingConfig | None = None,
    *,
    resume: bool = False,
    progress: bool = True,
    device: str | torch.device | None = None,
    init_head: EagleHead | None = None,
) -> tuple[EagleHead, dict]:
    """Train a fresh EAGLE-1/2 (or, ``cfg.version=3``, EAGLE-3) head for ``model`` on ``data`` (or continue training
    ``init_head``); write ``out_dir/head`` and the report.

    Args:
        model: the target (frozen; only its embeddings and lm_head are read).
        data: self-distillation data built for ``model`` (`load_distillation_data`), or teacher-forced
            conversations whose states the target computes at every step (`OnlineTeacherForcing`: nothing stored).
        out_dir: output folder: ``checkpoints/``, ``head/`` (`EagleHead.save_pretrained`), ``training_report.json``.
        cfg: hyper-parameters.
        resume: continue from the latest checkpoint in ``out_dir`` (same settings required).
        progress: tqdm bars.
        device: where the head trains (default: the target's device); the data stays on the CPU and each batch
            moves there. The returned head is on the CPU.
        init_head: start from this head (a copy; its version and draft vocabulary are kept, ``cfg.version`` and
            ``cfg.draft_vocab`` must agree): fine-tuning a trained head on new data.
    Returns:
        ``(head, report)``.
    """
    cfg = cfg or EagleTrainingConfig()
    if init_head is not None and cfg.init_layer is not None:  # before anything is written: the CLI refuses it too
        raise ValueError("init_layer starts a fresh head's layer as a target layer; a head passed as init_head is "
                         "continued as it is: pass one or the other")  # fmt: skip
    data, online = split_source(data)  # online: the ids and masks, states computed per step
    out, train_seqs, eval_seqs, lm_weight, device = start_head_training(model, data, out_dir, cfg, device)
    head, vocab, coverage = _head_to_train(model, data, train_seqs, cfg, init_head)
    head = head.to(device).train()
    for p in model.parameters():
        p.requires_grad_(False)
    vocab_ids = vocab if vocab is not None else torch.arange(int(lm_weight.shape[0]))
    sample = with_states(data, online, train_seqs[:FEATURE_SAMPLE_SEQUENCES])[0]  # stored: all of them
    features = sample.features(head.feature_layers)  # [N, F]: refuses data without the head's layers
    feature_std = float(features[:: max(1, features.shape[0] // 4096)].float().std())
    batch_of = step_data(data, online, lm_weight, vocab_ids, cfg.unroll + 1)
    starts = window_starts(data, train_seqs, cfg.window)
    split = HeldOutSplit(train_seqs, eval_seqs, starts, torch.zeros(0, dtype=torch.long))
    same = ("window", "draft_vocab", "seed", "version", "unroll", "soft_labels", "init_layer")
    run, total = TrainingRun.start(out, cfg, head, "head", starts.shape[0], resume, same)
    gen = torch.Generator(device=device).manual_seed(cfg.seed + 17)
    teacher_rows = lm_weight[vocab_ids].to(device, torch.float32)  # [V', H]
    held_out, held_ids = with_states(data, online, eval_seqs)  # online: the held-out states, computed once

    def loss_of(windows: torch.Tensor) -> torch.Tensor:
        return eagle_loss(head, *batch_of(windows), cfg, feature_std, gen, teacher_rows)[0]

    def evaluate() -> dict:
        return evaluate_eagle(head, held_out, held_ids, cfg.eval_positions) if eval_seqs.numel() else {}

    before, after = run.train(starts, total, loss_of, evaluate, desc="eagle head", metric="top1", progress=progress)
    head.to("cpu").eval()
    report = run.report(data, split, before, after)
    report.update(
        device=str(device),
        draft_vocab=int(vocab.numel()) if vocab is not None else None,
        draft_vocab_answer_coverage=round(coverage, 4),
        feature_std=round(feature_std, 4),
        train_windows=int(starts.shape[0]),
    )
    report.update(online_report(online))
    head.model_card = {
        "training_data": report["training_data"],
        "held_out_top1": (after or {}).get("top1"),
        "notes": (
            "EAGLE-1/2 head trained by hf-specdec (feature regression + token loss, target frozen)."
            if cfg.version == 1
            else f"EAGLE-3 head trained by hf-specdec (features of target layers {list(head.feature_layers)}, token "
            f"loss over {cfg.unroll} training-time-test steps, target frozen)."
        ),
    }
    head.save_pretrained(out / HEAD_DIR)
    (out / REPORT_NAME).write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    return head, report


def _head_to_train(
    model: torch.nn.Module,
    data: DistillationData,
    train_seqs: torch.Tensor,
    cfg: EagleTrainingConfig,
    init_head: EagleHead | None,
) -> tuple[EagleHead, torch.Tensor | None, float]:
    """``(head, draft vocabulary [V'] or None, the share of the training labels it covers)``: a trainable copy of
    ``init_head``, or a fresh head whose draft vocabulary is the ``cfg.draft_vocab`` most frequent labels of the
    training sequences ``train_seqs`` `[S]`."""
    positions = head_positions(data, train_seqs)  # [P]
    if init_head is not None:
        head, vocab = _continued(init_head, model, cfg)
        return head, vocab, label_coverage(data, positions, vocab) if vocab is not None else 1.0
    vocab, coverage = None, 1.0
    if cfg.draft_vocab and cfg.draft_vocab < int(data.manifest["vocab_size"]):
        vocab, coverage = draft_vocabulary(data, positions, cfg.draft_vocab)
    head = EagleHead.for_model(model, version=cfg.version, draft_vocab=vocab)
    if cfg.init_layer is not None:
        head.copy_target_layers(model, cfg.init_layer)
    return head, vocab, coverage


def _continued(init_head: EagleHead, model: torch.nn.Module, cfg: EagleTrainingConfig):
    """``(a trainable float32 copy of init_head bound to model, its draft vocabulary [V'] or None)``; the config must
    describe the same head."""
    head = trainable_copy(init_head, list(model.modules()), version=cfg.version).bind(model)
    vocab = None if head.d2t is None else head._draft_ids().cpu()
    if vocab is not None and cfg.draft_vocab and vocab.numel() != cfg.draft_vocab:
        raise ValueError(
            f"the head to fine-tune drafts over {vocab.numel()} tokens, the config asks for {cfg.draft_vocab}"
        )
    return head, vocab


def measure_eagle_step_cost(
    model: torch.nn.Module, head: EagleHead, sizes: Sequence[int], top_k: int, depth: int, context: int = 384
) -> dict[int, float]:
    """``{n: cost}``: a speculative step verifying ``n`` nodes plus the head drafting its next tree (``depth - 1``
    passes of ``top_k`` frontier nodes over a ``context``-long head cache), relative to a plain decoding step, timed on
    this machine (`step_cost_curve`)."""
    from ..generation.proposers.eagle import expand_dynamic_tree
    from .step_cost import step_cost_curve

    head.eval()
    cache = head.new_cache(1, capacity=context + 1)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        cache.key.normal_(generator=gen)
        cache.value.normal_(generator=gen)
    cache.lengths[:] = context
    slots = torch.zeros(1, dtype=torch.long)
    root_out = torch.randn(1, head.hidden_size, generator=gen).to(head.fc.weight.dtype)

    @torch.no_grad()
    def draft() -> None:
        logp = torch.log_softmax(head.logits(root_out), dim=-1)
        expand_dynamic_tree(head, cache, slots, root_out, logp, top_k, depth)

    return step_cost_curve(model, sizes, draft, context)


def tune_eagle_tree(
    model: torch.nn.Module, head: EagleHead, sizes: Sequence[int] = (4, 8, 16, 24, 32), top_k: int = 6, depth: int = 5
) -> dict:
    """Measure the step cost of each tree size on this machine and store the tree defaults in ``head.tree``
    (``top_k``, ``depth``, ``num_nodes`` = the largest size, ``step_cost``): `EagleAssistant` then cuts each row's
    tree to the size whose calibrated expected tokens per cost is best. Returns ``head.tree``."""
    cost = measure_eagle_step_cost(model, head, sizes, top_k, depth)
    head.tree = {
        "top_k": top_k,
        "depth": depth,
        "num_nodes": max(sizes),
        "step_cost": {str(n): round(c, 4) for n, c in cost.items()},
    }
    return head.tree


def config_from_dict(values: dict) -> EagleTrainingConfig:
    """An `EagleTrainingConfig` from a dict (unknown keys are an error naming the valid ones)."""
    names = {f.name for f in dataclasses.fields(EagleTrainingConfig)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ValueError(f"unknown EAGLE training settings {unknown}; valid: {sorted(names)}")
    return EagleTrainingConfig(**values)


__all__ = [
    "EagleTrainingConfig",
    "eagle_loss",
    "evaluate_eagle",
    "unrolled_draft_logits",
    "measure_eagle_step_cost",
    "train_eagle",
    "tune_eagle_tree",
]
