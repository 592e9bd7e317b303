"""MLPSpeculator: the published "accelerator" layout (tied and untied, ``speculator.`` prefix, upstream config names)
loads from folders written here, one draft step equals the stage formula written out below, our format round-trips,
and whatever does not fit is refused with a message naming the file and both sides."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from hf_specdec.heads.mlp_speculator import MLPSpeculator
from hf_specdec.testing import tiny_causal_lm

H, INNER, V, N = 64, 48, 97, 3
TOP_K = [3, 2, 2]


# ----------------------------------------------------------------------------------------------- helpers
def upstream_weights(tied: bool, seed: int = 0) -> dict[str, list[torch.Tensor]]:
    """Per-stage weights as lists (tied stages hold the same tensor objects)."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.3):
        return torch.randn(*shape, generator=g) * scale

    stages = 1 if tied else N
    emb = [rand(V, INNER, scale=1.0) for _ in range(stages)]
    head = [rand(V, INNER) for _ in range(stages)]
    ln_w = [1.0 + rand(INNER, scale=0.1) for _ in range(stages)]
    ln_b = [rand(INNER, scale=0.1) for _ in range(stages)]
    proj = [rand(INNER, H)] + [rand(INNER, INNER) for _ in range(1 if tied else N - 1)]
    if tied:
        emb, head, ln_w, ln_b = emb * N, head * N, ln_w * N, ln_b * N
        proj = proj + [proj[1]] * (N - 2)
    return {"emb": emb, "head": head, "ln_w": ln_w, "ln_b": ln_b, "proj": proj}


def write_accelerator(folder: Path, w, tied: bool, scale_input: bool = True, all_copies: bool = False, **config):
    """A folder in the published layout: upstream config names, ``speculator.`` key prefix, tied copies once."""
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {
        "architectures": ["MLPSpeculatorPreTrainedModel"],
        "model_type": "mlp_speculator",
        "emb_dim": H,
        "inner_dim": INNER,
        "vocab_size": V,
        "n_predict": N,
        "top_k_tokens_per_head": TOP_K,
        "n_candidates": 4,
        "tie_weights": tied,
        "scale_input": scale_input,
        "torch_dtype": "float32",
        **config,
    }
    (folder / "config.json").write_text(json.dumps(cfg))
    stored = N if (not tied or all_copies) else 1
    state = {}
    for i in range(stored):
        state[f"speculator.emb.{i}.weight"] = w["emb"][i]
        state[f"speculator.head.{i}.weight"] = w["head"][i]
        state[f"speculator.ln.{i}.weight"] = w["ln_w"][i]
        state[f"speculator.ln.{i}.bias"] = w["ln_b"][i]
    for i in range(N if (not tied or all_copies) else 2):
        state[f"speculator.proj.{i}.weight"] = w["proj"][i]
    save_file({k: v.contiguous().clone() for k, v in state.items()}, str(folder / "model.safetensors"))
    return folder


def reference_chain(w, hidden, tokens, scale_input: bool):
    """The stage formula written out (FORMATS.md): `[S, N, V]` logits of stage i fed ``tokens[:, i]``."""
    sw = 0.5 ** (0.5 / N)
    ew = math.sqrt((1 - sw * sw) * INNER / 2)
    state = hidden
    if scale_input:
        state = state / torch.sqrt(state.pow(2).mean(-1, keepdim=True) + 1e-6) / math.sqrt(2)
    out = []
    for i in range(tokens.shape[1]):
        s = state @ w["proj"][i].T * sw + w["emb"][i][tokens[:, i]] * ew
        s = s / torch.sqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * w["ln_w"][i] + w["ln_b"][i]
        state = 0.5 * s * (1 + torch.erf(s / math.sqrt(2)))
        out.append(state @ w["head"][i].T)
    return torch.stack(out)


