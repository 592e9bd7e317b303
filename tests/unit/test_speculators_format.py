"""vLLM's ``speculators`` format, judged by the ``speculators`` library itself (the ``speculators`` extra):

- an EAGLE-3 head exported here is loaded by the library's own config and model classes, with every tensor where the
  library expects it, and the library's forward computes the same logits as the head, for the first and the second
  (fed-back) drafting step;
- a checkpoint the library creates with its own training entry point (random weights) and saves with its own
  ``save_pretrained`` loads here and computes the library's logits, for the layer variants the library trains;
- kinds, layers and variants hf-specdec cannot run are refused by name; corrupt, truncated and mismatched files are
  refused naming the file and the mismatch; exports a format cannot express are refused before anything is written.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_specdec.heads.eagle import EagleHead
from hf_specdec.heads.formats.speculators import REFUSED_KINDS
from hf_specdec.heads.hub import CONFIG_NAME, WEIGHTS_NAME
from hf_specdec.testing import tiny_causal_lm

if os.environ.get("CI"):  # CI installs the extra: the library checks must run there, never skip
    import speculators  # noqa: F401
else:
    pytest.importorskip("speculators")
from speculators import SpeculatorModel, SpeculatorModelConfig  # noqa: E402
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig  # noqa: E402

LAYERS = 8  # the default feature layers (2, 4, 5) are distinct, as the library and vLLM require
DRAFT_IDS = torch.arange(10, 80)
VARIANTS = {
    "upstream": {},
    "speculators-training-defaults": {"norm_before_residual": True, "norm_before_fc": True, "norm_output": True},
    "fc-norm": {"fc_norm": True, "norm_before_residual": True},
}


@pytest.fixture(scope="module")
def target(saved_tiny_llama):
    """The target, saved to a folder (the library reads the verifier's config and embeddings from it)."""
    return saved_tiny_llama


def random_eagle3(model, options=None, seed=0, draft_vocab=DRAFT_IDS) -> EagleHead:
    """An EAGLE-3 head for ``model`` with random weights, norms included (so that a misplaced norm shows)."""
    head = EagleHead.for_model(model, version=3, draft_vocab=draft_vocab, eagle3_options=options)
    _randomize(head.named_parameters(), seed)
    return head.eval()


def _randomize(named_parameters, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in named_parameters:
            if name.startswith("verifier"):
                continue  # the library's frozen copy of the target's lm_head / norm (never saved)
            noise = torch.randn(p.shape, generator=g)
            p.copy_(noise * 0.1 if p.dim() >= 2 else 1.0 + 0.2 * noise)


def library_model(folder) -> Eagle3DraftModel:
    """The library's own loader on ``folder`` (SDPA attention: its default flex attention wants a GPU compiler)."""
    config = SpeculatorModelConfig.from_pretrained(folder)
    config.transformer_layer_config._attn_implementation = "sdpa"
    return SpeculatorModel.from_pretrained(folder, config=config).eval()


def library_logits(lib: Eagle3DraftModel, features, tokens, steps: int = 2) -> list[torch.Tensor]:
    """`[1, T, V']` logits of each training-time-test step of the library's forward (its lm_head's outputs)."""
    seen = []
    hook = lib.lm_head.register_forward_hook(lambda module, args, out: seen.append(out.detach()))
    try:
        with torch.no_grad():
            lib(hidden_states=features, input_ids=tokens, document_ids=torch.zeros_like(tokens), ttt_steps=steps)
    finally:
        hook.remove()
    return seen


def head_logits(head: EagleHead, features, tokens) -> list[torch.Tensor]:
    """The same two steps with the head's drafting pass: step 1 reads the target's fused features; step 2 feeds each
    position's own output back with the next token, attending to the step-1 entries up to it and to itself."""
    t = tokens.shape[1]
    kvh, d = head.config.num_key_value_heads, head.head_dim
    empty = torch.zeros(1, kvh, 0, d)
    pos = torch.arange(t)[None]
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    with torch.no_grad():
        out1, key, value = head.layer_forward(tokens, features, pos, causal[None], empty, empty)
        shifted = torch.cat([tokens[:, 1:], tokens.new_zeros(1, 1)], dim=1)
        mask = torch.cat([causal, torch.eye(t, dtype=torch.bool)], dim=-1)[None]  # [1, T, T + T]
        out2, _, _ = head.layer_forward(shifted, out1, pos + 1, mask, key, value)
        return [head.logits(out1), head.logits(out2)]


def assert_same_computation(head: EagleHead, lib: Eagle3DraftModel, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    t = 12
    features = torch.randn(1, t, lib.fc.in_features, generator=g)
    tokens = torch.randint(0, head.vocab_size, (1, t), generator=g)
    for step, (ours, theirs) in enumerate(
        zip(head_logits(head, features, tokens), library_logits(lib, features, tokens))
    ):
        assert ours.shape == theirs.shape, step
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5, msg=f"drafting step {step + 1}")


# --------------------------------------------------------------------------------------------- our export -> library
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_export_is_loaded_by_the_library(tmp_path, target, variant):
    head = random_eagle3(target, VARIANTS[variant], seed=1)
    head.save_pretrained(tmp_path, format="speculators")

    config = SpeculatorModelConfig.from_pretrained(tmp_path)
    assert isinstance(config, Eagle3SpeculatorConfig)
    assert config.draft_vocab_size == DRAFT_IDS.numel() and config.target_vocab_size == target.config.vocab_size
    assert config.eagle_aux_hidden_state_layer_ids == [2, 4, 5]
    assert config.speculators_config.verifier.name_or_path == target.config._name_or_path
    assert config.speculators_config.verifier.architectures == ["LlamaForCausalLM"]
    for option, value in head.eagle3_options.items():
        assert getattr(config, option) is value, option

    lib = library_model(tmp_path)
    ours = head.state_dict()
    theirs = lib.state_dict()
    for key, value in ours.items():  # every tensor where the library expects it
        if key.startswith("rotary_emb."):
            continue
        lib_key = "layers.0." + key[len("midlayer.") :] if key.startswith("midlayer.") else key
        assert torch.equal(theirs[lib_key], value), lib_key
    # the embeddings the head does not store: the library reads them from the verifier, as the head reads the target's
    assert torch.equal(theirs["embed_tokens.weight"], target.get_input_embeddings().weight)
    assert_same_computation(head, lib)


def test_export_writes_what_vllm_reads(tmp_path, target):
    """vLLM's speculators config reader needs these fields (and defaults norm_before_residual to true when absent)."""
    random_eagle3(target).save_pretrained(tmp_path, format="speculators")
    config = json.loads((tmp_path / CONFIG_NAME).read_text())
    assert config["speculators_model_type"] == "eagle3" and config["architectures"] == ["Eagle3Speculator"]
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] >= 1
    assert config["norm_before_residual"] is False
    assert config["transformer_layer_config"]["model_type"] == "llama"
    assert {"hidden_size", "num_attention_heads", "num_key_value_heads", "vocab_size", "rms_norm_eps"} <= set(
        config["transformer_layer_config"]
    )
    names = set(load_file(tmp_path / WEIGHTS_NAME))
    assert {"fc.weight", "layers.0.hidden_norm.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} <= names
    assert not any(k.startswith("midlayer.") for k in names)


# --------------------------------------------------------------------------------------------- library -> us
def library_checkpoint(folder, target, options: dict, seed: int = 0, draft_ids=DRAFT_IDS) -> Eagle3DraftModel:
    """A checkpoint made by the library's own training entry point and ``save_pretrained`` (random weights)."""
    from transformers import AutoConfig

    verifier = target.config._name_or_path
    layer_config = AutoConfig.from_pretrained(verifier)
    layer_config.num_hidden_layers = 1
    t2d = torch.zeros(target.config.vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    lib = Eagle3DraftModel.from_training_args(
        layer_config,
        t2d=t2d,
        d2t=draft_ids - torch.arange(draft_ids.numel()),
        verifier_name_or_path=verifier,
        draft_vocab_size=draft_ids.numel(),
        norm_before_residual=options.get("norm_before_residual", False),
        norm_before_fc=options.get("norm_before_fc", False),
        fc_norm=options.get("fc_norm", False),
        norm_output=options.get("norm_output", False),
        ttt_steps=3,
        target_layer_ids=[2, 4, 5],
        draft_attn_impl="sdpa",
    )
    _randomize(lib.named_parameters(), seed)
    lib.save_pretrained(folder)
    return lib.eval()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_library_checkpoint_loads_here(tmp_path, target, variant):
    lib = library_checkpoint(tmp_path, target, VARIANTS[variant], seed=2)
    head = EagleHead.from_pretrained(tmp_path, base_model=target)
    assert head.source_format == "speculators" and head.version == 3
    assert head.eagle3_options == {**dict.fromkeys(head.eagle3_options, False), **VARIANTS[variant]}
    assert head.aux_layers == [2, 4, 5] and head.draft_vocab_size == DRAFT_IDS.numel()
    assert torch.equal(head.draft_to_token(torch.arange(DRAFT_IDS.numel())), DRAFT_IDS)
    assert_same_computation(head, lib, seed=3)


def test_library_checkpoint_over_the_full_vocabulary(tmp_path, target):
    """draft_vocab_size == the vocabulary: the library saves no d2t / t2d, the head drafts over every token."""
    lib = library_checkpoint(tmp_path, target, {}, seed=4, draft_ids=torch.arange(target.config.vocab_size))
    assert "d2t" not in load_file(tmp_path / WEIGHTS_NAME)
    head = EagleHead.from_pretrained(tmp_path, base_model=target)
    assert head.draft_vocab_size is None
    assert_same_computation(head, lib, seed=5)


# --------------------------------------------------------------------------------------------- refusals
def _speculators_folder(tmp_path, target, **changes):
    random_eagle3(target).save_pretrained(tmp_path, format="speculators")
    config = json.loads((tmp_path / CONFIG_NAME).read_text())
    for key, value in changes.items():
        node, *path = key.split("__")
        holder = config
        for part in [node, *path][:-1]:
            holder = holder[part]
        holder[[node, *path][-1]] = value
    (tmp_path / CONFIG_NAME).write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize("kind", sorted(REFUSED_KINDS))
def test_kinds_without_a_proposer_are_refused_by_name(tmp_path, target, kind):
    folder = _speculators_folder(tmp_path, target, speculators_model_type=kind)
    with pytest.raises(ValueError, match=f"speculators '{kind}' checkpoint, which hf-specdec cannot run"):
        EagleHead.from_pretrained(folder)


def test_library_configs_of_other_kinds_are_refused(tmp_path):
    """The library's own P-EAGLE and MTP configs (what its save_pretrained writes) are refused by name."""
    from speculators.models.mtp import MTPSpeculatorConfig
    from speculators.models.peagle import PEagleSpeculatorConfig

    for config_class in (PEagleSpeculatorConfig, MTPSpeculatorConfig):
        folder = tmp_path / config_class.__name__
        config_class().save_pretrained(folder)
        kind = json.loads((folder / CONFIG_NAME).read_text())["speculators_model_type"]
        with pytest.raises(ValueError, match=f"'{kind}' checkpoint, which hf-specdec cannot run: .* no"):
            EagleHead.from_pretrained(folder)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"speculators_model_type": "hydra"}, "unknown kind 'hydra'"),
        ({"transformer_layer_config__model_type": "qwen3"}, "'qwen3' draft layer .* Llama decoder layers only"),
        ({"transformer_layer_config__num_hidden_layers": 2}, "2 draft decoder layers .* exactly one"),
        ({"speculators_config": {"algorithm": "eagle3"}}, "lacks speculators_config.verifier"),
        ({"norm_before_fc": True, "fc_norm": True}, "exclude each other"),
        ({"transformer_layer_config__hidden_size": 48}, "tensor 'fc.weight' in .*model.safetensors .* has shape"),
        ({"draft_vocab_size": 60}, "tensor 'd2t' in .*model.safetensors .* has shape \\[70\\], expected \\[60\\]"),
    ],
)
def test_unsupported_or_mismatched_configs_are_refused(tmp_path, target, changes, message):
    folder = _speculators_folder(tmp_path, target, **changes)
    with pytest.raises(ValueError, match=message):
        EagleHead.from_pretrained(folder)


