"""The model cards hf-specdec writes (``save_pretrained`` / ``push_to_hub`` / ``generate_model_card``) are valid on
the Hub: front matter with license, base_model (a Hub id), library_name and tags; usage lines that load real Hub ids
(the repo given, or a placeholder of the same form), never a local path."""

from __future__ import annotations

import re

import pytest

from hf_specdec import EagleHead, MedusaHeads, MLPSpeculator
from hf_specdec.assistants import DEFAULT_EAGLE_DIR, DEFAULT_MEDUSA_DIR, DEFAULT_MLP_SPECULATOR_DIR, DFLASH
from hf_specdec.heads.dflash import DFlashHead
from hf_specdec.heads.hub import hub_base_model, without_local_paths

REPO_ID = re.compile(r"[A-Za-z0-9][\w.\-]*/[\w.\-]+")
SHIPPED = [
    (MedusaHeads, DEFAULT_MEDUSA_DIR),
    (EagleHead, DEFAULT_EAGLE_DIR),
    (MLPSpeculator, DEFAULT_MLP_SPECULATOR_DIR),
    (DFlashHead, DFLASH.folder),
]


def front_matter(card: str) -> dict[str, str]:
    found = re.match(r"^---\n(.*?)\n---\n", card, re.DOTALL)
    assert found, "no YAML front matter"
    return dict(re.findall(r"^(\w+): (.+)$", found.group(1), re.MULTILINE))


def test_local_names_map_to_hub_ids_and_paths_are_cut():
    assert hub_base_model("SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert hub_base_model("/root/cache/SmolLM2-135M-Instruct-Q4_1") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert hub_base_model("meta-llama/Llama-3.2-1B") == "meta-llama/Llama-3.2-1B"
    assert hub_base_model("/data/my-model") is None and hub_base_model(None) is None
    assert without_local_paths("distilled from /root/cache/M-Q4_1: 3 answers") == "distilled from M-Q4_1: 3 answers"
    assert without_local_paths("see ~/runs/x/data and ./a/b") == "see data and b"


@pytest.mark.parametrize("cls,folder", SHIPPED, ids=lambda x: getattr(x, "__name__", ""))
@pytest.mark.parametrize("repo_id", [None, "someone/my-head"])
def test_generated_cards_are_valid_on_the_hub(cls, folder, repo_id):
    card = str(cls.from_pretrained(folder).generate_model_card(repo_id))
    meta = front_matter(card)
    assert meta["license"] == "apache-2.0"
    assert meta["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert meta["library_name"] == "hf-specdec"
    assert "\ntags:\n- speculative-decoding\n" in card
    assert "/root/" not in card and "/home/" not in card and ".cache" not in card
    ids = re.findall(r'from_pretrained\("([^"]+)"', card)
    assert ids and all(REPO_ID.fullmatch(i) for i in ids), ids
    if repo_id:
        assert repo_id in ids


def test_a_head_of_an_unknown_local_model_gets_no_base_model_and_no_license():
    head = MedusaHeads.from_pretrained(DEFAULT_MEDUSA_DIR)
    head.base_model_name_or_path = "/data/models/my-model"
    card = str(head.generate_model_card("someone/my-head"))
    meta = front_matter(card)
    assert "base_model" not in meta and "license" not in meta
    assert "/data/models" not in card
    assert 'from_pretrained("your-org/my-model")' in card


def test_the_shipped_cards_name_the_report_of_their_run():
    """A card on the Hub cannot follow a relative link and the package has no public repository address, so the
    measured figures name their run's report by its path in the source."""
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    for folder in sorted((root / "hf_specdec" / "assets").glob("*/config.json")):
        results = json.loads(folder.read_text(encoding="utf-8"))["model_card"]["results"]
        card = (folder.parent / "README.md").read_text(encoding="utf-8")
        report = Path(results).with_suffix(".md").as_posix()
        assert f"`{report}` in hf-specdec's source" in card, folder.parent.name
        assert (root / report).is_file(), report


@pytest.mark.parametrize("cls,folder", SHIPPED, ids=lambda x: getattr(x, "__name__", ""))
def test_shipped_card_facts_are_the_cited_runs(cls, folder):
    """The speedup and τ a shipped head's config gives its card are the overall figures of the run it cites."""
    import json
    from pathlib import Path

    facts = cls.from_pretrained(folder).model_card
    run = json.loads((Path(__file__).parents[2] / facts["results"]).read_text())
    kind = {"MedusaHeads": "medusa", "EagleHead": "eagle", "MLPSpeculator": "mlp_speculator", "DFlashHead": "dflash"}[
        cls.__name__
    ]
    method = facts.get("method", kind)  # "eagle@candidate": the head was the candidate of an A/B run
    from hf_specdec.bench.methods import CANDIDATE

    assert method in (kind, kind + CANDIDATE)
    card = (Path(folder) / "README.md").read_text(encoding="utf-8")
    assert f"<!-- results:begin card {facts['results']} method={method} -->" in card, "the card shows another run"
    (overall,) = [s for s in run["summary"] if s["method"] == method and s["category"] == "overall"]
    assert facts["speedup"] == round(overall["speedup"], 2) and facts["tau"] == round(overall["tau"], 2)
    assert "/root/" not in json.dumps(facts)
