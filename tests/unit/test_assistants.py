import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

import hf_specdec
from hf_specdec import assistants
from hf_specdec.assistants import DEFAULT_ASSISTANT, available_assistants, describe_assistant
from hf_specdec.generation.proposers.ngram import NgramAssistant


def test_default_ngram_assistant_is_ready():
    assert isinstance(hf_specdec.load_default_assistant("ngram"), hf_specdec.NgramAssistant)


def test_default_medusa_assistant_is_the_shipped_heads_with_their_tuned_costs():
    from hf_specdec.assistants import DEFAULT_MEDUSA_DIR
    from hf_specdec.heads.medusa import MedusaHeads

    assistant = hf_specdec.load_default_assistant("medusa")
    assert isinstance(assistant, hf_specdec.MedusaAssistant)
    heads = assistant.heads
    # sized for SmolLM2-135M (hidden 576, vocabulary 49152), sharing its lm_head; small enough to ship
    assert (heads.hidden_size, heads.vocab_size, heads.share_lm_head) == (576, 49152, True)
    # the candidate tree, which the loop's tree budget sizes from the heads' tuned step costs (their prior)
    assert heads.tree_choices and set(map(tuple, heads.tree_choices)) <= set(map(tuple, assistant.tree_choices))
    assert assistant.prior_cost is not None
    assert sum(f.stat().st_size for f in DEFAULT_MEDUSA_DIR.iterdir()) < 25 * 2**20
    card = (DEFAULT_MEDUSA_DIR / "README.md").read_text()
    assert "SmolLM2-135M-Instruct" in card and "top-1" in card
    # a fresh assistant per call, the heads loaded once
    assert hf_specdec.load_default_assistant("medusa") is not assistant
    assert hf_specdec.load_default_assistant("medusa").heads is heads
    assert isinstance(heads, MedusaHeads)


def _headline_overall() -> dict[str, float]:
    """Each method's overall speedup in the record the README's headline table is rendered from."""
    readme = (Path(__file__).parents[2] / "README.md").read_text(encoding="utf-8")
    record = re.search(r"<!-- results:begin headline (\S+\.json) -->", readme).group(1)
    summary = json.loads((Path(__file__).parents[2] / record).read_text(encoding="utf-8"))["summary"]
    return {row["method"]: row["speedup"] for row in summary if row["category"] == "overall"}


def test_registry_lists_the_shipped_assistants_best_first():
    names = available_assistants()
    overall = _headline_overall()
    measured = [name for name in names if name in overall]
    assert len(measured) >= 8, f"the headline record measures few of the ready-made assistants: {measured}"
    # best first as the headline measures them, up to ties within 0.02x
    for better, worse in zip(measured, measured[1:]):
        assert overall[better] >= overall[worse] - 0.02, (better, overall[better], worse, overall[worse])
    assert DEFAULT_ASSISTANT in names
    assert "Medusa" in describe_assistant("medusa") and "NgramAssistant" in describe_assistant("ngram")
    assert isinstance(hf_specdec.load_default_assistant(), hf_specdec.NgramAssistant)


def test_unknown_assistant_is_a_clear_error_listing_the_names():
    for call in (hf_specdec.load_default_assistant, describe_assistant):
        with pytest.raises(ValueError, match=r"unknown assistant 'beam'; .*ngram\+eagle, suffix\+eagle, "):
            call("beam")


@pytest.fixture
def registry(monkeypatch):
    """The registry, restored after the test (a test registering names must not leak them into others)."""
    monkeypatch.setattr(assistants, "_REGISTRY", dict(assistants._REGISTRY))
    return assistants


def test_registered_assistant_is_built_fresh_and_listed_only_while_its_assets_ship(registry):
    ships = {"now": False}
    registry.register_default_assistant(
        "test-ngram4", lambda: NgramAssistant(max_ngram=4), description="4-gram lookup", requires=lambda: ships["now"]
    )
    assert "test-ngram4" not in registry.available_assistants()
    with pytest.raises(FileNotFoundError, match="assets of assistant 'test-ngram4' .* are missing"):
        registry.load_default_assistant("test-ngram4")
    ships["now"] = True
    assert registry.available_assistants()[-1] == "test-ngram4"
    a, b = registry.load_default_assistant("test-ngram4"), registry.load_default_assistant("test-ngram4")
    assert isinstance(a, NgramAssistant) and a is not b
    assert registry.describe_assistant("test-ngram4") == "4-gram lookup"


