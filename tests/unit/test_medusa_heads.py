"""MedusaHeads: every published layout loads (with its quirks), computes the Medusa math, round-trips through our
format and refuses what does not fit with a message naming the key / both sizes."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

import hf_specdec.heads.hub as hub
from hf_specdec.heads.medusa import MedusaHeads
from hf_specdec.testing import tiny_causal_lm

H, V = 32, 97


# ----------------------------------------------------------------------------------------------- helpers
def random_upstream(num_heads=3, num_layers=1, bias=True, lm_heads=True, vocab=V, seed=0):
    """Per-head weights as lists: W[h][l] [H, H], b[h][l] [H], lm[h] [V, H]."""
    g = torch.Generator().manual_seed(seed)
    w = [[torch.randn(H, H, generator=g) * 0.2 for _ in range(num_layers)] for _ in range(num_heads)]
    b = [[torch.randn(H, generator=g) * 0.2 for _ in range(num_layers)] for _ in range(num_heads)] if bias else None
    lm = [torch.randn(vocab, H, generator=g) * 0.3 for _ in range(num_heads)] if lm_heads else None
    return w, b, lm


def reference_logits(x, w, b, lm, base_lm_head=None):
    """The Medusa head math written out head by head: L x ResBlock(x + SiLU(Wx + b)), then the lm_head."""
    out = []
    for h in range(len(w)):
        y = x
        for layer in range(len(w[h])):
            y = y + F.silu(F.linear(y, w[h][layer], None if b is None else b[h][layer]))
        out.append(F.linear(y, lm[h]) if lm is not None else base_lm_head(y))
    return torch.stack(out)


def upstream_state(w, b, lm, block_key: str, lm_head_key: str) -> dict:
    """Per-head block weights ``w[h][layer]`` (biases ``b``, None: none) and lm_heads ``lm[h]`` (None: shared) under
    an upstream layout's key templates (``{h}`` head, ``{layer}`` block, ``{kind}`` weight/bias, ``{L}`` blocks)."""
    state = {}
    for h in range(len(w)):
        for layer in range(len(w[h])):
            state[block_key.format(h=h, layer=layer, kind="weight")] = w[h][layer]
            if b is not None:
                state[block_key.format(h=h, layer=layer, kind="bias")] = b[h][layer]
        if lm is not None:
            state[lm_head_key.format(h=h, L=len(w[h]))] = lm[h]
    return state


def fasterdecoding_state(w, b, lm, prefix=""):
    """FasterDecoding key names: {h}.{l}.linear.weight/bias, {h}.{L}.weight."""
    return upstream_state(w, b, lm, prefix + "{h}.{layer}.linear.{kind}", prefix + "{h}.{L}.weight")


def vllm_state(w, b, lm):
    """vLLM key names: blocks.{h}.layers.{l}.weight/bias, lm_heads.{h}.weight."""
    return upstream_state(w, b, lm, "blocks.{h}.layers.{layer}.{kind}", "lm_heads.{h}.weight")


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2))


def write_v01(folder: Path, w, b, lm, config_heads=2) -> Path:
    """FasterDecoding/medusa-vicuna-7b-v1.3 style: config.json (wrong head count) + torch.save'd medusa_lm_head.pt."""
    folder.mkdir(parents=True, exist_ok=True)
    write_json(
        folder / "config.json",
        {
            "base_model_name_or_path": "lmsys/vicuna-7b-v1.3",
            "medusa_num_heads": config_heads,
            "medusa_num_layers": len(w[0]),
            "transformers_version": "4.32.0.dev0",
        },
    )
    torch.save(fasterdecoding_state(w, b, lm), folder / "medusa_lm_head.pt")
    return folder


@pytest.fixture
def x():
    return torch.randn(2, 5, H, generator=torch.Generator().manual_seed(1))  # [..., H]


