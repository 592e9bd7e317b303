"""The six-kind training prompts: deterministic, distinct, every kind present, multi-turn chats carry the target's own
first answer, several languages, and no prompt shares text with the Spec-Bench questions."""

from __future__ import annotations

from collections import Counter

import pytest

from hf_specdec.training.benchmark_questions import find_questions_file, read_questions, spec_bench_overlap
from hf_specdec.training.task_prompts import (
    FOREIGN_SENTENCES,
    TASK_KINDS,
    collect_seed_material,
    seed_prompts,
    task_prompts,
)

PASSAGE = " ".join(["The new library in Porto opened on Monday with more than 40,000 books."] * 5)


def fake_material():
    seeds = seed_prompts(60, seed=1)
    answers = []
    for p in seeds:
        if p.kind == "seed_passage":
            answers.append(PASSAGE + f" ({len(answers)})")
        elif p.kind == "seed_question":
            answers.append("1. Who opened the library?\n2. How many books does it hold?\nnot a question")
        else:
            answers.append(f"Dear Anna, here is my answer number {len(answers)}.")
    return seeds, collect_seed_material(seeds, answers)


def test_seed_prompts_are_deterministic_and_distinct():
    a, b = seed_prompts(48, seed=0), seed_prompts(48, seed=0)
    assert [p.messages for p in a] == [p.messages for p in b]
    assert len({repr(p.messages) for p in a}) == 48
    assert set(Counter(p.kind for p in a)) == {"seed_passage", "seed_question", "seed_first_turn"}


def test_material_is_sorted_by_kind():
    seeds, material = fake_material()
    kinds = Counter(p.kind for p in seeds)
    assert len(material.passages) == kinds["seed_passage"]
    assert len(material.questions) == 2 * kinds["seed_question"]
    assert all(q.endswith("?") for q in material.questions)
    assert len(material.conversations) == kinds["seed_first_turn"]


def test_task_prompts_cover_the_six_kinds():
    _, material = fake_material()
    tasks = task_prompts(material, 120, seed=0)
    counts = Counter(t.kind for t in tasks)
    # kinds come round-robin; a kind whose draw repeats an earlier prompt loses that turn (qa here: the fake material
    # holds only two questions)
    assert set(counts) == set(TASK_KINDS) and min(counts.values()) >= 10
    multi = [t for t in tasks if t.kind == "multi_turn"]
    assert all([m["role"] for m in t.messages] == ["user", "assistant", "user"] for t in multi)
    languages = {lang for t in tasks if t.kind == "translation" for lang in FOREIGN_SENTENCES if lang in t.text}
    assert len(languages) >= 3
    assert any(PASSAGE in t.text for t in tasks if t.kind == "rag")
    assert task_prompts(material, 120, seed=0) == tasks


def test_no_spec_bench_text():
    _, material = fake_material()
    texts = [m["content"] for t in task_prompts(material, 240, seed=0) for m in t.messages if m["role"] == "user"]
    texts += [p.text for p in seed_prompts(120, seed=0)]
    path = find_questions_file()
    assert spec_bench_overlap(texts, path) == []
    turns = {t.lower() for q in read_questions(path) for t in q["turns"]}
    for sentences in FOREIGN_SENTENCES.values():
        for s in sentences:
            fixed = s.split("{")[0].strip().lower()
            assert not any(fixed and fixed in t for t in turns), s


def test_too_little_material_is_refused():
    _, material = fake_material()
    material.passages = material.passages[:2]
    with pytest.raises(ValueError, match="need at least 3 passages"):
        task_prompts(material, 10)
