"""EagleHead: both upstream layouts load from folders written with the exact upstream names, one draft pass equals a
plain re-implementation written here, and every mismatch is refused with an error naming the file."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

from hf_specdec.heads.eagle import EagleHead

H, V, HEADS, KV, INTER, TARGET_LAYERS = 32, 48, 4, 2, 64, 8
D = H // HEADS


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=H,
        intermediate_size=INTER,
        num_attention_heads=HEADS,
        num_key_value_heads=KV,
        num_hidden_layers=TARGET_LAYERS,
        vocab_size=V,
    )
    return LlamaForCausalLM(cfg).eval()


def upstream_config(**extra) -> dict:
    """A Llama config as the EAGLE repos write it."""
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": H,
        "intermediate_size": INTER,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV,
        "num_hidden_layers": 1,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 512,
        "vocab_size": V,
        "hidden_act": "silu",
        "torch_dtype": "float32",
        "transformers_version": "4.28.1",
    }
    cfg.update(extra)
    return cfg


def rnd(*shape):
    return torch.randn(*shape) * 0.2


def attn_mlp_tensors(prefix: str, q_in: int) -> dict[str, torch.Tensor]:
    return {
        f"{prefix}self_attn.q_proj.weight": rnd(HEADS * D, q_in),
        f"{prefix}self_attn.k_proj.weight": rnd(KV * D, q_in),
        f"{prefix}self_attn.v_proj.weight": rnd(KV * D, q_in),
        f"{prefix}self_attn.o_proj.weight": rnd(H, HEADS * D),
        f"{prefix}mlp.gate_proj.weight": rnd(INTER, H),
        f"{prefix}mlp.up_proj.weight": rnd(INTER, H),
        f"{prefix}mlp.down_proj.weight": rnd(H, INTER),
        f"{prefix}post_attention_layernorm.weight": 1 + rnd(H),
    }


def eagle1_tensors(bias: bool = True, embed: bool = True) -> dict[str, torch.Tensor]:
    t = {"fc.weight": rnd(H, 2 * H), **attn_mlp_tensors("layers.0.", H)}
    if bias:
        t["fc.bias"] = rnd(H)
    if embed:
        t["embed_tokens.weight"] = rnd(V, H)
    t["layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(D // 2)  # old transformers stored it
    return t


def eagle3_tensors(draft_vocab: int | None = 20) -> dict[str, torch.Tensor]:
    t = {
        "fc.weight": rnd(H, 3 * H),
        **attn_mlp_tensors("midlayer.", 2 * H),
        "midlayer.input_layernorm.weight": 1 + rnd(H),
        "midlayer.hidden_norm.weight": 1 + rnd(H),
        "norm.weight": 1 + rnd(H),
        "lm_head.weight": rnd(draft_vocab or V, H),
    }
    if draft_vocab is not None:
        ids = torch.sort(torch.randperm(V)[:draft_vocab]).values
        t["d2t"] = ids - torch.arange(draft_vocab)
        t["t2d"] = torch.zeros(V, dtype=torch.bool)
        t["t2d"][ids] = True
    return t


def write_folder(path, config: dict, tensors: dict, fmt: str = "bin"):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    if fmt == "bin":
        torch.save(tensors, path / "pytorch_model.bin")
    else:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return path


# ------------------------------------------------------------------------------------------ plain reference
def rms(x, w, eps=1e-6):
    return w * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, pos):  # x [T, heads, D]
    inv = 1.0 / (10000.0 ** (torch.arange(0, D, 2).float() / D))
    ang = pos[:, None].float() * inv[None]  # [T, D/2]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    rot = torch.cat([-x[..., D // 2 :], x[..., : D // 2]], -1)
    return x * cos + rot * sin


def reference_layer(t: dict, prefix: str, x_in, residual):
    """Causal self-attention (GQA, rotary) + SwiGLU MLP over one sequence `[T, *]`, written out."""
    n = x_in.shape[0]
    q = (x_in @ t[f"{prefix}self_attn.q_proj.weight"].T).view(n, HEADS, D)
    k = (x_in @ t[f"{prefix}self_attn.k_proj.weight"].T).view(n, KV, D)
    v = (x_in @ t[f"{prefix}self_attn.v_proj.weight"].T).view(n, KV, D)
    pos = torch.arange(n)
    q, k = rope(q, pos), rope(k, pos)
    k, v = k.repeat_interleave(HEADS // KV, dim=1), v.repeat_interleave(HEADS // KV, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(D)
    scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, H)
    h = residual + attn @ t[f"{prefix}self_attn.o_proj.weight"].T
    m = rms(h, t[f"{prefix}post_attention_layernorm.weight"])
    g = torch.nn.functional.silu(m @ t[f"{prefix}mlp.gate_proj.weight"].T) * (m @ t[f"{prefix}mlp.up_proj.weight"].T)
    return h + g @ t[f"{prefix}mlp.down_proj.weight"].T


# ------------------------------------------------------------------------------------------ EAGLE-1
@pytest.mark.parametrize("embed", [True, False], ids=["own-embed", "target-embed"])
@pytest.mark.parametrize("fmt", ["bin", "safetensors"])
def test_eagle1_layout_matches_plain_reimplementation(tmp_path, target, embed, fmt):
    torch.manual_seed(1)
    t = eagle1_tensors(bias=True, embed=embed)
    folder = write_folder(tmp_path / "e1", upstream_config(bias=True), t, fmt)
    head = EagleHead.from_pretrained(folder, base_model=target)
    assert head.version == 1 and head.feature_layers == (-1,) and head.source_format == "eagle"
    tokens = torch.randint(0, V, (1, 7))
    feats = torch.randn(1, 7, H)
    out, logits = head(tokens, feats)
    table = t["embed_tokens.weight"] if embed else target.get_input_embeddings().weight.detach()
    x = torch.cat([table[tokens[0]], feats[0]], -1) @ t["fc.weight"].T + t["fc.bias"]
    ref = reference_layer(t, "layers.0.", x, x)
    torch.testing.assert_close(out[0], ref, atol=1e-5, rtol=1e-5)
    ref_logits = ref @ target.get_output_embeddings().weight.detach().T
    torch.testing.assert_close(logits[0], ref_logits, atol=1e-5, rtol=1e-5)


def test_eagle1_without_bias_and_roundtrip(tmp_path, target):
    t = eagle1_tensors(bias=False, embed=False)
    head = EagleHead.from_pretrained(write_folder(tmp_path / "e1", upstream_config(bias=False), t), base_model=target)
    assert head.fc.bias is None
    head.save_pretrained(tmp_path / "ours")
    again = EagleHead.from_pretrained(tmp_path / "ours", base_model=target)
    assert again.source_format == "hf-specdec" and (tmp_path / "ours" / "README.md").is_file()
    tokens, feats = torch.randint(0, V, (2, 5)), torch.randn(2, 5, H)
    torch.testing.assert_close(head(tokens, feats)[1], again(tokens, feats)[1])


# ------------------------------------------------------------------------------------------ EAGLE-3
@pytest.mark.parametrize("draft_vocab", [20, None], ids=["d2t", "full-vocab"])
def test_eagle3_layout_matches_plain_reimplementation(tmp_path, target, draft_vocab):
    torch.manual_seed(2)
    t = eagle3_tensors(draft_vocab)
    extra = {"draft_vocab_size": draft_vocab or V, "target_hidden_size": H}
    head = EagleHead.from_pretrained(write_folder(tmp_path / "e3", upstream_config(**extra), t), base_model=target)
    assert head.version == 3 and head.feature_layers == (2, TARGET_LAYERS // 2, TARGET_LAYERS - 3)
    tokens = torch.randint(0, V, (1, 6))
    feats = torch.randn(1, 6, 3 * H)
    out, logits = head(tokens, feats)
    h = feats[0] @ t["fc.weight"].T
    emb = target.get_input_embeddings().weight.detach()[tokens[0]]
    x = torch.cat([rms(emb, t["midlayer.input_layernorm.weight"]), rms(h, t["midlayer.hidden_norm.weight"])], -1)
    ref = reference_layer(t, "midlayer.", x, h)
    torch.testing.assert_close(out[0], ref, atol=1e-5, rtol=1e-5)
    ref_logits = rms(ref, t["norm.weight"]) @ t["lm_head.weight"].T
    torch.testing.assert_close(logits[0], ref_logits, atol=1e-5, rtol=1e-5)
    best = logits[0].argmax(-1)
    ids = head.draft_to_token(best)
    if draft_vocab is None:
        assert torch.equal(ids, best)
    else:
        assert torch.equal(ids, best + t["d2t"][best]) and bool(head.t2d[ids].all())


def test_eagle3_feeds_its_own_output_back(tmp_path, target):
    t = eagle3_tensors(20)
    extra = {"draft_vocab_size": 20, "target_hidden_size": H}
    head = EagleHead.from_pretrained(write_folder(tmp_path / "e3", upstream_config(**extra), t), base_model=target)
    tokens, own = torch.randint(0, V, (1, 3)), torch.randn(1, 3, H)
    out, _ = head(tokens, own)  # H-wide input: no fc
    emb = target.get_input_embeddings().weight.detach()[tokens[0]]
    x = torch.cat([rms(emb, t["midlayer.input_layernorm.weight"]), rms(own[0], t["midlayer.hidden_norm.weight"])], -1)
    torch.testing.assert_close(out[0], reference_layer(t, "midlayer.", x, own[0]), atol=1e-5, rtol=1e-5)


def test_vllm_eagle3_names(tmp_path, target):
    t = eagle3_tensors(20)
    renamed = {("layers.0." + k[len("midlayer.") :] if k.startswith("midlayer.") else k): v for k, v in t.items()}
    renamed["draft_id_to_target_id"] = renamed.pop("d2t")
    del renamed["t2d"]
    extra = {"draft_vocab_size": 20, "target_hidden_size": H}
    head = EagleHead.from_pretrained(
        write_folder(tmp_path / "v", upstream_config(**extra), renamed, "st"), base_model=target
    )
    assert head.version == 3 and int(head.t2d.sum()) == 20


# ------------------------------------------------------------------------------------------ refusals
def test_hidden_size_mismatch_names_both_sides(tmp_path):
    other = LlamaForCausalLM(LlamaConfig(hidden_size=48, intermediate_size=64, num_attention_heads=4,
                                         num_key_value_heads=2, num_hidden_layers=2, vocab_size=V))  # fmt: skip
    folder = write_folder(tmp_path / "e1", upstream_config(), eagle1_tensors())
    with pytest.raises(ValueError, match="hidden size 32 cannot serve .* hidden size 48"):
        EagleHead.from_pretrained(folder, base_model=other)


def test_vocabulary_mismatch(tmp_path):
    other = LlamaForCausalLM(LlamaConfig(hidden_size=H, intermediate_size=64, num_attention_heads=4,
                                         num_key_value_heads=2, num_hidden_layers=2, vocab_size=V + 1))  # fmt: skip
    folder = write_folder(tmp_path / "e1", upstream_config(), eagle1_tensors())
    with pytest.raises(ValueError, match=f"vocabulary of {V} tokens cannot serve .* {V + 1} tokens"):
        EagleHead.from_pretrained(folder, base_model=other)


def test_layer_count_and_feature_layers(tmp_path, target):
    folder = write_folder(tmp_path / "two", upstream_config(num_hidden_layers=2), eagle1_tensors())
    with pytest.raises(ValueError, match=r"config.json says num_hidden_layers=2"):
        EagleHead.from_pretrained(folder)
    extra = {
        "draft_vocab_size": 20,
        "target_hidden_size": H,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 4, 30]},
    }
    folder = write_folder(tmp_path / "e3", upstream_config(**extra), eagle3_tensors(20))
    with pytest.raises(ValueError, match=r"\[1, 4, 30\].* has 8 layers"):
        EagleHead.from_pretrained(folder, base_model=target)


def test_missing_and_misshapen_tensors_name_the_file(tmp_path):
    t = eagle1_tensors()
    del t["layers.0.mlp.up_proj.weight"]
    folder = write_folder(tmp_path / "missing", upstream_config(), t)
    with pytest.raises(ValueError, match=r"pytorch_model.bin .*lacks the tensor 'layers.0.mlp.up_proj.weight'"):
        EagleHead.from_pretrained(folder)
    t = eagle3_tensors(20)
    t["lm_head.weight"] = rnd(21, H)
    folder = write_folder(tmp_path / "shape", upstream_config(draft_vocab_size=20, target_hidden_size=H), t)
    with pytest.raises(
        ValueError, match=r"'lm_head.weight' in .*pytorch_model.bin .* has shape \[21, 32\], expected \[20, 32\]"
    ):
        EagleHead.from_pretrained(folder)


def test_garbage_files_are_refused(tmp_path):
    folder = tmp_path / "garbage"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(upstream_config()))
    (folder / "pytorch_model.bin").write_bytes(b"not a checkpoint at all")
    with pytest.raises(ValueError, match=r"cannot read .*pytorch_model.bin as a weights file"):
        EagleHead.from_pretrained(folder)
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config.json is not valid JSON"):
        EagleHead.from_pretrained(folder)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text(json.dumps(upstream_config()))
    with pytest.raises(FileNotFoundError, match="model.safetensors, pytorch_model.bin"):
        EagleHead.from_pretrained(empty)
    wrong = write_folder(tmp_path / "medusa", upstream_config(), {"0.0.linear.weight": rnd(H, H)})
    with pytest.raises(ValueError, match="neither EAGLE-1"):
        EagleHead.from_pretrained(wrong)


def test_pickled_checkpoints_load_without_code_execution(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    t = eagle1_tensors()
    t["extra"] = Evil()
    folder = tmp_path / "evil"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(upstream_config()))
    torch.save(t, folder / "pytorch_model.bin")
    with pytest.raises(ValueError, match="weights_only=True"):
        EagleHead.from_pretrained(folder)
