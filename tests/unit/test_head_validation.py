"""A head's files and values are checked when it is loaded or bound, never found out deep inside ``generate``: each
defect below, one table row, is a clear error naming the file (or the head) and the field, and the target gives
vanilla's output afterwards. Also: a proposer of one's own that returns something else than one tree per row, a
string ``assistant=``, a Hub id while the Hub is switched off, and the verifier a speculators export names."""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from huggingface_hub import constants
from safetensors.torch import load_file, save_file

import hf_specdec
from hf_specdec import FallbackAssistant, NgramAssistant, Proposer
from hf_specdec.assistants import available_assistants
from hf_specdec.cli import main as cli_main
from hf_specdec.generation.proposers.eagle import EagleAssistant
from hf_specdec.heads.checks import MAX_TREE_DEPTH, MAX_TREE_NODES, check_tree
from hf_specdec.heads.dflash import DFlashHead
from hf_specdec.heads.eagle import EagleHead
from hf_specdec.heads.hub import CONFIG_NAME, WEIGHTS_NAME
from hf_specdec.heads.mlp_speculator import MLPSpeculator
from hf_specdec.testing import tiny_causal_lm, torch_threads

IDS = torch.tensor([[5, 6, 7, 8, 5, 6]])
V = 97  # tiny_causal_lm's vocabulary


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def model():
    return tiny_causal_lm("llama", num_layers=2)


@pytest.fixture(scope="module")
def vanilla(model):
    return model.generate(IDS, max_new_tokens=8, do_sample=False)


def assert_untouched(model, vanilla) -> None:
    """The target still gives vanilla's greedy output, with an assistant and without, in its own attention."""
    for assistant in (None, NgramAssistant()):
        kwargs = {} if assistant is None else {"assistant": assistant}
        assert torch.equal(model.generate(IDS, max_new_tokens=8, do_sample=False, **kwargs), vanilla)
    assert model.config._attn_implementation == "sdpa"


# ------------------------------------------------------------------------------------------ saved heads, damaged
def edit_config(folder: Path, **fields) -> None:
    config = json.loads((folder / CONFIG_NAME).read_text())
    (folder / CONFIG_NAME).write_text(json.dumps({**config, **fields}))


def edit_tensors(folder: Path, change: Callable[[dict], None]) -> None:
    tensors = load_file(str(folder / WEIGHTS_NAME))
    change(tensors)
    save_file(tensors, str(folder / WEIGHTS_NAME))


def mlp_speculator(model) -> MLPSpeculator:
    return MLPSpeculator.for_model(model, n_predict=2, token_map=torch.arange(10, 30))


def dflash(model) -> DFlashHead:
    return DFlashHead.for_model(model, num_layers=1, block_size=4)


def eagle(model) -> EagleHead:
    return EagleHead.for_model(model, version=1)


def _poison(key: str, value: float) -> Callable[[dict], None]:
    def change(tensors: dict) -> None:
        tensors[key].view(-1)[0] = value

    return change


@dataclass
class Case:
    name: str
    head: Callable  # model -> a head to save
    config: dict  # config.json fields written over the saved ones
    tensors: Callable[[dict], None] | None  # changes to model.safetensors
    words: tuple[str, ...]  # each must appear in the error


LOAD_CASES = [
    Case("token_map past the vocabulary", mlp_speculator, {}, _poison("token_map", 5000),
         (WEIGHTS_NAME, "'token_map'", "5000", f"[0, {V})")),
    Case("mask_token_id past the vocabulary", dflash, {"mask_token_id": 100_000}, None,
         (CONFIG_NAME, "'mask_token_id'", "100000", f"[0, {V})")),
    Case("mask_token_id not an integer", dflash, {"mask_token_id": "x"}, None,
         (CONFIG_NAME, "'mask_token_id'", "'x'")),
    Case("tree not an object", eagle, {"tree": "x"}, None, (CONFIG_NAME, "'tree'", "'x'", "object")),
    Case("unknown eagle_version", eagle, {"eagle_version": 7}, None, (CONFIG_NAME, "'eagle_version'", "7", "[1, 3]")),
    Case("eagle_version of the other layout", eagle, {"eagle_version": 3}, None,
         (CONFIG_NAME, "'eagle_version'", "EAGLE-1 tensors")),
    Case("tree a million deep", eagle, {"tree": {"depth": 10**6, "num_nodes": 10**6}}, None,
         (CONFIG_NAME, "'tree.depth'", "1000000", "MAX_TREE_DEPTH", str(MAX_TREE_DEPTH))),
    Case("tree of a million nodes", eagle, {"tree": {"num_nodes": 10**6}}, None,
         (CONFIG_NAME, "'tree.num_nodes'", "MAX_TREE_NODES", str(MAX_TREE_NODES))),
    Case("widths deeper than the limit", mlp_speculator, {"tree": {"widths": [1] * 100}}, None,
         (CONFIG_NAME, "'tree.widths'", "MAX_TREE_DEPTH")),
    Case("step cost not finite", dflash, {"tree": {"step_cost": {"4": float("nan")}}}, None,
         (CONFIG_NAME, "'tree.step_cost'", "finite")),
    Case("NaN weights (EAGLE)", eagle, {}, _poison("fc.weight", float("nan")), (WEIGHTS_NAME, "'fc.weight'", "NaN")),
    Case("inf weights (MLP speculator)", mlp_speculator, {}, _poison("head.0.weight", float("inf")),
         (WEIGHTS_NAME, "'head.0.weight'", "infinite")),
    Case("NaN weights (DFlash)", dflash, {}, _poison("fc.weight", float("nan")), (WEIGHTS_NAME, "'fc.weight'", "NaN")),
]  # fmt: skip


