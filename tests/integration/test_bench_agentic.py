"""``hf-specdec bench --workload agentic``: the sessions, the prompts built from earlier answers, the CLI checks, and a
smoke run on a tiny model with the default model's tokenizer (chat template)."""

from __future__ import annotations

import argparse
from dataclasses import replace

import pytest

from hf_specdec.bench import agentic
from hf_specdec.bench.methods import resolve_methods
from hf_specdec.bench.report import summarize
from hf_specdec.bench.spec_bench import settings_for
from hf_specdec.cli import build_parser
from hf_specdec.cli_args import UsageError
from hf_specdec.generation.proposers.suffix import SuffixAssistant
from hf_specdec.testing import tiny_causal_lm


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from hf_specdec.models import default_model_dir

    return AutoTokenizer.from_pretrained(default_model_dir())


def test_sessions_cover_the_three_kinds_interleaved():
    sessions = agentic.sessions()
    assert [s.category for s in sessions[:3]] == list(agentic.CATEGORIES)
    assert {s.category for s in sessions} == set(agentic.CATEGORIES)
    assert all(len(s.turns) >= 3 for s in sessions)


def test_later_turns_carry_the_earlier_answers(tokenizer):
    by_kind = {s.category: s for s in reversed(agentic.sessions())}
    answers = ["FIRST ANSWER", "SECOND ANSWER"]
    conversation = tokenizer.decode(agentic.turn_prompt(tokenizer, by_kind[agentic.REVISION], 2, answers))
    assert "FIRST ANSWER" in conversation and "SECOND ANSWER" in conversation
    assert by_kind[agentic.REVISION].turns[2] in conversation
    edit = tokenizer.decode(agentic.turn_prompt(tokenizer, by_kind[agentic.AGENT], 2, answers))
    assert "SECOND ANSWER" in edit and "FIRST ANSWER" not in edit  # the current file only
    structured = tokenizer.decode(agentic.turn_prompt(tokenizer, by_kind[agentic.STRUCTURED], 2, answers))
    assert "ANSWER" not in structured  # independent calls


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["bench", "--workload", "agentic", *argv])


def test_cli_checks_the_agentic_options():
    methods, settings, chosen = agentic.checked_arguments(_args("--methods", "ngram", "--per-category", "1"))
    assert [m.name for m in methods] == ["vanilla", "ngram"] and len(settings) == 1
    assert [s.category for s in chosen] == list(agentic.CATEGORIES)
    only = agentic.checked_arguments(_args("--categories", "structured output"))[2]
    assert {s.category for s in only} == {agentic.STRUCTURED}
    for argv, message in (
        (("--batch", "4"), "--batch"),
        (("--full",), "--full"),
        (("--categories", "qa"), "unknown"),
        (("--methods", "nope"), "unknown methods"),
    ):
        with pytest.raises(UsageError, match=message):
            agentic.checked_arguments(_args(*argv))


def test_agentic_smoke_run_on_a_tiny_model(tokenizer):
    model = tiny_causal_lm("llama", vocab_size=len(tokenizer), num_layers=1)
    methods = resolve_methods("suffix,ngram")
    chosen = [replace(s, turns=s.turns[:2]) for s in agentic.sessions() if s.name in ("python-function", "table")]
    run = agentic.run_agentic(model, tokenizer, methods, settings_for(False), chosen, max_new_tokens=8)
    turns = sum(len(s.turns) for s in chosen)
    assert len(run.records) == turns * len(methods)
    assert all(r["match"] for r in run.records if r["method"] != "vanilla")
    suffix = run.assistants["suffix"]
    assert isinstance(suffix, SuffixAssistant) and suffix.store.num_documents == turns  # one assistant for the run
    summary = summarize(run.records)
    table = agentic.throughput_section(summary)
    assert "| vanilla |" in table and "**1.00x**" in table
    assert f"| suffix | {turns} |" in agentic.store_section(run.assistants)
