"""Conversations for a tokenizer without a chat template: one plain rendering (`hf_specdec.models.chat_text`) that
``hf-specdec bench`` builds its prompts with and states in its report header, and ``--chat-template`` values that
cannot work refused in one line naming the option, before any model weights load."""

from __future__ import annotations

import pytest
import torch

from hf_specdec.models import PLAIN_RENDERING, chat_prompt_ids, chat_rendering
from hf_specdec.testing import TINY_CHAT_TEMPLATE, tiny_chat_tokenizer

WORDS = ["hello", "world", "System:", "User:", "Assistant:"]


def plain_tokenizer():
    return tiny_chat_tokenizer(WORDS, chat_template=None)


def test_bench_prompts_use_the_plain_rendering():
    from hf_specdec.bench.spec_bench import build_prompts

    tok = plain_tokenizer()
    questions = [{"question_id": 7, "category": "qa", "turns": ["hello world", "ignored"]}]
    (prompt,) = build_prompts(tok, questions)
    assert tok.convert_ids_to_tokens(prompt.ids.tolist()) == ["User:", "hello", "world", "Assistant:"]
    assert prompt.ids.dtype == torch.long and prompt.ids.shape == (4,)
    ids = chat_prompt_ids(tok, "hello", system="world")  # [1, 5]
    assert tok.convert_ids_to_tokens(ids[0].tolist()) == ["System:", "world", "User:", "hello", "Assistant:"]
    assert chat_rendering(tok) == PLAIN_RENDERING and "sha256" in chat_rendering(tiny_chat_tokenizer(WORDS))


def test_the_bench_report_header_states_the_prompt_format():
    from hf_specdec.bench.report import markdown_report

    assert f"- prompt format: {PLAIN_RENDERING}" in markdown_report([], {"prompt_format": PLAIN_RENDERING})


def test_the_agentic_workload_builds_its_prompts_the_same_way():
    from hf_specdec.bench.agentic import sessions, turn_prompt

    tok = plain_tokenizer()
    session = sessions()[0]
    ids = turn_prompt(tok, session, 0, [])  # [n]
    assert tok.convert_ids_to_tokens(ids.tolist())[0] == "User:" and ids[-1] == tok.convert_tokens_to_ids("Assistant:")


@pytest.fixture
def base_tokenizer_folder(tmp_path):
    """A folder holding only a tokenizer without a chat template (enough for the checks made before loading)."""
    folder = tmp_path / "base"
    plain_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture
def no_loading(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("model weights were loaded before --chat-template was checked")

    monkeypatch.setattr("hf_specdec.models.load_default_model", refuse)
    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", refuse)


BAD_TEMPLATES = {
    "missing.jinja": "no such file",
    "{% if %}": "does not render a conversation (TemplateSyntaxError",
    "{{ 'no messages here' }}": "renders a conversation without its messages' text",
    "{{ raise_exception('no system role') }}": "does not render a conversation (TemplateError: no system role)",
}


@pytest.mark.parametrize("command", [["train", "eagle"], ["train", "medusa"], ["bench"]])
@pytest.mark.parametrize("value", list(BAD_TEMPLATES))
def test_a_bad_chat_template_is_refused_before_loading(command, value, base_tokenizer_folder, no_loading, tmp_path,
                                                       capsys, monkeypatch):  # fmt: skip
    from hf_specdec.cli import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        main([*command, "--out", str(tmp_path / "out"), "--model", str(base_tokenizer_folder),
              "--chat-template", value])  # fmt: skip
    assert info.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(lines) == 1 and f"error: --chat-template {value}: {BAD_TEMPLATES[value]}" in lines[0], lines


def test_a_chat_template_file_that_renders_passes_the_check(base_tokenizer_folder, tmp_path, capsys):
    import argparse

    from hf_specdec.cli_args import check_chat_template_option

    path = tmp_path / "chat.jinja"
    path.write_text(TINY_CHAT_TEMPLATE, encoding="utf-8")
    check_chat_template_option(argparse.Namespace(model=str(base_tokenizer_folder), chat_template=str(path)))
    assert "no chat template" not in capsys.readouterr().err
    check_chat_template_option(argparse.Namespace(model=str(base_tokenizer_folder), chat_template=None))
    assert "no chat template, conversations rendered as plain text" in capsys.readouterr().err