@pytest.mark.parametrize("case", LOAD_CASES, ids=[c.name for c in LOAD_CASES])
def test_a_damaged_head_file_is_refused_when_loaded(case, model, vanilla, tmp_path):
    head = case.head(model)
    head.save_pretrained(tmp_path)
    edit_config(tmp_path, **case.config)
    if case.tensors is not None:
        edit_tensors(tmp_path, case.tensors)
    with pytest.raises(ValueError) as info:
        type(head).from_pretrained(tmp_path, base_model=model)
    missing = [w for w in case.words if w not in str(info.value)]
    assert not missing, f"{case.name}: {missing} not in {info.value}"
    assert str(tmp_path) in str(info.value) and type(head).__name__ in str(info.value)
    assert_untouched(model, vanilla)


def test_the_heads_that_ship_pass_every_check():
    from hf_specdec.assistants import SHIPPED_HEADS

    for shipped in SHIPPED_HEADS.values():
        if shipped.ships():
            shipped.head_class.from_pretrained(shipped.folder)


# ------------------------------------------------------------------------------------------ heads in memory, bound
def _bad_token_map(model):
    spec = mlp_speculator(model)
    spec.token_map[-1] = V + 3  # [V'] token ids
    return spec


def _bad_mask_token(model):
    head = dflash(model)
    head.mask_token_id = 10**6
    return head


def _deep_tree(model):
    head = eagle(model)
    head.tree = {"depth": 10**6}
    return head


BIND_CASES = {
    "token_map past the target's vocabulary": (_bad_token_map, ("MLPSpeculator", "'token_map'", str(V + 3))),
    "mask token past the target's vocabulary": (_bad_mask_token, ("DFlashHead", "'mask_token_id'", "1000000")),
    "tree deeper than the limit": (_deep_tree, ("EagleAssistant", "'depth'", "MAX_TREE_DEPTH")),
}


@pytest.mark.parametrize("name", list(BIND_CASES))
def test_a_head_that_does_not_fit_the_target_fails_before_generating(name, model, vanilla):
    build, words = BIND_CASES[name]
    with pytest.raises(ValueError) as info:
        model.generate(IDS, assistant=build(model), max_new_tokens=4, do_sample=False)
    missing = [w for w in words if w not in str(info.value)]
    assert not missing, f"{name}: {missing} not in {info.value}"
    assert_untouched(model, vanilla)


def test_tree_limits_hold_for_a_proposers_own_arguments(model):
    with pytest.raises(ValueError, match="'num_nodes' must be an integer in 0..1024 .*MAX_TREE_NODES.*, got 5000"):
        EagleAssistant(eagle(model), num_nodes=5000)
    with pytest.raises(ValueError, match="'tree.depth' must be an integer .* got True"):
        check_tree("EagleHead", {"depth": True}, "config.json")
    check_tree("EagleHead", {"depth": 5, "num_nodes": 32, "top_k": 6, "step_cost": {"4": 2.3}, "notes": "x"}, "c")


# ------------------------------------------------------------------------------------------ proposers of one's own
class ReturnsNone(Proposer):
    def propose(self, rows):
        return None


class ReturnsTooFew(Proposer):
    def propose(self, rows):
        return []


class ReturnsTokens(Proposer):
    def propose(self, rows):
        return [int(r.tokens[-1]) for r in rows]


PROPOSER_CASES = {
    "None": (ReturnsNone, TypeError, ("ReturnsNone.propose", "NoneType None", "one DraftTree per row")),
    "too few trees": (ReturnsTooFew, ValueError, ("ReturnsTooFew.propose", "0 trees for 1 rows", "[]")),
    "not trees": (ReturnsTokens, TypeError, ("ReturnsTokens.propose", "DraftTree", "returned int")),
}


