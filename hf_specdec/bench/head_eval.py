"""How well draft heads guess the target on the benchmark's own kinds of task: teacher-forced top-1, per category.

Heads are judged on what the benchmark measures, so besides their held-out figures (on data built like their
training data) they are scored on the target's *greedy answers to the bench's Spec-Bench sample*: the folder built
here holds those answers with the target's final hidden states (`build_distillation_data`), marked
``evaluation_only`` in its manifest so that `load_distillation_data` refuses it to every trainer. The gap between the
two figures is what decides a head's speedup.

The figure is the first draft token's greedy acceptance: at each answer position t whose token t + 2 is an answer
token, does the head's arg-max (fed the target's state at t and the token t + 1, as the loop feeds it) equal the
target's token t + 2. For Medusa heads and MLP speculators the later heads / stages are scored too (teacher-forced:
each given the earlier tokens right); for a DFlash head every depth of its block anchored at t + 1.

    hf-specdec eval-heads                       # builds the answers once (cached), then prints a table
    rows = evaluate_heads(model, load_distillation_data(folder, evaluation_only_ok=True), heads, categories)
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..assistants import SHIPPED_HEADS, saved_head_type
from ..cli_args import non_negative_int, positive_int
from ..generation.proposers.ngram import prompt_lookup_predictions
from ..heads.eagle import EagleHead
from ..kinds import kind_of
from ..training.dflash import dflash_block_hits
from ..training.distillation_data import build_distillation_data
from ..training.eagle import evaluate_eagle, unrolled_draft_logits
from ..training.labels import head_positions, label_coverage
from ..training.medusa import evaluate_medusa
from ..training.medusa_tree import guess_matches
from ..training.mlp_speculator import evaluate_mlp_speculator, tree_accepted_depths
from ..training.shards import DistillationData, load_distillation_data
from .questions import category_sort_key, load_questions, sample_questions
from .spec_bench import build_prompts

CATEGORIES_NAME = "categories.json"
ALL = "overall"


def bench_answers_folder(
    root: str | Path, per_category: int, seed: int, max_new_tokens: int, aux_layers: Sequence[int] = ()
) -> Path:
    """Where the answers of one bench sample are cached under ``root`` (with the states of ``aux_layers``, for
    EAGLE-3 heads, in a folder of their own)."""
    return with_layers(Path(root) / f"spec-bench-answers-{per_category}x-seed{seed}-{max_new_tokens}tok", aux_layers)


def with_layers(folder: Path, aux_layers: Sequence[int]) -> Path:
    """``folder``, or its sibling for answers that also hold the states of ``aux_layers``."""
    return folder.with_name(folder.name + "-layers" + "-".join(map(str, aux_layers))) if aux_layers else folder


def build_bench_answers(
    model,
    tokenizer,
    questions_file: str | Path,
    out_dir: str | Path,
    per_category: int = 4,
    seed: int = 0,
    max_new_tokens: int = 128,
    batch_size: int = 8,
    progress: bool = True,
    aux_layers: Sequence[int] = (),
) -> Path:
    """The target's greedy answers (and hidden states) to the bench's sample, built once into ``out_dir``.

    The sample is the benchmark's (`sample_questions` with the same ``per_category`` and ``seed``), each question's
    first turn through the chat template, answered greedily with ``max_new_tokens`` as the benchmark does. The folder
    is evaluation-only: `load_distillation_data` refuses it unless asked with ``evaluation_only_ok=True``.
    ``aux_layers``: also store those layers' states (what an EAGLE-3 head reads).

    Returns:
        the folder (also holding ``categories.json``: each sequence's pooled category, in data order).
    """
    out = Path(out_dir)
    questions = sample_questions(load_questions(questions_file), per_category, seed)
    prompts = build_prompts(tokenizer, questions)
    recipe = {
        "kind": "the target's greedy answers to the bench's Spec-Bench sample",
        "evaluation_only": True,
        "questions_file": Path(questions_file).name,
        "per_category": per_category,
        "seed": seed,
        "question_ids": [str(p.question_id) for p in prompts],
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / CATEGORIES_NAME).write_text(json.dumps([p.category for p in prompts]) + "\n", encoding="utf-8")
    build_distillation_data(
        model,
        [p.ids.tolist() for p in prompts],
        out,
        recipe=recipe,
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
        shard_size=max(batch_size, len(prompts)),
        aux_layers=aux_layers,
        progress=progress,
    )
    return out


def sequence_categories(folder: str | Path) -> list[str]:
    """Each sequence's category, as `build_bench_answers` recorded it."""
    return json.loads((Path(folder) / CATEGORIES_NAME).read_text(encoding="utf-8"))


@dataclass(frozen=True)
class HeadScorer:
    """How ``hf-specdec eval-heads`` scores one head kind (its descriptor's `HeadKind.scorer`).

    Attributes:
        top1: ``(model, head, data, seq_ids [S]) -> [top-1 per draft position]`` (teacher-forced).
        chain: ``(model, head, data, seq_ids [S]) -> (positions [P], accepted [P])``: the draft tokens a greedy chain
            of the head's full depth gets right in a row at each answer position.
        reads_layers: ``head -> bool``: the head reads feature layers besides the final state (its answers need them).
    """

    top1: Callable[..., list[float]]
    chain: Callable[..., tuple]
    reads_layers: Callable[[torch.nn.Module], bool]


def _scorer(head: torch.nn.Module) -> HeadScorer:
    kind = kind_of(getattr(head, "head_type", None))
    scorer = None if kind is None else kind.load("scorer")
    if scorer is None:
        raise TypeError(f"no teacher-forced evaluation for {type(head).__name__}")
    return scorer


def head_top1(model, head: torch.nn.Module, data: DistillationData, seq_ids: torch.Tensor) -> list[float]:
    """Teacher-forced top-1 of ``head`` over the answers of sequences ``seq_ids`` `[S]`: one figure per draft
    position (EAGLE: the first draft token; Medusa: per head; MLP speculator: per stage; DFlash: per depth)."""
    return _scorer(head).top1(model, head, data, seq_ids)


def _eagle_top1(model, head, data: DistillationData, seq_ids: torch.Tensor) -> list[float]:
    return [evaluate_eagle(head, data, seq_ids, max_positions=10**9)["top1"]]


def _dflash_top1(model, head, data: DistillationData, seq_ids: torch.Tensor) -> list[float]:
    return [round(float(x), 4) for x in dflash_block_hits(head, data, seq_ids)[1].float().mean(0)]


def _mlp_speculator_top1(model, head, data: DistillationData, seq_ids: torch.Tensor) -> list[float]:
    return evaluate_mlp_speculator(head, data, head_positions(data, seq_ids))["top1_per_stage"]


def _medusa_top1(model, head, data: DistillationData, seq_ids: torch.Tensor) -> list[float]:
    lm_head = model.get_output_embeddings()
    weight = lm_head.weight.detach().float()  # [V, H]
    bias = None if getattr(lm_head, "bias", None) is None else lm_head.bias.detach().float()
    return evaluate_medusa(head, data, head_positions(data, seq_ids), weight, bias)["top1_per_head"]


def draft_vocabulary_ids(head: torch.nn.Module) -> torch.Tensor | None:
    """`[V']` the token ids ``head`` drafts over (its ``draft_to_token`` of every draft index), or None for a head
    that drafts over the target's whole vocabulary."""
    if head.draft_vocab_size is None:
        return None
    return head.draft_to_token(torch.arange(head.draft_vocab_size)).cpu()


def vocabulary_coverage(head: torch.nn.Module, data: DistillationData, seq_ids: torch.Tensor) -> float:
    """The share of the answers' first-guess tokens (`head_positions` of ``seq_ids`` `[S]`) in the head's draft
    vocabulary: the ceiling on its top-1 there (1.0 for a full-vocabulary head)."""
    vocab = draft_vocabulary_ids(head)
    if vocab is None:
        return 1.0
    return round(label_coverage(data, head_positions(data, seq_ids), vocab), 4)


EAGLE_CHAIN_DEPTH = 5


@torch.no_grad()
def eagle_chain_accepted(head: EagleHead, data: DistillationData, seq_ids: torch.Tensor, depth: int) -> tuple:
    """``(positions [P], accepted [P])``: at every answer position t of the sequences (token t + 2 an answer token),
    how many tokens a greedy chain of ``depth`` EAGLE draft steps from root t + 1 gets right in a row.

    The chain is the training-time-test unroll (`unrolled_draft_logits`): step j reads the head's own step-(j - 1)
    output and the data's token t + j + 1, which is the drafted token wherever the steps before were right, so the
    count of leading right steps is exactly what greedy verification of the chain accepts.
    """
    features, nxt = data.features(head.feature_layers), data.next_tokens()
    n = data.input_ids.numel()
    positions, accepted = [], []
    w = head.fc.weight
    for s, a, e in data.seq_bounds[seq_ids].tolist():
        if e - s < 3:
            continue
        t = torch.arange(s, e - 1)  # roots: pair (f_t, token t + 1)
        steps = torch.arange(depth)
        tokens = data.input_ids[(t[:, None] + steps + 1).clamp(max=n - 1)]  # [T, D] token t + j + 1
        feats = features[t][None].to(w.device, w.dtype)  # [1, T, F]
        logits = unrolled_draft_logits(head, feats, tokens[None].to(w.device))  # D x [1, T, V']
        guess = torch.stack([head.draft_to_token(x[0].argmax(-1)).cpu() for x in logits], dim=1)  # [T, D]
        want_at = t[:, None] + steps + 1  # the target's token after t + j + 1
        inside = (want_at + 1 < e) & data.answer_mask[(want_at + 1).clamp(max=n - 1)]
        right = (guess == nxt[want_at.clamp(max=n - 1)]) & inside  # [T, D]
        keep = data.answer_mask[(t + 2).clamp(max=n - 1)] & (t + 2 < e) & (t + 2 >= a)
        positions.append(t[keep])
        accepted.append(right[keep].long().cumprod(1).sum(1))
    if not positions:
        return torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)
    return torch.cat(positions), torch.cat(accepted)