# ----------------------------------------------------------------------------------------------- published layout
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("scale_input", [False, True])
def test_published_layout_matches_the_stage_formula(tmp_path, tied, scale_input):
    w = upstream_weights(tied)
    folder = write_accelerator(tmp_path / "acc", w, tied, scale_input)
    spec = MLPSpeculator.from_pretrained(folder)
    assert spec.source_format == "ibm-accelerator"
    assert (spec.n_predict, spec.inner_dim, spec.top_k_tokens_per_head, spec.tie_weights) == (N, INNER, TOP_K, tied)
    hidden = torch.randn(5, H, generator=torch.Generator().manual_seed(1))
    tokens = torch.randint(0, V, (5, N), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        one = spec(hidden, tokens[:, :1])
        chain = spec(hidden, tokens)
    torch.testing.assert_close(one, reference_chain(w, hidden, tokens[:, :1], scale_input), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(chain, reference_chain(w, hidden, tokens, scale_input), rtol=1e-5, atol=1e-5)
    if tied:  # stored once, used by every stage
        assert sorted(spec.state_dict()) == [
            "emb.0.weight",
            "head.0.weight",
            "ln.0.bias",
            "ln.0.weight",
            "proj.0.weight",
            "proj.1.weight",
        ]


def test_tied_checkpoint_with_every_copy_stored(tmp_path):
    w = upstream_weights(tied=True)
    folder = write_accelerator(tmp_path / "acc", w, tied=True, all_copies=True)
    spec = MLPSpeculator.from_pretrained(folder)
    hidden, tokens = torch.randn(3, H), torch.randint(0, V, (3, N))
    with torch.no_grad():
        torch.testing.assert_close(spec(hidden, tokens), reference_chain(w, hidden, tokens, True), rtol=1e-5, atol=1e-5)


def test_tied_checkpoint_whose_copies_differ_is_refused(tmp_path):
    w = upstream_weights(tied=True)
    w["head"] = [w["head"][0], w["head"][0] + 1.0, w["head"][0]]
    folder = write_accelerator(tmp_path / "acc", w, tied=True, all_copies=True)
    with pytest.raises(ValueError, match=r"tie_weights=true but 'head\.1\.weight' differs"):
        MLPSpeculator.from_pretrained(folder)


def test_pickled_bin_is_loaded_with_weights_only(tmp_path):
    w = upstream_weights(tied=False)
    folder = write_accelerator(tmp_path / "acc", w, tied=False)
    from safetensors.torch import load_file

    torch.save(load_file(str(folder / "model.safetensors")), folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    spec = MLPSpeculator.from_pretrained(folder)
    hidden, tokens = torch.randn(2, H), torch.randint(0, V, (2, N))
    with torch.no_grad():
        torch.testing.assert_close(spec(hidden, tokens), reference_chain(w, hidden, tokens, True), rtol=1e-5, atol=1e-5)
    # a pickle that needs arbitrary code is refused by weights_only=True, with the file named
    torch.save({"emb.0.weight": torch.zeros(2), "evil": object()}, folder / "pytorch_model.bin")
    with pytest.raises(ValueError, match="pytorch_model.bin"):
        MLPSpeculator.from_pretrained(folder)


# ----------------------------------------------------------------------------------------------- our format
def test_our_format_round_trips_with_a_truncated_vocabulary(tmp_path):
    model = tiny_causal_lm("llama", vocab_size=V, hidden_size=H)
    token_map = torch.tensor([5, 9, 2, 40, 77, 3, 60, 11])
    spec = MLPSpeculator.for_model(model, inner_dim=INNER, n_predict=N, token_map=token_map, tie_weights=True)
    spec.model_card = {"training_data": "unit test"}
    spec.save_pretrained(tmp_path / "ours")
    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert config["head_type"] == "mlp_speculator" and config["draft_vocab_size"] == 8
    assert "unit test" in (tmp_path / "ours" / "README.md").read_text()
    again = MLPSpeculator.from_pretrained(tmp_path / "ours", base_model=model)
    hidden, tokens = torch.randn(4, H), torch.tensor([[5, 9, 2], [77, 1, 0], [96, 40, 3], [3, 3, 3]])
    with torch.no_grad():
        torch.testing.assert_close(again(hidden, tokens), spec(hidden, tokens))
    # tokens outside the draft vocabulary share the last embedding row; draft indices map back to token ids
    assert again.emb_rows(torch.tensor([5, 77, 1, 96])).tolist() == [0, 4, 8, 8]
    assert again.draft_to_token(torch.tensor([3, 0])).tolist() == [40, 5]
    assert spec(hidden, tokens).shape == (N, 4, 8)


# ----------------------------------------------------------------------------------------------- refusals
def test_target_with_other_sizes_is_refused_naming_both(tmp_path):
    folder = write_accelerator(tmp_path / "acc", upstream_weights(tied=False), tied=False)
    wrong_hidden = tiny_causal_lm("llama", vocab_size=V, hidden_size=32)
    with pytest.raises(ValueError, match=r"hidden size 64 cannot serve a model with hidden size 32") as err:
        MLPSpeculator.from_pretrained(folder, base_model=wrong_hidden)
    assert str(folder) in str(err.value)
    wrong_vocab = tiny_causal_lm("llama", vocab_size=101, hidden_size=H)
    with pytest.raises(ValueError, match=r"vocabulary size 97 cannot serve a model with vocabulary size 101"):
        MLPSpeculator.from_pretrained(folder, base_model=wrong_vocab)


def test_tensor_shape_mismatch_names_file_key_and_both_shapes(tmp_path):
    folder = write_accelerator(tmp_path / "acc", upstream_weights(tied=False), tied=False, inner_dim=40)
    with pytest.raises(ValueError, match=r"'emb\.0\.weight' in .*model\.safetensors .* has shape \[97, 48\], "):
        MLPSpeculator.from_pretrained(folder)


def test_missing_stage_is_refused(tmp_path):
    folder = write_accelerator(tmp_path / "acc", upstream_weights(tied=False), tied=False, n_predict=4,
                               top_k_tokens_per_head=[3, 2, 2, 1])  # fmt: skip
    with pytest.raises(ValueError, match=r"lacks the tensor 'emb\.3\.weight'"):
        MLPSpeculator.from_pretrained(folder)


def test_garbage_weights_and_invalid_config_name_the_file(tmp_path):
    folder = write_accelerator(tmp_path / "acc", upstream_weights(tied=False), tied=False)
    (folder / "model.safetensors").write_bytes(b"\x00\x01 definitely not a safetensors file")
    with pytest.raises(ValueError, match=r"cannot read the weights file .*model\.safetensors"):
        MLPSpeculator.from_pretrained(folder)
    good = write_accelerator(tmp_path / "acc2", upstream_weights(tied=False), tied=False)
    data = (good / "model.safetensors").read_bytes()
    (good / "model.safetensors").write_bytes(data[: len(data) // 2])  # truncated download
    with pytest.raises(ValueError, match=r"acc2/model\.safetensors"):
        MLPSpeculator.from_pretrained(good)
    (folder / "config.json").write_text("{ not json")
    with pytest.raises(ValueError, match=r"acc/config\.json is not valid JSON"):
        MLPSpeculator.from_pretrained(folder)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": H}))
    with pytest.raises(ValueError, match=r"config\.json is not an MLP speculator config"):
        MLPSpeculator.from_pretrained(folder)
    (folder / "config.json").write_text(json.dumps({"model_type": "mlp_speculator", "emb_dim": H, "n_predict": 2}))
    with pytest.raises(ValueError, match=r"config\.json lacks an integer 'vocab_size'"):
        MLPSpeculator.from_pretrained(folder)


def test_missing_files_are_named(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        MLPSpeculator.from_pretrained(empty)
    folder = write_accelerator(tmp_path / "acc", upstream_weights(tied=False), tied=False)
    (folder / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors.*pytorch_model\.bin"):
        MLPSpeculator.from_pretrained(folder)
