"""Every export format round-trips: a head saved in it loads back bit-identical (tensors, dtypes, settings), draws the
same trees, and gives vanilla `generate`'s greedy output, batch 1 and a ragged batch of 4. Heads loaded from folders
written with the exact upstream names (the speculators library's checkpoint, the pre-0.9 speculators EAGLE-1 kind)
do too. ``hf-specdec export`` writes the same folders, for the heads `hf-specdec train` ships, and
``push_to_hub(format=...)`` uploads them."""

from __future__ import annotations

import inspect
import json
import os

import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig

import hf_specdec
import hf_specdec.generation.loop as loop
from hf_specdec.cli import main as cli_main
from hf_specdec.generation.proposers import as_proposer
from hf_specdec.heads.dflash import DFlashHead
from hf_specdec.heads.eagle import EagleHead
from hf_specdec.heads.hub import CONFIG_NAME, WEIGHTS_NAME
from hf_specdec.heads.medusa import MedusaHeads
from hf_specdec.testing import assert_same_tokens, left_pad

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 5, 6, 7], [3, 4, 5], [9, 9, 8, 7, 6, 5, 4], [12, 13, 12, 13, 12, 13, 12, 13, 12]]
FULL_TREES = {"tree_budget": False} if "tree_budget" in inspect.signature(loop.generate).parameters else {}


@pytest.fixture(scope="module")
def target(saved_tiny_llama):
    """The target, saved to a folder (the library reads the verifier's config and embeddings from it)."""
    return saved_tiny_llama


@pytest.fixture(scope="module")
def vanilla(target):
    ids, mask = left_pad(PROMPTS)
    return ids, mask, target.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False)


def _randomize(head, seed: int, norms: bool = False):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            elif norms:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
    return head.eval()


def eagle1(model):
    return _randomize(EagleHead.for_model(model, draft_vocab=torch.arange(3, 60)), 1)


def eagle1_full_vocab(model):
    return _randomize(EagleHead.for_model(model), 2)


def eagle3(model):
    return _randomize(EagleHead.for_model(model, version=3, draft_vocab=torch.arange(10, 80)), 3, norms=True)


def eagle3_speculators_variant(model):
    options = {"norm_before_residual": True, "norm_before_fc": True, "norm_output": True}
    head = EagleHead.for_model(model, version=3, draft_vocab=torch.arange(10, 80), eagle3_options=options)
    return _randomize(head, 4, norms=True)


def medusa_shared(model):
    heads = MedusaHeads.for_model(model, num_heads=3, share_lm_head=True, draft_vocab_size=60)
    heads.token_map.copy_(torch.arange(20, 80))
    return _randomize(heads, 5)


def medusa_own(model):
    return _randomize(MedusaHeads.for_model(model, num_heads=3, share_lm_head=False), 6)


CASES = {
    "eagle1-eagle": (eagle1, "eagle"),
    "eagle3-speculators": (eagle3, "speculators"),
    "eagle3-eagle": (eagle3, "eagle"),
    "eagle3-variant-speculators": (eagle3_speculators_variant, "speculators"),
    "medusa-shared-medusa": (medusa_shared, "medusa"),
    "medusa-own-medusa": (medusa_own, "medusa"),
}


def generate_recording(model, head, ids, mask):
    """Greedy generate with ``head``; returns the output and every tree drafted (tokens, parents)."""
    proposer = as_proposer(head, model)
    trees, propose = [], proposer.propose

    def recording(rows):
        out = propose(rows)
        trees.extend((t.tokens.tolist(), t.parent.tolist()) for t in out)
        return out

    proposer.propose = recording
    out = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, assistant=proposer,
                         return_dict_in_generate=True, **FULL_TREES)  # fmt: skip
    assert out.spec_stats.drafted_tokens > 0
    return out.sequences, trees