@torch.no_grad()
def chain_accepted(model, head: torch.nn.Module, data: DistillationData, seq_ids: torch.Tensor) -> tuple:
    """``(positions [P], accepted [P])``: per answer position, the draft tokens a greedy chain of the head's full
    depth gets right in a row (EAGLE: `EAGLE_CHAIN_DEPTH` steps; Medusa: every head; MLP speculator: every stage;
    DFlash: every depth of its block)."""
    return _scorer(head).chain(model, head, data, seq_ids)


def _eagle_chain(model, head, data: DistillationData, seq_ids: torch.Tensor) -> tuple:
    return eagle_chain_accepted(head, data, seq_ids, EAGLE_CHAIN_DEPTH)


def _dflash_chain(model, head, data: DistillationData, seq_ids: torch.Tensor) -> tuple:
    anchors, hits = dflash_block_hits(head, data, seq_ids)  # the anchor is t + 1 of answer position t
    return anchors - 1, hits.long().cumprod(1).sum(1)


def _mlp_speculator_chain(model, head, data: DistillationData, seq_ids: torch.Tensor) -> tuple:
    positions = head_positions(data, seq_ids)  # [P]
    return positions, tree_accepted_depths(head, data, positions, [1] * head.n_predict)


def _medusa_chain(model, head, data: DistillationData, seq_ids: torch.Tensor) -> tuple:
    positions = head_positions(data, seq_ids)  # [P]
    match = guess_matches(head, data, positions, model.get_output_embeddings(), k=1)[..., 0]  # [P, D]
    return positions, match.long().cumprod(1).sum(1)


