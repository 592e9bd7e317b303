"""The Spec-Bench question set: pooling MT-bench's categories, a deterministic sample, Spec-Bench's order.

The file itself (shipped in the package) is located and read by `hf_specdec.training.benchmark_questions`, whose
prompt builders must never train on these questions.

Spec-Bench (Xia et al., 2024, hemingkx/Spec-Bench) reports six task categories; its leaderboard pools MT-bench's
eight categories into one "multi-turn conversation" category. The prompt is the first turn of each question.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterable, Sequence

from ..training.benchmark_questions import PACKAGED_QUESTIONS, QUESTIONS_FILENAME, find_questions_file, read_questions

MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
MULTI_TURN = "multi-turn conversation"
# Spec-Bench's order: multi-turn conversation, translation, summarization, QA, math reasoning, RAG.
CATEGORY_ORDER = (MULTI_TURN, "translation", "summarization", "qa", "math_reasoning", "rag")


def pooled_category(category: str) -> str:
    """Spec-Bench's reporting category of a question: MT-bench's eight categories become "multi-turn conversation"."""
    return MULTI_TURN if category in MT_BENCH_CATEGORIES else category


def category_sort_key(category: str) -> tuple[int, str]:
    """Orders categories as Spec-Bench does; unknown ones after, alphabetically."""
    return (CATEGORY_ORDER.index(category), "") if category in CATEGORY_ORDER else (len(CATEGORY_ORDER), category)


def load_questions(path: str | os.PathLike) -> list[dict]:
    """Every question of a Spec-Bench JSONL file (`read_questions`), each with an added ``pooled_category`` field."""
    return [{**q, "pooled_category": pooled_category(q["category"])} for q in read_questions(path)]


def sample_questions(
    questions: Iterable[dict], per_category: int, seed: int = 0, categories: Sequence[str] | None = None
) -> list[dict]:
    """A deterministic sample of ``per_category`` questions from every pooled category, in Spec-Bench's order.

    Within a pooled category the questions are shuffled per source category with a fixed seed and then taken round
    robin over the source categories, so four multi-turn questions come from four different MT-bench categories.
    The result depends only on the file's contents, ``per_category`` and ``seed``.

    Args:
        questions: as returned by `load_questions`.
        per_category: questions per pooled category (all of them if the category has fewer).
        seed: sampling seed.
        categories: pooled categories to keep (default: all).
    """
    if per_category < 1:
        raise ValueError(f"per_category must be at least 1, got {per_category}")
    groups: dict[str, dict[str, list[dict]]] = {}
    for q in questions:
        pooled = q.get("pooled_category") or pooled_category(q["category"])
        groups.setdefault(pooled, {}).setdefault(q["category"], []).append(q)
    if categories is not None:
        unknown = sorted(set(categories) - groups.keys())
        if unknown:
            raise ValueError(f"unknown categories {unknown}; the question file has {sorted(groups)}")
        groups = {c: groups[c] for c in categories}
    picked = []
    for pooled in sorted(groups, key=category_sort_key):
        queues = []
        for source in sorted(groups[pooled]):
            qs = sorted(groups[pooled][source], key=lambda q: str(q["question_id"]))
            random.Random(f"{seed}:{source}").shuffle(qs)
            queues.append(qs)
        taken: list[dict] = []
        while len(taken) < per_category and any(queues):
            for queue in queues:
                if queue and len(taken) < per_category:
                    taken.append(queue.pop(0))
        picked.extend(taken)
    return picked


def interleave_categories(questions: Sequence[dict]) -> list[dict]:
    """The questions reordered round robin over pooled categories (batches then mix short and long prompts)."""
    by_cat: dict[str, list[dict]] = {}
    for q in questions:
        by_cat.setdefault(q.get("pooled_category") or pooled_category(q["category"]), []).append(q)
    queues = [by_cat[c] for c in sorted(by_cat, key=category_sort_key)]
    out = []
    while any(queues):
        for queue in queues:
            if queue:
                out.append(queue.pop(0))
    return out


__all__ = [
    "CATEGORY_ORDER",
    "MT_BENCH_CATEGORIES",
    "MULTI_TURN",
    "PACKAGED_QUESTIONS",
    "QUESTIONS_FILENAME",
    "category_sort_key",
    "find_questions_file",
    "interleave_categories",
    "load_questions",
    "pooled_category",
    "sample_questions",
]
