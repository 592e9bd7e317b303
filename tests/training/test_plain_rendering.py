"""A model whose tokenizer has no chat template (a base model): conversations go through the plain rendering
(`hf_specdec.models.chat_text`: "User: ..." / "Assistant: ..." turns, prompt ending "Assistant:"), the assistant
turns are marked on it, and ``hf-specdec train eagle`` / ``train medusa`` train heads for it end to end, stating the
rendering in the report and the head's model card."""

from __future__ import annotations

import json

import pytest
import torch

from hf_specdec.models import PLAIN_RENDERING, chat_text
from hf_specdec.testing import tiny_causal_lm, torch_threads
from hf_specdec.training.chat_template import chat_ids, templated_ids
from hf_specdec.training.conversations import Conversation, Turn


@pytest.fixture(scope="module")
def base_model_folder(tmp_path_factory, base_word_tokenizer):
    """A tiny llama saved with a word tokenizer that has no chat template (as a base model's)."""
    folder = tmp_path_factory.mktemp("base") / "model"
    tiny_causal_lm("llama", vocab_size=64, hidden_size=32, num_layers=3, seed=5).save_pretrained(folder)
    base_word_tokenizer.save_pretrained(folder)
    return folder


def test_the_plain_rendering_marks_exactly_the_assistant_turns(base_word_tokenizer):
    tok = base_word_tokenizer
    turns = (("system", "mu"), ("user", "alpha beta"), ("assistant", "gamma delta"), ("user", "eta"),
             ("assistant", "theta iota kappa"))  # fmt: skip
    conv = Conversation("c", tuple(Turn(role, text) for role, text in turns))
    expected = "".join(f"{role.capitalize()}: {text}\n\n" for role, text in turns)
    assert chat_text(tok, conv.messages()) == expected
    seq = templated_ids(tok, conv)
    words = tok.convert_ids_to_tokens(seq.ids)
    assert words == " ".join(f"{role.capitalize()}: {text}" for role, text in turns).split()
    assert [w for w, m in zip(words, seq.answer_mask) if m] == "gamma delta theta iota kappa".split()
    assert words[seq.first_answer] == "gamma"
    prompt = tok.convert_ids_to_tokens(chat_ids(tok, conv.messages()[:2]))
    assert prompt == "System: mu User: alpha beta Assistant:".split()


def _word_source(word_conversations):
    return word_conversations(24, ((3, 5), (6, 7), (2, 3), (5, 6)))


def test_train_eagle_on_a_model_without_a_chat_template(base_model_folder, word_conversations, tmp_path, monkeypatch,
                                                        capsys):  # fmt: skip
    """``train eagle --model FOLDER --data sharegpt`` on a base model: the conversations teacher-forced in the plain
    rendering, announced at once and stated in the data, the report and the head's card."""
    from hf_specdec.cli import main
    from hf_specdec.training import conversation_data

    monkeypatch.setattr(conversation_data, "load_sharegpt", lambda: _word_source(word_conversations))
    out = tmp_path / "run"
    with torch_threads(1):
        assert main(["train", "eagle", "--out", str(out), "--model", str(base_model_folder), "--data", "sharegpt",
                     "--conversations", "24", "--window", "8", "--max-steps", "2", "--draft-vocab", "0",
                     "--no-tune-tree"]) == 0  # fmt: skip
    assert "no chat template" in capsys.readouterr().err
    manifest = json.loads((out / "data" / "sharegpt" / "fixed" / "manifest.json").read_text())
    assert manifest["prompt_recipe"]["chat_template"] == PLAIN_RENDERING
    report = json.loads((out / "training_report.json").read_text())
    assert report["steps"] == 2 and report["prompt_format"] == PLAIN_RENDERING
    card = json.loads((out / "head" / "config.json").read_text())["model_card"]
    assert card["training_data"].endswith(f"rendered as {PLAIN_RENDERING}")


def test_train_medusa_on_a_model_without_a_chat_template(base_model_folder, tmp_path):
    """``train medusa --model FOLDER``: the default prompts answered in the plain rendering; report and card say so."""
    from hf_specdec.cli import main

    out = tmp_path / "heads"
    with torch_threads(1):
        assert main(["train", "medusa", "--model", str(base_model_folder), "--out", str(out), "--num-prompts", "8",
                     "--num-context-prompts", "0", "--max-new-tokens", "6", "--max-steps", "2", "--num-heads", "2",
                     "--positions-per-step", "16", "--no-tune-tree", "--device", "cpu"]) == 0  # fmt: skip
    report = json.loads((out / "training_report.json").read_text())
    assert report["prompt_format"] == PLAIN_RENDERING
    assert PLAIN_RENDERING in json.loads((out / "config.json").read_text())["model_card"]["training_data"]


def test_the_chat_template_option_is_set_on_the_tokenizer(base_model_folder, tmp_path):
    """``--chat-template FILE`` (or the template itself) replaces the plain rendering once the model loads."""
    from hf_specdec.testing import TINY_CHAT_TEMPLATE
    from hf_specdec.training.trainer_cli import load_model_option

    path = tmp_path / "chat.jinja"
    path.write_text(TINY_CHAT_TEMPLATE, encoding="utf-8")
    for value in (str(path), TINY_CHAT_TEMPLATE):
        _, tok, _ = load_model_option(str(base_model_folder), chat_template=value, dtype=torch.float32)
        assert tok.chat_template == TINY_CHAT_TEMPLATE
        words = tok.convert_ids_to_tokens(chat_ids(tok, [{"role": "user", "content": "alpha"}]))
        assert words[0] == words[-2] == "<|im_start|>" and "Assistant:" not in words  # ChatML, not plain
