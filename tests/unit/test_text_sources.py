"""Real text for training prompts: the handbook's paragraphs and the fortune files are parsed from folders the test
writes with the installed packages' layout; prompts over them are deterministic and use them; a machine without them
gets an error naming the packages."""

from __future__ import annotations

import pytest

from hf_specdec.training.task_prompts import REAL_TEXT_SHARE, SeedMaterial, task_prompts
from hf_specdec.training.text_sources import (
    LocalText,
    find_local_text,
    fortune_entries,
    handbook_passages,
    html_paragraphs,
    require_local_text,
    sentences,
)

EN_PARAS = [
    "Linux is a multi-user system, so it needs a permission system to control what each user may do with files.",
    "Every file has an owner and a group, and three sets of rights: for the owner, the group, and everyone else.",
    "Directories are handled differently: the right to read lists the entries and the right to execute enters it.",
    "The mirror network keeps copies of the archive close to the users, which makes downloads fast and reliable.",
]
DE_PARAS = [
    "Linux ist ein Mehrbenutzersystem. Deshalb braucht es ein System von Rechten für Dateien und Verzeichnisse.",
    "Jede Datei hat einen Eigentümer und eine Gruppe. Es gibt drei Arten von Rechten für verschiedene Benutzer.",
    "This paragraph was never translated and stays in English in every language of the book.",
]


def page(title: str, paragraphs: list[str]) -> str:
    body = "".join(f'<div class="para">\n  {p}\n</div>' for p in paragraphs)
    return (
        '<html><body><p id="title"><a href="x"><img/></a></p><ul class="docnav"><li>Zurück</li></ul>'
        f'<div class="section"><h2 class="title">{title}</h2>{body}'
        "<pre>apt install code --that-is-not prose and should be dropped from the paragraphs</pre>"
        '<div class="para">A paragraph with <code>inline code</code> and <div class="para">a nested one</div> '
        "that still reads as one prose paragraph of the page.</div></div></body></html>"
    )


@pytest.fixture
def sources(tmp_path):
    book, fortunes = tmp_path / "handbook", tmp_path / "fortunes"
    (book / "en-US").mkdir(parents=True)
    (book / "de-DE").mkdir()
    (book / "en-US" / "sect.rights.html").write_text(
        page("8.1. Rights", EN_PARAS * 4 + [DE_PARAS[-1]]), encoding="utf-8"
    )
    (book / "de-DE" / "sect.rights.html").write_text(page("8.1. Rechte", DE_PARAS), encoding="utf-8")
    (fortunes / "de").mkdir(parents=True)
    entries = ["Wer zuletzt lacht, hat es nicht eher begriffen, sagt ein altes Sprichwort.", "|__|__|__|", "Kurz."]
    (fortunes / "de" / "sprichworte").write_text("\n%\n".join(entries) + "\n%\n", encoding="latin-1")
    (fortunes / "de" / "sprichworte.u8").write_text("\n%\n".join(entries) + "\n%\n", encoding="utf-8")
    (fortunes / "de" / "sprichworte.dat").write_bytes(b"\x00\x01binary index")
    return book, fortunes


def test_paragraphs_of_a_handbook_page():
    paras = html_paragraphs(page("8.1. Rights", EN_PARAS))
    assert [p for _, p in paras[: len(EN_PARAS)]] == EN_PARAS
    assert {t for t, _ in paras} == {"8.1. Rights"}
    assert paras[-1][1].startswith("A paragraph with inline code and a nested one that still reads")
    assert not any("apt install" in p for _, p in paras)  # <pre> and navigation are not prose


def test_passages_join_consecutive_paragraphs(sources):
    book, _ = sources
    passages = handbook_passages(book / "en-US", min_words=20, max_words=45)
    assert all(title == "8.1. Rights" for title, _ in passages)
    assert passages[0][1] == "\n\n".join(EN_PARAS[:2])  # 19 + 20 words; a third would pass 45
    assert all(20 <= len(text.split()) for _, text in passages)


def test_fortunes_and_sentences():
    text = "Erste Zeile eines langen\nSpruchs über das Leben und die Kunst.\n\t-- Autor\n%\n|__|__|\n%\n"
    assert fortune_entries(text) == ["Erste Zeile eines langen Spruchs über das Leben und die Kunst."]
    para = "Dies ist der erste Satz des Absatzes hier. Ärger gibt es im zweiten Satz nicht, sagt er! Kurz."
    assert sentences(para) == [
        "Dies ist der erste Satz des Absatzes hier.",
        "Ärger gibt es im zweiten Satz nicht, sagt er!",
    ]


