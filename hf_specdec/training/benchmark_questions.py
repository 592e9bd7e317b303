"""The benchmark's questions, which training must never see: the Spec-Bench question file and the overlap check.

The file ships in the package (``hf_specdec/assets/spec-bench/spec_bench_public.jsonl``: 240 Spec-Bench questions,
Apache-2.0, see the NOTICE.md beside it). The training prompt builders drop any prompt that matches one of its turns
(`spec_bench_overlap`); the benchmark (``hf_specdec.bench.questions``) samples from the same file.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from pathlib import Path

QUESTIONS_FILENAME = "spec_bench_public.jsonl"
PACKAGED_QUESTIONS = Path(__file__).resolve().parents[1] / "assets" / "spec-bench" / QUESTIONS_FILENAME


def find_questions_file(explicit: str | os.PathLike | None = None) -> Path:
    """The Spec-Bench question file: ``explicit`` if given, else the copy that ships in the package."""
    path = PACKAGED_QUESTIONS if explicit is None else Path(explicit).expanduser()
    if not path.is_file():
        where = "question file" if explicit is not None else "the Spec-Bench questions shipped in the package,"
        raise FileNotFoundError(
            f"{where} {path} does not exist; pass a JSONL file with question_id, category and turns per line "
            "(hf-specdec bench --questions PATH)"
        )
    return path


def read_questions(path: str | os.PathLike) -> list[dict]:
    """Every question of a Spec-Bench JSONL file (``question_id``, ``category``, non-empty ``turns`` checked)."""
    questions = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            q = json.loads(line)
            missing = {"question_id", "category", "turns"} - q.keys()
            if missing or not q["turns"]:
                raise ValueError(f"{path}:{lineno}: a question needs question_id, category and a non-empty turns list")
            questions.append(q)
    return questions


def spec_bench_overlap(prompts: Sequence[str], questions_path: str | os.PathLike) -> list[str]:
    """The prompts that equal (whitespace/case-insensitively) or contain a turn of the Spec-Bench file."""

    def norm(s: str) -> str:
        return " ".join(s.lower().split())

    turns = {norm(t) for q in read_questions(questions_path) for t in q["turns"]}
    turns.discard("")
    return [p for p in prompts if norm(p) in turns or any(t in norm(p) for t in turns if len(t) > 40)]


def spec_bench_shared_spans(texts: Sequence[str], questions_path: str | os.PathLike, words: int = 10) -> list[int]:
    """Indices of the ``texts`` that share a run of ``words`` consecutive words (case and punctuation ignored) with a
    turn of the Spec-Bench file: a paraphrased or quoted question, which `spec_bench_overlap`'s whole-turn match
    misses."""

    def runs(text: str) -> set[tuple[str, ...]]:
        w = re.findall(r"\w+", text.lower())
        return {tuple(w[i : i + words]) for i in range(len(w) - words + 1)}

    question_runs = set().union(*(runs(t) for q in read_questions(questions_path) for t in q["turns"]))
    return [i for i, text in enumerate(texts) if not question_runs.isdisjoint(runs(text))]