# ----------------------------------------------------------------------------------------------- formats
def test_v01_pt_heads_load_with_head_count_from_keys_and_warn_on_wrong_config(tmp_path, x):
    w, b, lm = random_upstream(num_heads=5)
    folder = write_v01(tmp_path / "medusa-vicuna", w, b, lm, config_heads=2)
    with pytest.warns(UserWarning, match="medusa_num_heads=2 but the weights hold 5"):
        heads = MedusaHeads.from_pretrained(folder)
    assert (heads.num_heads, heads.num_layers, heads.hidden_size, heads.vocab_size) == (5, 1, H, V)
    assert not heads.share_lm_head and heads.source_format == "medusa-1"
    assert heads.base_model_name_or_path == "lmsys/vicuna-7b-v1.3"
    torch.testing.assert_close(heads(x), reference_logits(x, w, b, lm), rtol=1e-5, atol=1e-5)


def test_v01_with_two_resblocks_per_head(tmp_path, x):
    w, b, lm = random_upstream(num_heads=2, num_layers=2)
    heads = MedusaHeads.from_pretrained(write_v01(tmp_path / "m", w, b, lm, config_heads=2))
    assert heads.num_layers == 2
    torch.testing.assert_close(heads(x), reference_logits(x, w, b, lm), rtol=1e-5, atol=1e-5)


def test_v01_fp16_weights_keep_their_dtype_unless_asked(tmp_path, x):
    w, b, lm = random_upstream(num_heads=2)
    wh, bh, lmh = [[t.half() for t in r] for r in w], [[t.half() for t in r] for r in b], [t.half() for t in lm]
    folder = write_v01(tmp_path / "m", wh, bh, lmh, config_heads=2)
    assert MedusaHeads.from_pretrained(folder).block_weight.dtype == torch.float16
    heads = MedusaHeads.from_pretrained(folder, dtype=torch.float32)
    assert heads.block_weight.dtype == torch.float32
    as_float = lambda rows: [[t.float() for t in r] for r in rows]  # noqa: E731
    ref = reference_logits(x, as_float(wh), as_float(bh), [t.float() for t in lmh])
    torch.testing.assert_close(heads(x), ref, rtol=1e-5, atol=1e-5)