EAGLE_SCORER = HeadScorer(_eagle_top1, _eagle_chain, reads_layers=lambda head: head.version == 3)
DFLASH_SCORER = HeadScorer(_dflash_top1, _dflash_chain, reads_layers=lambda head: True)
MLP_SPECULATOR_SCORER = HeadScorer(_mlp_speculator_top1, _mlp_speculator_chain, reads_layers=lambda head: False)
MEDUSA_SCORER = HeadScorer(_medusa_top1, _medusa_chain, reads_layers=lambda head: False)


def copy_positions(data: DistillationData, positions: torch.Tensor) -> torch.Tensor:
    """`[P]` bool: whether prompt lookup (`NgramAssistant`'s matcher, having seen the tokens up to t + 1) drafts the
    target's token t + 2 first at each position t: where copying already gets the token a head is asked for."""
    guess = torch.full((data.input_ids.numel(),), -2, dtype=torch.long)
    for s, _, e in data.seq_bounds.tolist():
        pred = prompt_lookup_predictions(data.input_ids[s:e])
        guess[s:e] = torch.tensor([-2 if p is None else p for p in pred], dtype=torch.long)
    return guess[positions + 1] == data.next_tokens()[positions + 1]


def chain_summary(accepted: torch.Tensor) -> dict:
    """``{"positions", "top1", "tau"}`` of chain acceptances `[P]` (tau: 1 + the mean accepted, the bonus token
    counted as in the loop's τ)."""
    n = int(accepted.numel())
    return {
        "positions": n,
        "top1": round(float((accepted >= 1).float().mean()), 4) if n else None,
        "tau": round(1 + float(accepted.float().mean()), 3) if n else None,
    }