def assert_bit_identical(loaded, original):
    ours, theirs = original.state_dict(), loaded.state_dict()
    assert sorted(ours) == sorted(theirs)
    for key in ours:
        assert ours[key].dtype == theirs[key].dtype and torch.equal(ours[key], theirs[key]), key
    settings = {k: v for k, v in original.config_dict().items() if k != "source_format"}
    assert settings == {k: v for k, v in loaded.config_dict().items() if k != "source_format"}


@pytest.mark.parametrize("case", list(CASES))
def test_round_trip(tmp_path, target, vanilla, case):
    build, fmt = CASES[case]
    head = build(target)
    head.save_pretrained(tmp_path, format=fmt)
    loaded = type(head).from_pretrained(tmp_path, base_model=target)
    assert_bit_identical(loaded, head)
    ids, mask, expected = vanilla
    out, trees = generate_recording(target, head, ids, mask)
    out_loaded, trees_loaded = generate_recording(target, loaded, ids, mask)
    assert_same_tokens(out, expected, f"{case} original")
    assert_same_tokens(out_loaded, expected, f"{case} loaded, batch 4")
    assert trees_loaded == trees
    one = target.generate(ids[1:2, -3:], max_new_tokens=16, do_sample=False)
    assert_same_tokens(target.generate(ids[1:2, -3:], max_new_tokens=16, do_sample=False, assistant=loaded), one,
                       f"{case} loaded, batch 1")  # fmt: skip


def test_model_cards_say_how_to_serve(tmp_path, target):
    from hf_specdec.generation.proposers import eagle as eagle_proposer
    from hf_specdec.heads import serving

    assert serving._EAGLE_TREE_DEFAULTS == {
        "top_k": eagle_proposer.DEFAULT_TOP_K,
        "depth": eagle_proposer.DEFAULT_DEPTH,
        "num_nodes": eagle_proposer.DEFAULT_NUM_NODES,
    }
    where = str(tmp_path / "x")
    expected = {
        (eagle3, "speculators"): [f"vllm serve {where}\n", '"method": "eagle3"', "drafts a chain", "--format eagle"],
        (eagle3, "eagle"): [
            "--speculative-algorithm EAGLE3",
            f"--speculative-draft-model-path {where}",
            "--speculative-eagle-topk 6",
            "--speculative-num-draft-tokens 25",
        ],  # fmt: skip
        (eagle1, "eagle"): ['"method": "eagle"', "--speculative-algorithm EAGLE ", "has a bias", "draft vocabulary"],
        (eagle1_full_vocab, "hf-specdec"): [f"hf-specdec export {where} --format FORMAT --out DIR` (FORMAT: eagle)"],
        (eagle3, "hf-specdec"): ["(FORMAT: speculators or eagle)"],
        (medusa_shared, "medusa"): [
            '"method": "medusa"',
            '"num_speculative_tokens": 3',
            "original_lm_head",
            "SGLang has no Medusa drafter",
        ],  # fmt: skip
    }
    for (build, fmt), phrases in expected.items():
        card = str(build(target).generate_model_card(where)) if fmt == "hf-specdec" else None
        if card is None:
            head = build(target)
            head.save_pretrained(tmp_path / "x", format=fmt, model_card_kwargs={"repo_id": where})
            card = (tmp_path / "x" / "README.md").read_text()
        for phrase in phrases:
            assert phrase in card, (build.__name__, fmt, phrase)


