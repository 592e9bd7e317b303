"""The project's default self-distillation data: `template_prompts`' prompt set in the tokenizer's chat template (or
`chat_template`'s plain rendering when it has none), answered by the target (`distillation_data`), in one or two
stages, with any prompt that matches a Spec-Bench question dropped.

    folders = build_default_data(model, tok, "out/data", num_prompts=2000, num_context_prompts=500)
    data = load_distillation_data(folders)
"""

from __future__ import annotations

import os
from pathlib import Path

from .benchmark_questions import find_questions_file, spec_bench_overlap
from .chat_template import chat_ids, chat_rendering
from .distillation_data import build_distillation_data
from .shards import load_distillation_data
from .template_prompts import context_prompt_recipe, make_context_prompts, make_prompts, prompt_recipe

CONTEXT_STAGE_DIR = "context"  # stage-2 data, inside the stage-1 folder


def build_default_data(
    model,
    tokenizer,
    out_dir: str | os.PathLike,
    num_prompts: int = 2000,
    seed: int = 0,
    num_context_prompts: int = 0,
    **kwargs,
) -> list[Path]:
    """The project's self-distillation data in ``tokenizer``'s chat template, in one or two stages.

    Stage 1 (``out_dir``): `build_distillation_data` on `make_prompts(num_prompts, seed)`. Stage 2
    (``out_dir/context``, when ``num_context_prompts`` > 0): on `make_context_prompts` built from stage 1's answers.
    Prompts that coincide with a Spec-Bench question (the file shipped in the package) are dropped and counted.

    Returns:
        the data folders, for `load_distillation_data`.
    """
    questions_file = find_questions_file()

    def build(prompts: list[str], recipe: dict, folder: Path) -> None:
        dropped = set(spec_bench_overlap(prompts, questions_file))
        prompts = [p for p in prompts if p not in dropped]
        recipe["dropped_spec_bench_overlap"] = len(dropped)
        recipe["chat_template"] = chat_rendering(tokenizer)
        ids = [chat_ids(tokenizer, [{"role": "user", "content": p}]) for p in prompts]
        build_distillation_data(model, ids, folder, recipe=recipe, seed=seed, **kwargs)

    out = Path(out_dir)
    build(make_prompts(num_prompts, seed), prompt_recipe(num_prompts, seed), out)
    folders = [out]
    if num_context_prompts > 0:
        stage1 = load_distillation_data(out)
        context = make_context_prompts(stage1, tokenizer, num_context_prompts, seed)
        build(context, context_prompt_recipe(num_context_prompts, seed), out / CONTEXT_STAGE_DIR)
        folders.append(out / CONTEXT_STAGE_DIR)
    return folders


__all__ = ["CONTEXT_STAGE_DIR", "build_default_data"]