def evaluate_heads(
    model, data: DistillationData, heads: Mapping[str, torch.nn.Module], categories: Sequence[str]
) -> list[dict]:
    """One row per head and category (and ``"overall"``): ``{"head", "category", "sequences", "top1"}``, where
    ``top1`` lists the figures of `head_top1`, ``vocab_coverage`` the `vocabulary_coverage` of the answers, and
    ``chain`` / ``copy`` / ``elsewhere`` the `chain_summary` of all its answer positions, of those where prompt
    lookup already drafts the target's token, and of the rest. Each head is bound to ``model`` (checked against it)
    first."""
    if len(categories) != data.seq_bounds.shape[0]:
        raise ValueError(f"{len(categories)} categories for {data.seq_bounds.shape[0]} sequences")
    groups = {
        c: [i for i, x in enumerate(categories) if x == c] for c in sorted(set(categories), key=category_sort_key)
    }
    groups[ALL] = list(range(len(categories)))
    rows = []
    for name, head in heads.items():
        head.bind(model)  # checks the head against the target; EAGLE reads its embeddings and lm_head rows
        for category, ids in groups.items():
            seq_ids = torch.tensor(ids, dtype=torch.long)
            top1 = head_top1(model, head, data, seq_ids)
            positions, accepted = chain_accepted(model, head, data, seq_ids)
            copy = copy_positions(data, positions)
            rows.append({"head": name, "category": category, "sequences": len(ids), "top1": top1,
                         "vocab_coverage": vocabulary_coverage(head, data, seq_ids),
                         "chain": chain_summary(accepted), "copy": chain_summary(accepted[copy]),
                         "elsewhere": chain_summary(accepted[~copy])})  # fmt: skip
    return rows


def format_table(rows: Sequence[dict]) -> str:
    """Two markdown tables: a row per head, a column per category (the first draft position's top-1) and the later
    positions' overall top-1; then top-1 and chain τ overall, at copy positions (prompt lookup drafts the target's
    token) and elsewhere, and the share of the answers' tokens the head's draft vocabulary holds."""
    categories = list(dict.fromkeys(r["category"] for r in rows))
    heads = list(dict.fromkeys(r["head"] for r in rows))
    by = {(r["head"], r["category"]): r for r in rows}
    lines = [
        "| head | " + " | ".join(categories) + " | later positions (overall) |",
        "|---|" + "---:|" * len(categories) + "---|",
    ]
    for h in heads:
        cells = [f"{by[(h, c)]['top1'][0]:.3f}" for c in categories]
        later = ", ".join(f"{x:.3f}" for x in by[(h, ALL)]["top1"][1:]) or "-"
        lines.append(f"| {h} | " + " | ".join(cells) + f" | {later} |")
    lines += ["", "| head | top-1 | chain τ | copy positions | top-1 there | τ there | elsewhere: top-1 | τ | "
              "vocabulary coverage |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for h in heads:
        r = by[(h, ALL)]
        if "chain" not in r:
            continue
        c, cp, el = r["chain"], r["copy"], r["elsewhere"]
        share = cp["positions"] / max(1, c["positions"])

        def f(x, fmt=".3f"):
            return "-" if x is None else format(x, fmt)

        lines.append(f"| {h} | {f(c['top1'])} | {f(c['tau'], '.2f')} | {share:.2f} | {f(cp['top1'])} | "
                     f"{f(cp['tau'], '.2f')} | {f(el['top1'])} | {f(el['tau'], '.2f')} | "
                     f"{f(r.get('vocab_coverage'))} |")  # fmt: skip
    return "\n".join(lines)


def load_bench_answers(folder: str | Path) -> tuple[DistillationData, list[str]]:
    """The evaluation-only data of `build_bench_answers` and its sequences' categories."""
    return load_distillation_data(folder, evaluation_only_ok=True), sequence_categories(folder)


# ---------------------------------------------------------------------------------------------------- command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``hf-specdec eval-heads``."""
    shipped = ",".join(name for name, head in SHIPPED_HEADS.items() if head.ships())
    parser.add_argument("--heads", default=shipped, help=f"comma-separated shipped heads (default: {shipped})")
    parser.add_argument(
        "--head-dir", action="append", default=[], metavar="NAME=FOLDER", help="also a head saved in FOLDER"
    )
    parser.add_argument("--per-category", type=positive_int, default=4, help="bench questions per category (default 4)")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="the bench's question sample seed (default 0)")
    parser.add_argument(
        "--max-new-tokens", type=positive_int, default=128, help="answer length, as the bench (default 128)"
    )
    parser.add_argument(
        "--data",
        default=None,
        help="answers folder (default: in the hf-specdec cache); EAGLE-3 heads use its sibling FOLDER-layersA-B-C",
    )
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")