def test_sliding_window_layers_warn(tmp_path, target):
    folder = _speculators_folder(
        tmp_path, target, transformer_layer_config__layer_types=["sliding_attention"],
        transformer_layer_config__sliding_window=2048,
    )  # fmt: skip
    with pytest.warns(UserWarning, match="sliding-window attention \\(window 2048\\)"):
        EagleHead.from_pretrained(folder)


def test_corrupt_truncated_and_mismatched_weights_name_the_file(tmp_path, target):
    folder = _speculators_folder(tmp_path, target)
    weights = folder / WEIGHTS_NAME
    good = weights.read_bytes()
    weights.write_bytes(good[: len(good) // 2])
    with pytest.raises(ValueError, match=f"{weights}.*truncated or damaged"):
        EagleHead.from_pretrained(folder)
    weights.write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match=f"{weights}.*not a readable weights file"):
        EagleHead.from_pretrained(folder)
    tensors = load_file_bytes(good)
    tensors["layers.0.self_attn.q_proj.weight"] = tensors["layers.0.self_attn.q_proj.weight"][:, :64].contiguous()
    save_file(tensors, weights)
    with pytest.raises(ValueError, match="'midlayer.self_attn.q_proj.weight' in .*model.safetensors .*\\[64, 64\\], "
                       "expected \\[64, 128\\]"):  # fmt: skip
        EagleHead.from_pretrained(folder)
    tensors = load_file_bytes(good)
    del tensors["norm.weight"]
    tensors["extra.weight"] = torch.zeros(3)
    save_file(tensors, weights)
    with pytest.raises(ValueError, match="model.safetensors .* lacks the tensor 'norm.weight'"):
        EagleHead.from_pretrained(folder)
    tensors = load_file_bytes(good)
    tensors["d2t"] = tensors["d2t"] + 1000
    save_file(tensors, weights)
    with pytest.raises(ValueError, match="d2t in .*model.safetensors maps draft tokens outside"):
        EagleHead.from_pretrained(folder)
    (folder / CONFIG_NAME).write_text("{not json")
    with pytest.raises(ValueError, match=f"{folder / CONFIG_NAME} is not valid JSON"):
        EagleHead.from_pretrained(folder)


def load_file_bytes(data: bytes) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    return dict(load(data))


def test_verifier_mismatch_names_both_sides(tmp_path, target):
    random_eagle3(target).save_pretrained(tmp_path, format="speculators")
    other = tiny_causal_lm("qwen2", num_layers=LAYERS)  # same sizes, another architecture
    with pytest.raises(ValueError, match="verifier .* of architecture \\['LlamaForCausalLM'\\], but the target .* is "
                       "\\['Qwen2ForCausalLM'\\]"):  # fmt: skip
        EagleHead.from_pretrained(tmp_path, base_model=other)
    smaller = tiny_causal_lm("llama", hidden_size=32, num_layers=LAYERS)
    with pytest.raises(ValueError, match="hidden size 64 cannot serve .* hidden size 32"):
        EagleHead.from_pretrained(tmp_path, base_model=smaller)


def test_exports_a_format_cannot_express_are_refused_before_writing(tmp_path, target):
    eagle1 = EagleHead.for_model(target)
    with pytest.raises(ValueError, match="no EAGLE-1 kind .* format='eagle'"):
        eagle1.save_pretrained(tmp_path / "a", format="speculators")
    normed = random_eagle3(target, VARIANTS["speculators-training-defaults"])
    with pytest.raises(ValueError, match="upstream EAGLE-3 layout has no \\['norm_before_residual', 'norm_before_fc', "
                       "'norm_output'\\]"):  # fmt: skip
        normed.save_pretrained(tmp_path / "b", format="eagle")
    shallow = tiny_causal_lm("llama", num_layers=6)  # default feature layers (2, 3, 3)
    with pytest.raises(ValueError, match="\\[2, 3, 3\\], which repeat a layer"):
        random_eagle3(shallow).save_pretrained(tmp_path / "c", format="speculators")
    with pytest.raises(ValueError, match="saves the formats \\['hf-specdec', 'speculators', 'eagle'\\], not 'medusa'"):
        eagle1.save_pretrained(tmp_path / "d", format="medusa")
    unnamed = random_eagle3(target)
    unnamed.base_model_name_or_path = None
    with pytest.raises(ValueError, match="names its verifier"):
        unnamed.save_pretrained(tmp_path / "e", format="speculators")
    assert not any((tmp_path / name).exists() for name in "abcde")
