"""Every ```python block of every user page runs (issue 69): the README, docs/*.md (not docs/lab/, not the generated
docs/cli.md and docs/api/), custom_generate/README.md and the shipped heads' model cards.

A page's blocks run in order in one namespace, in a temporary working directory, offline (HF_HUB_OFFLINE=1). What CI
cannot have is handled in one of two ways, both visible here or in the page:

- `SUBSTITUTIONS`: the few edits that make a block runnable on the CI machine (a CPU, no network, 2 cores): a Hub id
  becomes the default model's converted folder (the same SmolLM2-135M-Instruct as `load_default_model()`),
  ``"cuda"`` becomes ``"cpu"``, a sample's sizes shrink where its point survives. Each must still match its page.
- a block that cannot run here is marked in its page with ``<!-- not run in CI: REASON -->`` on the line before it.

scripts/gpu_check.sh runs the pages with GPU blocks on the GPU: ``HF_SPECDEC_DOC_BLOCKS_DEVICE=cuda`` leaves out the
substitutions marked ``gpu`` (``"cuda"`` stays ``"cuda"``) and runs only those pages.

The ```bash blocks are not run; the ``hf-specdec`` subcommands they name must exist.
"""

from __future__ import annotations

import argparse
import os
import re
import time
from pathlib import Path
from typing import NamedTuple

import pytest
from test_readme_snippets import marked_blocks

ROOT = Path(__file__).resolve().parents[2]
GENERATED = {"docs/cli.md"}  # scripts/write_cli_reference.py writes it (docs/api/ is pdoc's; docs/lab/ is notes)
PAGES = [
    "README.md",
    *(f"docs/{p.name}" for p in sorted((ROOT / "docs").glob("*.md")) if f"docs/{p.name}" not in GENERATED),
    "custom_generate/README.md",
    *(p.relative_to(ROOT).as_posix() for p in sorted((ROOT / "hf_specdec" / "assets").glob("*/README.md"))),
]
# on a machine with a GPU (scripts/gpu_check.sh): "cuda" to run the `gpu` substitutions' pages as written
DEVICE = os.environ.get("HF_SPECDEC_DOC_BLOCKS_DEVICE", "cpu")


class Substitution(NamedTuple):
    page: str
    written: str  # the text as the page writes it (every occurrence in the page's run blocks is replaced)
    run: str  # what runs instead; {default_model} and {root} are the repr of those folders
    gpu: bool = False  # puts a GPU block on the CPU (left out under HF_SPECDEC_DOC_BLOCKS_DEVICE=cuda)


SMOLLM2 = '"HuggingFaceTB/SmolLM2-135M-Instruct"'
SUBSTITUTIONS = [
    # custom_generate="." means "run from a checkout's root"; the blocks run in a temporary directory
    Substitution("docs/usage.md", 'custom_generate="."', "custom_generate={root}"),
    Substitution("custom_generate/README.md", 'custom_generate="."', "custom_generate={root}"),
    Substitution("custom_generate/README.md", SMOLLM2, "{default_model}"),
    *(Substitution(card, SMOLLM2, "{default_model}") for card in PAGES if card.startswith("hf_specdec/assets/")),
    # a GPU and a Hub model -> the default model on the CPU
    Substitution("docs/gpu.md", '"Qwen/Qwen2.5-0.5B-Instruct"', "{default_model}"),
    Substitution("docs/gpu.md", '.to("cuda")', '.to("cpu")', gpu=True),
    Substitution("docs/own_model.md", '"Qwen/Qwen2.5-7B-Instruct"', "{default_model}"),
    Substitution("docs/own_model.md", 'device_map="cuda"', 'device_map="cpu"', gpu=True),
    Substitution("docs/own_model.md", 'device="cuda"', 'device="cpu"', gpu=True),
    # the training sample: a few prompts and a few steps instead of a real run's (the calls are the point)
    Substitution(
        "docs/own_model.md",
        "num_seed=32, num_tasks=120",
        "num_seed=8, num_tasks=4, seed_max_new_tokens=80, max_new_tokens=16",
    ),
    Substitution("docs/own_model.md", "EagleTrainingConfig()", "EagleTrainingConfig(max_steps=2)"),
    # a placeholder for a folder holding custom_generate/
    Substitution("docs/own_model.md", '"path/or/repo-with-custom_generate"', "{root}"),
]
# Pages whose blocks continue from "your model" as their prose says, with what they are given first.
GIVEN = {
    "docs/troubleshooting.md": (
        "import hf_specdec\n"
        "model, tok = hf_specdec.load_default_model()\n"
        'messages = [{"role": "user", "content": "Summarise: the cat sat on the mat, then slept."}]\n'
    ),
}