# --------------------------------------------------------------------------- folders written by other tools
def test_speculators_library_checkpoint_drafts_greedy_equal(tmp_path, target, vanilla):
    """A checkpoint the speculators library makes and saves itself (random weights) serves as an assistant here."""
    if not os.environ.get("CI"):
        pytest.importorskip("speculators")
    from speculators.models.eagle3 import Eagle3DraftModel
    from transformers import AutoConfig

    layer_config = AutoConfig.from_pretrained(target.config._name_or_path)
    layer_config.num_hidden_layers = 1
    ids = torch.arange(10, 80)
    t2d = torch.zeros(target.config.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    lib = Eagle3DraftModel.from_training_args(
        layer_config, t2d=t2d, d2t=ids - torch.arange(ids.numel()), verifier_name_or_path=target.config._name_or_path,
        draft_vocab_size=ids.numel(), norm_before_residual=True, norm_before_fc=True, norm_output=True, ttt_steps=3,
        target_layer_ids=[2, 4, 5], draft_attn_impl="sdpa",
    )  # fmt: skip
    _randomize(lib, 7, norms=True)
    lib.save_pretrained(tmp_path)
    head = EagleHead.from_pretrained(tmp_path, base_model=target)
    prompt_ids, mask, expected = vanilla
    out, _ = generate_recording(target, head, prompt_ids, mask)
    assert_same_tokens(out, expected, "library checkpoint, batch 4")
    one = target.generate(prompt_ids[:1], max_new_tokens=16, do_sample=False)
    assert_same_tokens(target.generate(prompt_ids[:1], max_new_tokens=16, do_sample=False, assistant=head), one,
                       "library checkpoint, batch 1")  # fmt: skip


def test_legacy_speculators_eagle1_folder(tmp_path, target, vanilla):
    """The EAGLE-1 kind of speculators < 0.9 (``fusion_fc``, ``transformer.*``), written with its exact names."""
    head = eagle1_full_vocab(target)
    renames = {"fc.": "fusion_fc.", "layers.0.": "transformer."}
    tensors = {}
    for key, value in head.state_dict().items():
        if key.startswith("rotary_emb."):
            continue
        prefix = next(p for p in renames if key.startswith(p))
        tensors[renames[prefix] + key[len(prefix) :]] = value.contiguous()
    save_file(tensors, tmp_path / WEIGHTS_NAME)
    layer = LlamaConfig(**{k: getattr(head.config, k) for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                                                "num_key_value_heads", "vocab_size", "head_dim")})  # fmt: skip
    config = {
        "speculators_model_type": "eagle",
        "architectures": ["EagleSpeculator", "LlamaDecoderLayer"],
        "transformer_layer_architecture": "LlamaDecoderLayer",
        "transformer_layer_config": layer.to_diff_dict(),
        "layernorms": False,
        "fusion_bias": True,
        "speculators_config": {
            "algorithm": "eagle",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 5}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": target.config._name_or_path, "architectures": ["LlamaForCausalLM"]},
        },
    }
    (tmp_path / CONFIG_NAME).write_text(json.dumps(config))
    loaded = EagleHead.from_pretrained(tmp_path, base_model=target)
    assert loaded.version == 1 and loaded.source_format == "speculators"
    for key, value in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    ids, mask, expected = vanilla
    out, trees = generate_recording(target, loaded, ids, mask)
    assert trees == generate_recording(target, head, ids, mask)[1]
    assert_same_tokens(out, expected, "legacy speculators EAGLE-1")
    config["layernorms"] = True
    (tmp_path / CONFIG_NAME).write_text(json.dumps(config))
    with pytest.raises(ValueError, match="layernorms=true \\(HASS"):
        EagleHead.from_pretrained(tmp_path)


# --------------------------------------------------------------------------- CLI and Hub
def test_export_cli(tmp_path, target, capsys):
    head = eagle3(target)
    head.save_pretrained(tmp_path / "head")
    out = tmp_path / "spec"
    code = cli_main(["export", str(tmp_path / "head"), "--format", "speculators", "--out", str(out),
                     "--model", target.config._name_or_path, "--verifier", "org/tiny-llama", "--repo-id", "org/spec",
                     "--speculative-tokens", "3"])  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out
    assert "vllm serve org/spec" in printed and '"num_speculative_tokens": 3' in printed
    config = json.loads((out / CONFIG_NAME).read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == "org/tiny-llama"
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    loaded = EagleHead.from_pretrained(out, base_model=target)
    for key, value in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["export", str(tmp_path / "head"), "--format", "medusa", "--out", str(tmp_path / "m"),
                  "--model", target.config._name_or_path])  # fmt: skip
    assert exit_info.value.code == 2
    assert "cannot load" in capsys.readouterr().err and not (tmp_path / "m").exists()


