"""Training data over the six task kinds of `task_prompts`, in two stages: the target writes its seed material, then
answers the task prompts built over it; each stage a `distillation_data` folder plus ``kinds.json`` (each sequence's
kind).

    folders = build_task_data(model, tok, "out/data", num_seed=120, num_tasks=600, real_text=True)
    data = load_distillation_data(folders)
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .benchmark_questions import find_questions_file, spec_bench_overlap
from .chat_template import chat_ids, chat_rendering
from .distillation_data import build_distillation_data
from .shards import load_distillation_data
from .task_prompts import TaskPrompt, collect_seed_material, recipe, seed_prompts, task_prompts
from .text_sources import LocalText, require_local_text

KINDS_NAME = "kinds.json"


def _drop_benchmark_overlap(prompts: list[TaskPrompt]) -> tuple[list[TaskPrompt], int]:
    """The prompts none of whose user turns equals or contains a Spec-Bench turn, and how many were dropped."""
    texts = [m["content"] for p in prompts for m in p.messages if m["role"] == "user"]
    bad = set(spec_bench_overlap(texts, find_questions_file()))
    kept = [p for p in prompts if not any(m["content"] in bad for m in p.messages if m["role"] == "user")]
    return kept, len(prompts) - len(kept)


def _length_sorted_blocks(ids: list[list[int]], block: int) -> list[int]:
    """An order of ``ids`` that keeps each block of ``block`` consecutive prompts together (so a partly built folder
    still mixes every kind) but sorts each block by length, so that a batch pads little."""
    order: list[int] = []
    for start in range(0, len(ids), block):
        order += sorted(range(start, min(start + block, len(ids))), key=lambda i: len(ids[i]))
    return order


def _build_stage(
    model, tokenizer, prompts: list[TaskPrompt], folder: Path, stage_recipe: dict, **kwargs
) -> list[TaskPrompt]:
    """Build one stage's folder (resumable) and return its prompts in the order the data holds them."""
    prompts, dropped = _drop_benchmark_overlap(prompts)
    ids = [chat_ids(tokenizer, p.messages) for p in prompts]
    order = _length_sorted_blocks(ids, int(kwargs.get("shard_size", 64)))
    prompts, ids = [prompts[i] for i in order], [ids[i] for i in order]
    folder.mkdir(parents=True, exist_ok=True)
    kinds = {"kinds": [p.kind for p in prompts], "dropped_spec_bench_overlap": dropped}
    (folder / KINDS_NAME).write_text(json.dumps(kinds) + "\n", encoding="utf-8")
    described = {**stage_recipe, "dropped_spec_bench_overlap": dropped, "chat_template": chat_rendering(tokenizer)}
    build_distillation_data(model, ids, folder, recipe=described, **kwargs)
    return prompts


def build_task_data(
    model,
    tokenizer,
    out_dir: str | os.PathLike,
    num_seed: int = 120,
    num_tasks: int = 600,
    seed: int = 0,
    seed_max_new_tokens: int | None = None,
    real_text: bool | LocalText = False,
    **kwargs,
) -> list[Path]:
    """Build (or resume) the two-stage data: ``out_dir/seed`` (the target writing its material) and ``out_dir/tasks``
    (the six task kinds over it), each a `build_distillation_data` folder plus ``kinds.json`` (each sequence's kind).

    Args:
        model / tokenizer: the target and its tokenizer (with a chat template).
        out_dir: the data root (created).
        num_seed / num_tasks: prompts of each stage.
        seed: prompt seed.
        seed_max_new_tokens: answer length cap of the seed stage (default: ``max_new_tokens`` of ``kwargs``).
        real_text: also build prompts over real text: True = the text installed on this machine
            (`text_sources.require_local_text`: foreign sentences to translate, English passages to summarise and
            answer from), or a `LocalText` of your own.
        **kwargs: passed to `build_distillation_data` (``max_new_tokens``, ``batch_size``, ``hidden_dtype``...).
    Returns:
        both folders, for `load_distillation_data`.

    Raises:
        FileNotFoundError: ``real_text`` and the packages holding it are not installed (the message names them).
    """
    out = Path(out_dir)
    real = real_text if isinstance(real_text, LocalText) else (require_local_text() if real_text else None)
    rec = recipe(num_seed, num_tasks, seed, real_text)
    seeds = seed_prompts(num_seed, seed)
    seed_dir, task_dir = out / "seed", out / "tasks"
    seed_kwargs = {**kwargs, **({"max_new_tokens": seed_max_new_tokens} if seed_max_new_tokens else {})}
    seeds = _build_stage(model, tokenizer, seeds, seed_dir, {**rec, "stage": "seed"}, **seed_kwargs)
    data = load_distillation_data(seed_dir)
    answers = [
        tokenizer.decode(data.input_ids[a:e].tolist(), skip_special_tokens=True) for _, a, e in data.seq_bounds.tolist()
    ]
    material = collect_seed_material(seeds, answers)
    material.real = real
    tasks = task_prompts(material, num_tasks, seed)
    _build_stage(model, tokenizer, tasks, task_dir, {**rec, "stage": "tasks", **material.counts()}, **kwargs)
    return [seed_dir, task_dir]


def sequence_kinds(folder: str | os.PathLike) -> list[str]:
    """The task kind of each sequence of a folder built by `build_task_data` (from its ``kinds.json``)."""
    path = Path(folder) / KINDS_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; the folder was not built by build_task_data")
    return json.loads(path.read_text(encoding="utf-8"))["kinds"]


__all__ = ["KINDS_NAME", "build_task_data", "sequence_kinds"]