def test_version2_resblock_only_heads_use_the_base_lm_head(tmp_path, x):
    w, b, _ = random_upstream(num_heads=3, lm_heads=False)
    folder = tmp_path / "v2"
    folder.mkdir()
    write_json(
        folder / "config.json",
        {"version": "2", "medusa_num_heads": 3, "medusa_num_layers": 1, "base_model_name_or_path": "some/base"},
    )
    save_file(fasterdecoding_state(w, b, None), str(folder / "medusa_lm_head.safetensors"))
    heads = MedusaHeads.from_pretrained(folder)
    assert heads.share_lm_head and heads.lm_head_weight is None and heads.vocab_size is None
    assert heads.source_format == "medusa-v2-heads"
    base_lm = torch.nn.Linear(H, V, bias=False)
    with pytest.raises(ValueError, match="base model's lm_head"):
        heads(x)
    torch.testing.assert_close(
        heads(x, lm_head=base_lm), reference_logits(x, w, b, None, base_lm), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("bias", [True, False])
def test_vllm_layout_with_and_without_fc_bias(tmp_path, x, bias):
    w, b, lm = random_upstream(num_heads=3, bias=bias)
    folder = tmp_path / "vllm"
    folder.mkdir()
    config = {
        "model_type": "medusa",
        "architectures": ["MedusaModel"],
        "hidden_size": H,
        "vocab_size": V,
        "num_heads": 3,
        "num_hidden_layers": 1,
        "truncated_vocab_size": V,
        "max_paths": 64,
        "topk": 10,
    }
    if bias:
        config["medusa_fc_bias"] = True
    write_json(folder / "config.json", config)
    save_file(vllm_state(w, b, lm), str(folder / "model.safetensors"))
    heads = MedusaHeads.from_pretrained(folder)
    assert heads.source_format == "vllm" and (heads.block_bias is not None) == bias
    torch.testing.assert_close(heads(x), reference_logits(x, w, b, lm), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("stored_rows", ["truncated", "full"])
def test_vllm_truncated_vocab_token_map(tmp_path, x, stored_rows):
    vt = 40
    token_map = torch.randperm(V, generator=torch.Generator().manual_seed(3))[:vt]
    w, b, lm_full = random_upstream(num_heads=2, bias=False)
    lm = [t[token_map] for t in lm_full] if stored_rows == "truncated" else lm_full
    folder = tmp_path / "vllm-trunc"
    folder.mkdir()
    write_json(
        folder / "config.json",
        {
            "model_type": "medusa",
            "hidden_size": H,
            "vocab_size": V,
            "num_heads": 2,
            "num_hidden_layers": 1,
            "truncated_vocab_size": vt,
        },
    )
    save_file({**vllm_state(w, None, lm), "token_map": token_map}, str(folder / "model.safetensors"))
    heads = MedusaHeads.from_pretrained(folder)
    assert heads.draft_vocab_size == vt and torch.equal(heads.token_map, token_map)
    out = heads(x)  # [2, ..., V], -inf outside the token map
    ref = reference_logits(x, w, None, lm_full)
    torch.testing.assert_close(out[..., token_map], ref[..., token_map], rtol=1e-5, atol=1e-5)
    outside = torch.ones(V, dtype=torch.bool)
    outside[token_map] = False
    assert torch.isneginf(out[..., outside]).all()
    top = heads.topk_tokens(x.reshape(-1, H), 3)  # [N, heads, 3] are token ids, not draft indices
    expect = ref[..., token_map].reshape(2, -1, vt).topk(3, dim=-1).indices
    assert torch.equal(top, token_map[expect].permute(1, 0, 2))


def test_vllm_original_lm_head_becomes_the_shared_base_lm_head(tmp_path, x):
    """``original_lm_head``: one stored copy of the base lm_head (``lm_heads.0.weight``) serves every head; keys may
    carry vLLM's ``medusa_heads.`` prefix."""
    w, b, _ = random_upstream(num_heads=3, lm_heads=False)
    base_lm = torch.nn.Linear(H, V, bias=False)
    folder = tmp_path / "vllm-orig"
    folder.mkdir()
    write_json(
        folder / "config.json",
        {
            "model_type": "medusa",
            "hidden_size": H,
            "vocab_size": V,
            "num_heads": 3,
            "num_hidden_layers": 1,
            "medusa_fc_bias": True,
            "original_lm_head": True,
        },
    )
    state = {f"medusa_heads.{k}": v for k, v in vllm_state(w, b, None).items()}
    state["medusa_heads.lm_heads.0.weight"] = base_lm.weight.detach().clone()
    save_file(state, str(folder / "model.safetensors"))
    heads = MedusaHeads.from_pretrained(folder)
    assert heads.share_lm_head and heads.vocab_size == V
    torch.testing.assert_close(
        heads(x, lm_head=base_lm), reference_logits(x, w, b, None, base_lm), rtol=1e-5, atol=1e-5
    )


def test_vllm_truncated_vocab_without_token_map_is_refused(tmp_path):
    w, b, lm = random_upstream(num_heads=1)
    folder = tmp_path / "bad"
    folder.mkdir()
    write_json(
        folder / "config.json",
        {
            "model_type": "medusa",
            "hidden_size": H,
            "vocab_size": V,
            "num_heads": 1,
            "num_hidden_layers": 1,
            "truncated_vocab_size": 40,
        },
    )
    save_file(vllm_state(w, None, [t[:40] for t in lm]), str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="token_map"):
        MedusaHeads.from_pretrained(folder)


def _llama_base_config():
    return {
        "architectures": ["MedusaModel"],
        "model_type": "llama",
        "hidden_size": H,
        "vocab_size": V,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "medusa_num_heads": 2,
        "medusa_num_layers": 1,
        "torch_dtype": "float32",
    }


def test_medusa2_sharded_checkpoint_reads_only_the_head_tensors(tmp_path, x, monkeypatch):
    w, b, lm = random_upstream(num_heads=3)
    folder = tmp_path / "medusa-2"
    folder.mkdir()
    write_json(folder / "config.json", _llama_base_config())  # medusa_num_heads says 2, the shards hold 3
    base = {
        "model.embed_tokens.weight": torch.randn(V, H),
        "model.norm.weight": torch.ones(H),
        "lm_head.weight": torch.randn(V, H),
    }
    heads_state = fasterdecoding_state(w, b, lm, prefix="medusa_head.")
    # shard 1 holds only base weights and is not even a valid file: opening it would fail the test
    (folder / "model-00001-of-00002.safetensors").write_bytes(b"not a safetensors file: never read")
    save_file(
        {"lm_head.weight": base["lm_head.weight"], **heads_state}, str(folder / "model-00002-of-00002.safetensors")
    )
    weight_map = {k: "model-00001-of-00002.safetensors" for k in ("model.embed_tokens.weight", "model.norm.weight")}
    weight_map.update({k: "model-00002-of-00002.safetensors" for k in ["lm_head.weight", *heads_state]})
    write_json(folder / "model.safetensors.index.json", {"metadata": {"total_size": 0}, "weight_map": weight_map})

    read = []
    real_safe_open = hub.safe_open

    class SpySafeOpen:
        def __init__(self, path, **kwargs):
            self.f = real_safe_open(path, **kwargs)

        def __enter__(self):
            inner = self.f.__enter__()

            class Handle:
                keys = inner.keys

                @staticmethod
                def get_tensor(key):
                    read.append(key)
                    return inner.get_tensor(key)

            return Handle

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

    monkeypatch.setattr(hub, "safe_open", SpySafeOpen)
    with pytest.warns(UserWarning, match="medusa_num_heads=2 but the weights hold 3"):
        heads = MedusaHeads.from_pretrained(folder)
    assert sorted(read) == sorted(heads_state), "only medusa_head.* tensors may be read"
    assert heads.source_format == "medusa-2-checkpoint" and heads.num_heads == 3
    assert heads.base_model_name_or_path == str(folder)
    torch.testing.assert_close(heads(x), reference_logits(x, w, b, lm), rtol=1e-5, atol=1e-5)


def test_medusa2_single_file_checkpoint(tmp_path, x):
    w, b, lm = random_upstream(num_heads=2)
    folder = tmp_path / "medusa-2-small"
    folder.mkdir()
    write_json(folder / "config.json", _llama_base_config())
    save_file(
        {
            "lm_head.weight": torch.randn(V, H),
            "model.norm.weight": torch.ones(H),
            **fasterdecoding_state(w, b, lm, prefix="medusa_head."),
        },
        str(folder / "model.safetensors"),
    )
    heads = MedusaHeads.from_pretrained(folder)
    torch.testing.assert_close(heads(x), reference_logits(x, w, b, lm), rtol=1e-5, atol=1e-5)


def test_a_base_model_checkpoint_without_heads_is_refused(tmp_path):
    folder = tmp_path / "base"
    folder.mkdir()
    write_json(folder / "config.json", {"model_type": "llama", "hidden_size": H})
    save_file({"lm_head.weight": torch.randn(V, H)}, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="holds no Medusa head tensors"):
        MedusaHeads.from_pretrained(folder)


# ----------------------------------------------------------------------------------------------- shape errors
def test_wrong_tensor_shape_names_the_key_and_both_shapes(tmp_path):
    w, b, lm = random_upstream(num_heads=4)
    w[3][0] = torch.randn(H, H - 1)
    with pytest.raises(ValueError, match=r"'3\.0\.linear\.weight'.*shape \[32, 31\], expected \[32, 32\]"):
        MedusaHeads.from_pretrained(write_v01(tmp_path / "m", w, b, lm, config_heads=4))


def test_lm_head_with_other_vocab_than_the_config_names_the_key(tmp_path):
    w, b, lm = random_upstream(num_heads=2)
    folder = tmp_path / "vllm"
    folder.mkdir()
    write_json(
        folder / "config.json",
        {
            "model_type": "medusa",
            "hidden_size": H,
            "vocab_size": 100,
            "num_heads": 2,
            "num_hidden_layers": 1,
            "medusa_fc_bias": True,
        },
    )
    save_file(vllm_state(w, b, lm), str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=r"'lm_heads\.0\.weight'.*\[97, 32\], expected \[100, 32\]"):
        MedusaHeads.from_pretrained(folder)


def test_missing_and_unexpected_tensors_are_named(tmp_path):
    w, b, lm = random_upstream(num_heads=3)
    state = fasterdecoding_state(w, b, lm)
    del state["2.0.linear.bias"]
    folder = tmp_path / "missing"
    folder.mkdir()
    torch.save(state, folder / "medusa_lm_head.pt")
    with pytest.raises(ValueError, match=r"lacks the tensor '2\.0\.linear\.bias'"):
        MedusaHeads.from_pretrained(folder)
    state = fasterdecoding_state(w, b, lm)
    state["optimizer.step"] = torch.zeros(1)
    torch.save(state, folder / "medusa_lm_head.pt")
    with pytest.raises(ValueError, match=r"unexpected tensor 'optimizer\.step'"):
        MedusaHeads.from_pretrained(folder)


def test_our_config_disagreeing_with_our_weights_names_the_key(tmp_path):
    heads = MedusaHeads(hidden_size=H, num_heads=2, vocab_size=V, share_lm_head=False)
    heads.save_pretrained(tmp_path / "ours")
    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    config["vocab_size"] = 50
    write_json(tmp_path / "ours" / "config.json", config)
    with pytest.raises(ValueError, match=r"'lm_head_weight'.*\[2, 97, 32\], expected \[2, 50, 32\]"):
        MedusaHeads.from_pretrained(tmp_path / "ours")


# ----------------------------------------------------------------------------------------------- base model checks
def test_heads_for_another_hidden_size_refuse_the_model():
    model = tiny_causal_lm("llama")  # hidden 64, vocab 97
    heads = MedusaHeads(hidden_size=4096, vocab_size=97, base_model_name_or_path="lmsys/vicuna-7b-v1.3")
    with pytest.raises(ValueError, match="MedusaHeads for hidden size 4096 cannot serve a model with hidden size 64"):
        heads.bind(model)


def test_heads_for_another_vocabulary_refuse_the_model(tmp_path):
    model = tiny_causal_lm("llama")
    heads = MedusaHeads(hidden_size=64, vocab_size=32000)
    heads.save_pretrained(tmp_path / "h")
    with pytest.raises(ValueError, match="vocabulary size 32000 cannot serve a model with vocabulary size 97"):
        MedusaHeads.from_pretrained(tmp_path / "h", base_model=model)


def test_bound_shared_lm_head_heads_use_the_model_lm_head(x):
    model = tiny_causal_lm("llama", hidden_size=H)
    heads = MedusaHeads.for_model(model, num_heads=2)
    with torch.no_grad():
        heads.block_weight.normal_(0, 0.2)
    w = [[heads.block_weight[h, 0]] for h in range(2)]
    b = [[heads.block_bias[h, 0]] for h in range(2)]
    with torch.no_grad():
        torch.testing.assert_close(heads(x), reference_logits(x, w, b, None, model.lm_head), rtol=1e-5, atol=1e-5)


def test_fresh_heads_start_as_identity_resblocks(x):
    model = tiny_causal_lm("llama", hidden_size=H)
    heads = MedusaHeads.for_model(model, num_heads=2, share_lm_head=False)
    assert torch.count_nonzero(heads.block_weight) == 0
    with torch.no_grad():
        states = heads.head_states(x)
        torch.testing.assert_close(states, (x + F.silu(heads.block_bias[:, 0, None, None, :])), rtol=0, atol=1e-6)
        torch.testing.assert_close(heads.lm_head_weight[1], model.lm_head.weight)


# ----------------------------------------------------------------------------------------------- our format
def test_save_then_load_gives_bitwise_equal_outputs(tmp_path, x):
    heads = MedusaHeads(
        hidden_size=H,
        num_heads=3,
        num_layers=2,
        vocab_size=V,
        share_lm_head=False,
        base_model_name_or_path="HuggingFaceTB/SmolLM2-135M-Instruct",
        tree_choices=[[0], [0, 0], [1]],
        model_card={"training_data": "ultrachat 1k", "tau": 2.31, "speedup": 1.7},
    )
    with torch.no_grad():
        heads.block_weight.normal_(0, 0.2)
    heads.save_pretrained(tmp_path / "ours")
    files = sorted(p.name for p in (tmp_path / "ours").iterdir())
    assert files == ["README.md", "config.json", "model.safetensors"]
    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert config["head_type"] == "medusa" and config["hidden_size"] == H and config["vocab_size"] == V
    loaded = MedusaHeads.from_pretrained(tmp_path / "ours")
    assert torch.equal(loaded(x), heads(x))
    assert loaded.tree_choices == [[0], [0, 0], [1]] and loaded.model_card["tau"] == 2.31
    card = (tmp_path / "ours" / "README.md").read_text()
    assert "base_model: HuggingFaceTB/SmolLM2-135M-Instruct" in card and "library_name: hf-specdec" in card
    assert "ultrachat 1k" in card and "2.31" in card and "1.7×" in card


def test_round_trip_keeps_truncated_vocab_and_shared_lm_head(tmp_path, x):
    heads = MedusaHeads(
        hidden_size=H, num_heads=2, vocab_size=V, share_lm_head=True, draft_vocab_size=10, block_bias=False
    )
    with torch.no_grad():
        heads.block_weight.normal_(0, 0.2)
        heads.token_map.copy_(torch.arange(10) * 7)
    heads.save_pretrained(tmp_path / "t")
    loaded = MedusaHeads.from_pretrained(tmp_path / "t")
    base_lm = torch.nn.Linear(H, V, bias=False)
    assert torch.equal(loaded.token_map, heads.token_map) and loaded.block_bias is None
    assert torch.equal(loaded(x, lm_head=base_lm), heads(x, lm_head=base_lm))
    card = (tmp_path / "t" / "README.md").read_text()
    assert "not recorded" in card  # no invented tau / speedup


def test_converting_an_upstream_checkpoint_to_our_format_is_lossless(tmp_path, x):
    w, b, lm = random_upstream(num_heads=5)
    with pytest.warns(UserWarning):
        upstream = MedusaHeads.from_pretrained(write_v01(tmp_path / "v01", w, b, lm))
    upstream.save_pretrained(tmp_path / "ours")
    ours = MedusaHeads.from_pretrained(tmp_path / "ours")
    assert torch.equal(ours(x), upstream(x)) and ours.source_format == "medusa-1"


def test_loading_only_the_first_heads(tmp_path, x):
    w, b, lm = random_upstream(num_heads=5)
    with pytest.warns(UserWarning):
        heads = MedusaHeads.from_pretrained(write_v01(tmp_path / "v01", w, b, lm), num_heads=2)
    assert heads.num_heads == 2
    torch.testing.assert_close(heads(x), reference_logits(x, w[:2], b[:2], lm[:2]), rtol=1e-5, atol=1e-5)


def test_another_head_type_folder_is_refused(tmp_path):
    (tmp_path / "eagle").mkdir()
    write_json(tmp_path / "eagle" / "config.json", {"head_type": "eagle", "hidden_size": H})
    with pytest.raises(ValueError, match="holds a 'eagle' head, not Medusa heads"):
        MedusaHeads.from_pretrained(tmp_path / "eagle")


# ----------------------------------------------------------------------------------------------- Hub resolution
def _fake_hub_cache(cache_dir: Path, repo_id: str, src: Path) -> None:
    """The huggingface_hub cache layout (what `hf download` leaves behind), filled from a local folder."""
    repo = cache_dir / f"models--{repo_id.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(src, repo / "snapshots" / commit)


def test_repo_id_resolves_through_the_hub_cache_offline(tmp_path, x):
    w, b, lm = random_upstream(num_heads=2)
    write_v01(tmp_path / "src", w, b, lm, config_heads=2)
    _fake_hub_cache(tmp_path / "cache", "FasterDecoding/medusa-tiny", tmp_path / "src")
    heads = MedusaHeads.from_pretrained(
        "FasterDecoding/medusa-tiny", cache_dir=tmp_path / "cache", local_files_only=True
    )
    torch.testing.assert_close(heads(x), reference_logits(x, w, b, lm), rtol=1e-5, atol=1e-5)
    assert heads.source == "FasterDecoding/medusa-tiny"


def test_uncached_repo_offline_gives_a_clear_error(tmp_path):
    with pytest.raises(OSError, match=r"Hub is unreachable .* not in the local cache"):
        MedusaHeads.from_pretrained("someone/medusa-heads", cache_dir=tmp_path / "empty", local_files_only=True)


def test_missing_folder_and_empty_folder_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither an existing folder nor a Hub repo id"):
        MedusaHeads.from_pretrained(str(tmp_path / "does" / "not-exist"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"no Medusa heads found: .*medusa_lm_head\.pt"):
        MedusaHeads.from_pretrained(tmp_path / "empty")


def test_push_to_hub_uploads_a_loadable_folder_with_a_card(tmp_path, monkeypatch, x):
    """The real push_to_hub code path (ModelHubMixin + our save); only HfApi's two network calls are replaced by a
    local "remote" folder."""
    import huggingface_hub.hub_mixin as hub_mixin

    remote = tmp_path / "remote"
    calls = []

    class LocalHfApi:
        def __init__(self, token=None):
            self.token = token

        def create_repo(self, repo_id, private=None, exist_ok=False, **kwargs):
            calls.append(("create_repo", repo_id, private))
            (remote / repo_id).mkdir(parents=True, exist_ok=exist_ok)
            return type("RepoUrl", (), {"repo_id": repo_id})()

        def upload_folder(self, repo_id, folder_path, commit_message=None, **kwargs):
            calls.append(("upload_folder", repo_id, commit_message))
            shutil.copytree(folder_path, remote / repo_id, dirs_exist_ok=True)
            return f"local://{repo_id}/commit/1"

    monkeypatch.setattr(hub_mixin, "HfApi", LocalHfApi)
    heads = MedusaHeads(
        hidden_size=H, num_heads=2, vocab_size=V, base_model_name_or_path="org/base", model_card={"tau": 2.5}
    )
    with torch.no_grad():
        heads.block_weight.normal_(0, 0.2)
    url = heads.push_to_hub("me/tiny-medusa", private=True, commit_message="heads")
    assert url == "local://me/tiny-medusa/commit/1"
    assert calls == [("create_repo", "me/tiny-medusa", True), ("upload_folder", "me/tiny-medusa", "heads")]
    pushed = remote / "me" / "tiny-medusa"
    assert sorted(p.name for p in pushed.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    card = (pushed / "README.md").read_text()
    assert 'MedusaHeads.from_pretrained("me/tiny-medusa"' in card and "base_model: org/base" in card
    base_lm = torch.nn.Linear(H, V, bias=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded = MedusaHeads.from_pretrained(pushed)
    assert torch.equal(loaded(x, lm_head=base_lm), heads(x, lm_head=base_lm))


# ----------------------------------------------------------------------------------------------- bad trees and maps
# a bad ``tree_choices`` and the words its error names (besides the file and field, or the argument)
BAD_TREES = [
    ("abc", ["'abc'", "a list of paths"]),
    ([["a"], ["b"], ["c"]], ["'a'", "ranks are integers"]),  # "abc" as stored by list("abc") paths
    ([[0], [99]], ["rank 99", "draft from 10 tokens"]),
    ([[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]], ["[0, 0, 0, 0] is 4 deep", "3 heads"]),
    ([[-1]], ["negative rank -1"]),
    ([[0], [1, 0]], ["[1, 0] hangs under [1]", "not in the list"]),
    ([[0.5]], ["0.5", "ranks are integers"]),
    ([0, 1], ["entry 0 is 0"]),
]


def _heads_with_draft_vocab(num_heads: int = 3) -> MedusaHeads:
    heads = MedusaHeads(hidden_size=H, num_heads=num_heads, vocab_size=V, share_lm_head=True, draft_vocab_size=10)
    with torch.no_grad():
        heads.token_map.copy_(torch.arange(10) * 7)
    return heads


@pytest.mark.parametrize("choices, words", BAD_TREES, ids=[repr(c) for c, _ in BAD_TREES])
def test_a_bad_tree_in_a_config_file_is_refused_naming_the_file_and_field(tmp_path, choices, words):
    _heads_with_draft_vocab().save_pretrained(tmp_path / "h")
    config_path = tmp_path / "h" / "config.json"
    config = json.loads(config_path.read_text())
    config["tree_choices"] = choices
    write_json(config_path, config)
    with pytest.raises((TypeError, ValueError)) as info:
        MedusaHeads.from_pretrained(tmp_path / "h")
    message = str(info.value)
    assert f"{config_path} field 'tree_choices'" in message, message
    assert not [w for w in words if w not in message], message


@pytest.mark.parametrize("choices, words", BAD_TREES, ids=[repr(c) for c, _ in BAD_TREES])
def test_a_bad_tree_argument_is_refused_naming_the_argument(choices, words):
    from hf_specdec.generation.proposers.medusa import MedusaAssistant

    heads = _heads_with_draft_vocab()
    with pytest.raises((TypeError, ValueError)) as info:
        MedusaAssistant(heads, tree_choices=choices)
    message = str(info.value)
    assert message.startswith("MedusaAssistant tree_choices") and "invalid literal" not in message, message
    assert not [w for w in words if w not in message], message


def test_a_tree_ranked_past_the_target_vocabulary_is_refused_at_generate():
    """Heads that take the target's lm_head and were built without its vocabulary size learn it from the target."""
    from hf_specdec.generation.proposers.medusa import MedusaAssistant

    model = tiny_causal_lm("llama", hidden_size=H)
    heads = MedusaHeads(hidden_size=H, num_heads=2, share_lm_head=True)
    assistant = MedusaAssistant(heads, tree_choices=[[0], [120]])
    with pytest.raises(ValueError, match=r"tree_choices use rank 120.*97 tokens"):
        model.generate(torch.tensor([[1, 5, 7]]), max_new_tokens=3, do_sample=False, assistant=assistant)


def test_a_token_map_outside_the_vocabulary_is_refused_on_load_naming_the_file(tmp_path):
    from safetensors.torch import load_file

    _heads_with_draft_vocab().save_pretrained(tmp_path / "h")
    weights = tmp_path / "h" / "model.safetensors"
    tensors = load_file(weights)
    tensors["token_map"][3] = 10**12
    save_file(tensors, weights)
    with pytest.raises(ValueError) as info:
        MedusaHeads.from_pretrained(tmp_path / "h")
    message = str(info.value)
    for words in ("tensor 'token_map'", str(weights), "draft index 3", str(10**12), f"vocabulary of {V} ids",
                  "field 'vocab_size'"):  # fmt: skip
        assert words in message, message


def test_a_token_map_outside_the_target_vocabulary_is_refused_at_bind_and_generate():
    model = tiny_causal_lm("llama", hidden_size=H)
    heads = _heads_with_draft_vocab(num_heads=2)
    with torch.no_grad():
        heads.token_map[5] = 10**12  # changed in memory after construction
    with pytest.raises(ValueError, match=r"token_map.*draft index 5 to token id 1000000000000.*97 ids"):
        heads.bind(model)
    with pytest.raises(ValueError, match=r"token_map.*draft index 5 to token id 1000000000000.*97 ids"):
        model.generate(torch.tensor([[1, 5, 7]]), max_new_tokens=3, do_sample=False, assistant=heads)