def test_export_cli_writes_a_dflash_head_for_vllm(tmp_path, target, capsys):
    """``--format speculators`` also takes a DFlash block drafter: the folder is the library's ``dflash`` kind, loads
    back bit-identical, and its card gives vLLM's command; a chain length other than the block's is refused."""
    head = _randomize(DFlashHead.for_model(target, block_size=4, draft_vocab=torch.arange(5, 70)), 7, norms=True)
    head.save_pretrained(tmp_path / "head")
    assert "(FORMAT: speculators)" in str(head.generate_model_card("x"))
    out = tmp_path / "spec"
    code = cli_main(["export", str(tmp_path / "head"), "--format", "speculators", "--out", str(out),
                     "--model", target.config._name_or_path, "--verifier", "org/tiny-llama", "--repo-id", "org/spec",
                     "--speculative-tokens", "3"])  # fmt: skip
    assert code == 0
    assert "vllm serve org/spec" in capsys.readouterr().out
    config = json.loads((out / CONFIG_NAME).read_text())
    assert config["speculators_model_type"] == "dflash" and config["block_size"] == 4
    assert config["speculators_config"]["verifier"]["name_or_path"] == "org/tiny-llama"
    head.base_model_name_or_path = "org/tiny-llama"  # what --verifier writes
    assert_bit_identical(DFlashHead.from_pretrained(out, base_model=target), head)
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["export", str(tmp_path / "head"), "--format", "speculators", "--out", str(tmp_path / "s2"),
                  "--model", target.config._name_or_path, "--speculative-tokens", "5"])  # fmt: skip
    assert exit_info.value.code == 2 and "drafts its block's 3 tokens" in capsys.readouterr().err


def test_push_to_hub_uploads_the_export(tmp_path, target, monkeypatch):
    """``push_to_hub(format=...)`` uploads the exported folder (the Hub calls are replaced by a recorder)."""
    from huggingface_hub import HfApi

    uploaded = {}

    class Repo:
        repo_id = "org/head"

    def upload_folder(self, *, repo_id, folder_path, **kwargs):
        uploaded.update({p.name: p.read_bytes() for p in __import__("pathlib").Path(folder_path).iterdir()})
        return f"https://huggingface.co/{repo_id}/commit/0"

    monkeypatch.setattr(HfApi, "create_repo", lambda self, **kwargs: Repo())
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    eagle3(target).push_to_hub("org/head", format="speculators")
    assert json.loads(uploaded[CONFIG_NAME])["speculators_model_type"] == "eagle3"
    assert b"vllm serve org/head" in uploaded["README.md"]
    medusa_shared(target).push_to_hub("org/head", format="medusa")
    assert json.loads(uploaded[CONFIG_NAME])["model_type"] == "medusa"


@pytest.mark.slow
def test_shipped_heads_export(tmp_path, capsys):
    """The heads `hf-specdec train` made for the default model export, and load back unchanged."""
    from hf_specdec.assistants import EAGLE, MEDUSA

    for shipped, fmt in ((EAGLE, "eagle"), (MEDUSA, "medusa")):
        out = tmp_path / fmt
        assert cli_main(["export", shipped.folder.name.split("-")[0], "--format", fmt, "--out", str(out)]) == 0
        original = shipped.head_class.from_pretrained(shipped.folder)
        loaded = shipped.head_class.from_pretrained(out)
        for key, value in original.state_dict().items():
            assert value.dtype == loaded.state_dict()[key].dtype and torch.equal(loaded.state_dict()[key], value), key
    assert "--speculative-algorithm EAGLE" in capsys.readouterr().out
    assert hf_specdec  # the package's `assistant=` route is registered for the CLI's loads