@pytest.mark.parametrize("name", list(PROPOSER_CASES))
@pytest.mark.parametrize("inside_fallback", [False, True], ids=["alone", "in-fallback"])
def test_a_proposer_returning_something_else_is_named(name, inside_fallback, model, vanilla):
    cls, error, words = PROPOSER_CASES[name]
    assistant = FallbackAssistant(cls(), NgramAssistant()) if inside_fallback else cls()
    with pytest.raises(error) as info:
        model.generate(IDS, assistant=assistant, max_new_tokens=4, do_sample=False)
    missing = [w for w in words if w not in str(info.value)]
    assert not missing, f"{name}: {missing} not in {info.value}"
    assert_untouched(model, vanilla)


# ------------------------------------------------------------------------------------------ assistant= strings
def test_a_string_assistant_lists_the_ready_made_names(model, vanilla):
    with pytest.raises(TypeError) as info:
        model.generate(IDS, assistant="nonsense", max_new_tokens=4)
    message = str(info.value)
    assert "'nonsense'" in message and "hf_specdec.load_default_assistant(name)" in message
    assert all(name in message for name in available_assistants()), message
    with pytest.raises(TypeError, match=r"load_default_assistant\('ngram'\)"):
        model.generate(IDS, assistant="ngram", max_new_tokens=4)
    assert_untouched(model, vanilla)


# ------------------------------------------------------------------------------------------ the Hub switched off
@pytest.fixture
def offline(monkeypatch, tmp_path):
    """HF_HUB_OFFLINE set, an empty Hub cache, and any download attempt a failure."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))

    def no_download(*args, **kwargs):
        raise AssertionError("the Hub was asked while HF_HUB_OFFLINE is set")

    monkeypatch.setattr("hf_specdec.heads.hub.hf_hub_download", no_download)


@pytest.mark.parametrize("head_class", [EagleHead, MLPSpeculator, DFlashHead, hf_specdec.MedusaHeads])
def test_a_hub_id_offline_fails_at_once_naming_a_local_folder(offline, head_class):
    with pytest.raises(OSError) as info:
        head_class.from_pretrained("someone/some-head")
    message = str(info.value)
    assert "HF_HUB_OFFLINE" in message and "'someone/some-head'" in message and "local folder" in message


# ------------------------------------------------------------------------------------------ the verifier of exports
# CI installs the speculators extra: the library's check must run there, never skip
needs_speculators = pytest.mark.skipif(
    not os.environ.get("CI") and importlib.util.find_spec("speculators") is None, reason="the speculators extra"
)


@pytest.fixture(scope="module")
def target(saved_tiny_llama):
    return saved_tiny_llama


def test_an_export_refuses_a_verifier_no_engine_can_load(tmp_path, target):
    head = DFlashHead.for_model(target, block_size=4, base_model_name_or_path="SmolLM2-135M-Instruct")
    with pytest.raises(ValueError, match="'SmolLM2-135M-Instruct'.*Hub id .*--verifier"):
        head.save_pretrained(tmp_path / "x", format="speculators")
    assert not (tmp_path / "x" / WEIGHTS_NAME).exists()


@needs_speculators
def test_the_cli_export_names_the_targets_folder_and_the_library_loads_it(tmp_path, target, capsys, monkeypatch):
    from speculators import SpeculatorModel, SpeculatorModelConfig

    head = DFlashHead.for_model(target, block_size=4, base_model_name_or_path="SmolLM2-135M-Instruct")
    head.save_pretrained(tmp_path / "head")
    out = tmp_path / "spec"
    folder = target.config._name_or_path
    assert cli_main(["export", str(tmp_path / "head"), "--format", "speculators", "--out", str(out),
                     "--model", folder]) == 0  # fmt: skip
    config = SpeculatorModelConfig.from_pretrained(out)
    assert config.speculators_config.verifier.name_or_path == str(Path(folder).resolve())
    config.transformer_layer_config._attn_implementation = "sdpa"
    lib = SpeculatorModel.from_pretrained(out, config=config)  # reads the verifier's files from that folder
    assert torch.equal(lib.state_dict()["embed_tokens.weight"], target.get_input_embeddings().weight)
    # a target known by a bare name only: refused, naming --verifier
    bare = tiny_causal_lm("llama", num_layers=8)
    bare.config._name_or_path = "tiny-llama"
    monkeypatch.setattr("hf_specdec.export_cli._load_target", lambda name: (bare, "tiny-llama"))
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["export", str(tmp_path / "head"), "--format", "speculators", "--out", str(tmp_path / "s2")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "--verifier" in err and "'tiny-llama'" in err, err