def test_register_refuses_duplicates_bad_names_and_factories_that_build_no_assistant(registry):
    with pytest.raises(ValueError, match="'ngram' is already registered"):
        registry.register_default_assistant("ngram", NgramAssistant, description="again")
    with pytest.raises(ValueError, match="without commas"):
        registry.register_default_assistant("a,b", NgramAssistant, description="x")
    with pytest.raises(TypeError, match="must be callables"):
        registry.register_default_assistant("x", NgramAssistant(), description="x")
    for heads in ("eagle", ("beam",)):  # a bare string is not a tuple of kinds; an unknown kind
        with pytest.raises(ValueError, match="heads is a tuple of eagle, medusa"):
            registry.register_default_assistant("x", NgramAssistant, description="x", heads=heads)
    assert "x" not in registry.available_assistants()
    registry.register_default_assistant("not-an-assistant", dict, description="builds a dict")
    with pytest.raises(TypeError, match="returned dict, not a Proposer"):
        registry.load_default_assistant("not-an-assistant")


def test_cli_and_bench_offer_exactly_the_registered_assistants(registry):
    from hf_specdec.bench.methods import resolve_methods
    from hf_specdec.cli import OTHER_ASSISTANTS, build_parser

    registry.register_default_assistant("test-lookup", NgramAssistant, description="a test registration")
    parser = build_parser()
    generate = parser._subparsers._group_actions[0].choices["generate"]
    (action,) = [a for a in generate._actions if a.dest == "assistant"]
    assert list(action.choices) == registry.available_assistants() + list(OTHER_ASSISTANTS)
    assert "test-lookup: a test registration" in action.help
    assert parser.parse_args(["generate", "hi", "--assistant", "test-lookup"]).assistant == "test-lookup"
    bench_names = [m.name for m in resolve_methods(None)]
    assert bench_names[1 : 1 + len(registry.available_assistants())] == registry.available_assistants()
    (method,) = [m for m in resolve_methods("test-lookup") if m.name == "test-lookup"]
    assert method.description == "a test registration" and method.spec_stats
    assert isinstance(method.kwargs(None)["assistant"], NgramAssistant)


def test_shipped_medusa_heads_refuse_another_model_and_leave_it_usable():
    import torch

    from hf_specdec.testing import tiny_causal_lm

    model = tiny_causal_lm("llama")
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match="hidden size 576 cannot serve a model with hidden size 64"):
        model.generate(ids, max_new_tokens=4, assistant=hf_specdec.load_default_assistant("medusa"))
    assert model.config._attn_implementation == "sdpa"
    assert model.generate(ids, max_new_tokens=4, do_sample=False).shape == (1, 7)


def test_heads_from_folders_benches_a_saved_head_in_every_method_of_its_kind_then_restores_the_shipped_one(tmp_path):
    from hf_specdec.assistants import EAGLE, heads_from_folders

    shipped = EAGLE.load()
    candidate = type(shipped).from_pretrained(EAGLE.folder)
    with torch.no_grad():
        next(candidate.parameters()).add_(1.0)  # weights the shipped head does not have
    candidate.save_pretrained(tmp_path / "candidate")
    with heads_from_folders({"eagle": tmp_path / "candidate"}):
        alone = hf_specdec.load_default_assistant("eagle").head
        behind_ngram = hf_specdec.load_default_assistant("ngram+eagle").assistants[1].head
        assert alone is behind_ngram and alone is not shipped
        assert torch.equal(next(alone.parameters()), next(candidate.parameters()))
        assert hf_specdec.load_default_assistant("medusa").heads is assistants.MEDUSA.load()  # other kinds: shipped
    assert hf_specdec.load_default_assistant("eagle").head is shipped
    with pytest.raises(RuntimeError, match="inside"), heads_from_folders({"eagle": tmp_path / "candidate"}):
        raise RuntimeError("inside")
    assert hf_specdec.load_default_assistant("eagle").head is shipped  # restored after an exception too


@pytest.mark.parametrize(
    "kind, folder, words",
    [
        ("beam", "eagle", "unknown head kind 'beam'"),
        ("eagle", "nowhere", "no saved head"),
        ("medusa", "eagle", "holds a 'eagle' head, not a 'medusa' head"),
    ],
)
def test_heads_from_folders_refuses_a_wrong_kind_or_folder_and_changes_nothing(kind, folder, words):
    from hf_specdec.assistants import EAGLE, heads_from_folders

    path = EAGLE.folder if folder == "eagle" else EAGLE.folder / folder
    with pytest.raises(ValueError, match=words), heads_from_folders({kind: path}):
        pass
    assert hf_specdec.load_default_assistant("eagle").head is EAGLE.load()


def test_a_registration_with_heads_is_listed_only_while_those_heads_ship(registry, monkeypatch, tmp_path):
    from hf_specdec.assistants import EAGLE, SHIPPED_HEADS, ShippedHead

    registry.register_default_assistant("test-on-eagle", NgramAssistant, description="x", heads=("eagle",))
    assert "test-on-eagle" in registry.available_assistants()
    moved = dataclasses.replace(EAGLE.kind, shipped=str(tmp_path / "missing"))  # an absolute path: not under assets
    monkeypatch.setitem(SHIPPED_HEADS, "eagle", ShippedHead(moved))
    assert "test-on-eagle" not in registry.available_assistants()