def _heads(args: argparse.Namespace) -> dict[str, torch.nn.Module]:
    from ..cli_args import UsageError

    heads = {}
    for name in filter(None, args.heads.split(",")):
        if name not in SHIPPED_HEADS:
            raise UsageError(f"--heads: unknown head {name!r}; expected some of {', '.join(SHIPPED_HEADS)}")
        heads[name] = SHIPPED_HEADS[name].load()
    for spec in args.head_dir:
        name, sep, folder = spec.partition("=")
        if not sep or not Path(folder, "config.json").is_file():
            raise UsageError(f"--head-dir {spec!r}: expected NAME=FOLDER with a saved head's config.json")
        head_type = saved_head_type(Path(folder))
        kind = kind_of(head_type)
        if kind is None or kind.scorer is None:
            raise UsageError(f"--head-dir {folder}: unknown head_type {head_type!r}")
        heads[name] = kind.load("head").from_pretrained(folder, dtype=torch.float32).eval()
    if not heads:
        raise UsageError("no head to evaluate")
    return heads


def main(args: argparse.Namespace) -> int:
    """Build the bench answers once (cached), score every head on them, print the table."""
    from ..models import cache_root, load_default_model
    from ..training.benchmark_questions import find_questions_file

    heads = _heads(args)
    model, tokenizer = load_default_model()
    rows = []
    for layers, group in _by_feature_layers(model, heads).items():  # EAGLE-3 heads need their layers' states
        if args.data is None:
            folder = bench_answers_folder(cache_root(), args.per_category, args.seed, args.max_new_tokens, layers)
        else:
            folder = with_layers(Path(args.data), layers)
        build_bench_answers(model, tokenizer, find_questions_file(), folder, args.per_category, args.seed,
                            args.max_new_tokens, aux_layers=layers)  # fmt: skip
        data, categories = load_bench_answers(folder)
        rows += evaluate_heads(model, data, group, categories)
        print(f"teacher-forced top-1 on the target's greedy answers to the bench's sample ({folder}):", file=sys.stderr)
    print(format_table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    return 0


def _by_feature_layers(model, heads: Mapping[str, torch.nn.Module]) -> dict[tuple[int, ...], dict]:
    """The heads grouped by the aux layers their data must hold (``()``: the final states only)."""
    groups: dict[tuple[int, ...], dict] = {}
    for name, head in heads.items():
        layers = head.bind(model).feature_layers if _scorer(head).reads_layers(head) else ()
        groups.setdefault(tuple(layers), {})[name] = head
    return groups


__all__ = [
    "bench_answers_folder",
    "with_layers",
    "build_bench_answers",
    "evaluate_heads",
    "format_table",
    "head_top1",
    "load_bench_answers",
    "sequence_categories",
]