def test_local_text_reads_both_sources_and_drops_untranslated_paragraphs(sources):
    book, fortunes = sources
    found = find_local_text(book, fortunes)
    german = found.foreign["German"]
    assert "Linux ist ein Mehrbenutzersystem." not in german  # too short (MIN_WORDS)
    assert "Deshalb braucht es ein System von Rechten für Dateien und Verzeichnisse." in german
    assert "Wer zuletzt lacht, hat es nicht eher begriffen, sagt ein altes Sprichwort." in german  # the .u8 copy
    assert sum("Sprichwort" in t for t in german) == 1  # latin-1 original and .u8 copy read once
    assert not any("never translated" in t for t in german)
    assert found.sources["fortunes:German"] == 1 and "Spanish" not in found.foreign


def test_local_text_saved_and_loaded_elsewhere(sources, tmp_path):
    """The text travels as one JSON file to a machine without the packages (data built on a GPU machine)."""
    found = find_local_text(*sources)
    again = LocalText.load(found.save(tmp_path / "text.json"))
    assert again == found and isinstance(again.passages[0], tuple)
    with pytest.raises(ValueError, match="0 passages"):
        LocalText.load(LocalText(foreign={"German": ["x"]}).save(tmp_path / "empty.json"))


def test_missing_sources_name_the_packages(tmp_path):
    with pytest.raises(FileNotFoundError, match="fortunes-de.*install_text_sources.sh"):
        require_local_text(handbook=tmp_path / "none", fortunes=tmp_path / "none")


def test_task_prompts_use_the_real_text():
    real = LocalText(
        passages=[(f"Section {i}", f"Paragraph {i} of the real manual. " + " ".join(EN_PARAS)) for i in range(40)],
        foreign={"German": [f"Satz {i} aus einem echten Buch, mit einem Komma und einem Punkt." for i in range(60)]},
    )
    own = [
        (f"Library {i}", f"The library number {i} opened on Monday with many books and a new cafe.") for i in range(8)
    ]
    material = SeedMaterial(own, ["Who opened the library?"], [("Write a poem.", "Roses are red.")], real=real)
    tasks = task_prompts(material, 240, seed=3)
    assert [t.messages for t in tasks] == [t.messages for t in task_prompts(material, 240, seed=3)]
    translations = [t.text for t in tasks if t.kind == "translation"]
    real_translations = [t for t in translations if "aus einem echten Buch" in t]
    assert len(translations) * REAL_TEXT_SHARE * 0.6 <= len(real_translations) < len(translations)
    assert any(" , mit" in t and t.endswith(" .") for t in real_translations)  # spaced punctuation
    assert any(", mit" in t and t.endswith("Punkt.") for t in real_translations)
    summaries = [t.text for t in tasks if t.kind == "summarisation"]
    real_summaries = [t for t in summaries if "of the real manual" in t]
    assert len(summaries) * REAL_TEXT_SHARE * 0.6 <= len(real_summaries) < len(summaries)
    rag = [t.text for t in tasks if t.kind == "rag"]
    assert any("of the real manual" in t and "The library number" in t for t in rag)  # documents of both sources


def test_build_task_data_over_real_text(default_model, tmp_path):
    """Both stages built with the default model (a few tokens per answer): the task stage's translation prompts use
    the given sentences, the manifests record the real text, and no folder holds a Spec-Bench prompt."""
    import json

    import torch

    from hf_specdec.training.shards import load_distillation_data
    from hf_specdec.training.task_data import build_task_data, sequence_kinds

    model, tokenizer = default_model
    real = LocalText(
        passages=[(f"Section {i}", f"Part {i} of the real manual. " + " ".join(EN_PARAS)) for i in range(10)],
        foreign={"German": [f"Satz {i} aus einem echten Buch, mit einem Komma und einem Punkt." for i in range(30)]},
        sources={"test:German": 30},
    )
    folders = build_task_data(model, tokenizer, tmp_path, num_seed=24, num_tasks=12, seed=5, seed_max_new_tokens=48,
                              real_text=real, max_new_tokens=4, batch_size=12, shard_size=12,
                              hidden_dtype=torch.float16, progress=False)  # fmt: skip
    data = load_distillation_data(folders)
    assert data.seq_bounds.shape[0] == 36 and data.hidden.dtype == torch.float16
    manifest = json.loads((folders[1] / "manifest.json").read_text())
    recipe = manifest["prompt_recipe"]
    assert recipe["real_text"] and recipe["stage"] == "tasks" and recipe["real_text_sources"] == {"test:German": 30}
    kinds = sequence_kinds(folders[1])
    texts = [tokenizer.decode(data.input_ids[s:a]) for s, a, _ in data.seq_bounds[24:].tolist()]
    translations = [t for t, k in zip(texts, kinds) if k == "translation"]
    assert translations and sum("aus einem echten Buch" in t for t in translations) >= 1