def _text(page: str) -> str:
    return (ROOT / page).read_text(encoding="utf-8")


def _run_blocks(page: str) -> dict[int, str]:
    """The page's blocks that run in CI, by their number in the page (1 = its first ```python block)."""
    return {i: body for i, (reason, body) in enumerate(marked_blocks(_text(page)), 1) if reason is None}


def _substitutions(page: str) -> list[Substitution]:
    return [s for s in SUBSTITUTIONS if s.page == page and not (s.gpu and DEVICE != "cpu")]


def _runnable(page: str) -> dict[int, str]:
    """The page's run blocks, as they run here (the substitutions applied), by their number in the page."""
    from hf_specdec.models import default_model_dir

    values = {"root": repr(str(ROOT)), "default_model": repr(str(default_model_dir()))}
    blocks = _run_blocks(page)
    for sub in _substitutions(page):
        blocks = {i: code.replace(sub.written, sub.run.format(**values)) for i, code in blocks.items()}
    return blocks


def test_the_pages_exist_and_some_have_python_blocks():
    assert all((ROOT / page).is_file() for page in PAGES)
    assert {"README.md", "docs/usage.md", "custom_generate/README.md", "docs/gpu.md"} <= set(PAGES)
    assert sum(len(marked_blocks(_text(page))) for page in PAGES) >= 20


def test_a_skipped_block_says_why():
    """Every ``not run in CI`` comment is the line right before a ```python fence and gives a reason."""
    for page in PAGES:
        text = _text(page)
        reasons = [reason for reason, _ in marked_blocks(text) if reason is not None]
        assert all(reasons), f"{page}: a `<!-- not run in CI: REASON -->` without a reason"
        assert len(reasons) == text.count("not run in CI"), (
            f"{page}: a `not run in CI` comment not right before a block"
        )


def test_python_blocks_are_tagged_python():
    """A Python block tagged ```py, ```python3 or ```pycon would be skipped silently."""
    for page in PAGES:
        tags = set(re.findall(r"^```(\S*)[ \t]*\n(?:.*?)^```[ \t]*$", _text(page), flags=re.MULTILINE | re.DOTALL))
        other = {tag for tag in tags if re.match(r"(i?py|python)", tag, re.IGNORECASE) and tag != "python"}
        assert not other, f"{page}: tag these blocks ```python: {sorted(other)}"


def test_every_substitution_still_applies():
    for sub in SUBSTITUTIONS:
        assert sub.page in PAGES, sub
        assert any(sub.written in code for code in _run_blocks(sub.page).values()), (
            f"{sub.page} no longer has {sub.written!r}"
        )
    for page in GIVEN:
        assert _run_blocks(page), page


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(actions[0].choices) if actions else {}


def test_the_shell_blocks_name_existing_subcommands():
    """``hf-specdec SUBCOMMAND`` (and ``hf-specdec train KIND``) in a ```bash block of a page is in the CLI's parser."""
    from hf_specdec.cli import build_parser

    commands = _subcommands(build_parser())
    named = 0
    for page in PAGES:
        for _, body in marked_blocks(_text(page), "bash"):
            for m in re.finditer(r"\bhf-specdec[ \t]+([a-z][\w-]*)(?:[ \t]+([a-z][\w-]*))?", body):
                named += 1
                assert m[1] in commands, f"{page}: `hf-specdec {m[1]}` is not a subcommand ({sorted(commands)})"
                kinds = _subcommands(commands[m[1]])
                if kinds:
                    assert m[2] in kinds, f"{page}: `hf-specdec {m[1]} {m[2]}` is not one of {sorted(kinds)}"
    assert named >= 10


def _pages_to_run() -> list[str]:
    pages = [page for page in PAGES if _run_blocks(page)]
    if DEVICE != "cpu":
        pages = [page for page in pages if any(s.gpu for s in SUBSTITUTIONS if s.page == page)]
    return pages


@pytest.mark.slow
@pytest.mark.parametrize("page", _pages_to_run())
def test_the_python_blocks_of_a_page_run(page, tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read once, when huggingface_hub loads
    namespace: dict = {"__name__": "__doc_block__"}
    if page in GIVEN:
        exec(compile(GIVEN[page], f"{page}: given", "exec"), namespace)  # noqa: S102
    for i, code in _runnable(page).items():
        t0 = time.perf_counter()
        exec(compile(code, f"{page} python block {i}", "exec"), namespace)  # noqa: S102 - the page's own code
        print(f"{page} python block {i}: {time.perf_counter() - t0:.1f} s")
