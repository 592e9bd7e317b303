"""``model.generate(ids, assistant="mtp")``: a model's own MTP layers (transformers' `MtpModel`, read from the
checkpoint) draft trees. On a tiny random model of every stock causal LM type of transformers 5.25 whose config
declares MTP layers, saved with MTP weights and reloaded: greedy output is token-for-token vanilla's and
transformers' own ``generate(use_mtp=True)``'s; a ragged batch of 4 equals each row generated alone; the head's
layer computes what transformers' `MtpModel.forward_layer` computes; sampling keeps the target's distribution
(chi-square on two types); models without MTP layers, or whose MTP layers keep more than keys and values, are
refused by name, and ``use_mtp=True`` beside ``assistant=`` is an error."""

from __future__ import annotations

import functools
import re

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.cache_utils import MtpCache
from transformers.modeling_layers import MtpModel

import hf_specdec  # noqa: F401  (installs the assistant= route)
from hf_specdec.attention.unsupported import UnsupportedModelError
from hf_specdec.generation.proposers import NgramAssistant, as_proposer
from hf_specdec.generation.proposers.mtp import MTPAssistant
from hf_specdec.heads.mtp import MTPHead, NoMTPLayersError
from hf_specdec.testing import (
    SAMPLING_VOCAB,
    assert_same_tokens,
    first_tokens_p_values,
    greedy_verification,
    left_pad,
    sample_first_tokens,
    tiny_causal_lm,
)
from tools.architectures import causal_lm_types, tiny_config

# every stock causal LM type of transformers 5.25 whose config has num_mtp_layers: those drafted, those refused
DRAFTED = ("bailing_hybrid", "deepseek_v3", "ernie4_5_moe", "glm4_moe", "mellum", "param2moe", "sarvam_mla",
           "sarvam_moe")  # fmt: skip
REFUSED = {"inkling_text": "keep state besides keys and values"}  # its MTP layer has a short convolution
# transformers 5.25's own use_mtp=True leaves vanilla's greedy text on this tiny bailing_hybrid at the 3rd new token
# (vanilla's top-2 margin there is 0.024, far above fp32 noise; its full forward agrees with vanilla's text): its
# assisted loop does not roll back the Kimi-delta layers' recurrent state of rejected drafts exactly
USE_MTP_DIFFERS = {"bailing_hybrid"}
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 5, 6, 7], [3, 4, 5], [9, 9, 8, 7, 6, 5, 4], [12, 13, 12, 13, 12, 13, 12, 13, 12]]
NO_BUDGET = {"tree_budget": False}  # random MTP layers draft low-probability trees a budget would cut to nothing


def _draw(modules, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in modules:
            for p in module.parameters():
                if p.dim() >= 2 and p.is_floating_point():
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.08)


def _mtp_config(model_type: str, n: int, vocab: int | None):
    """``tools.architectures.tiny_config`` with ``n`` MTP layers of full attention (and a smaller vocabulary)."""
    config = tiny_config(model_type)
    config.num_mtp_layers = n
    if vocab is not None:
        config.vocab_size = vocab
    for name in ("swiglu_limits", "swiglu_limits_shared"):  # per-layer lists the shrunk config left at full length
        if isinstance(getattr(config, name, None), list):
            setattr(config, name, [0] * config.num_hidden_layers)
    if getattr(config, "layer_types", None) is not None and getattr(config, "mtp_layer_types", None) is None:
        config.mtp_layer_types = ["full_attention"] * n
    if getattr(config, "mlp_layer_types", None) is not None and getattr(config, "mtp_mlp_layer_types", None) is None:
        config.mtp_mlp_layer_types = [config.mlp_layer_types[-1]] * n
    return config


def _checkpoint_keys(sd: dict, layers: int, layout: str) -> dict:
    """The MTP model's ``layers.{k}.[mtp_block.]...`` tensors under a checkpoint layout (``{L}``: the decoder's
    layer count + k, ``{k}``: k)."""
    def name(m):  # noqa: E306
        return layout.format(L=layers + int(m.group(1)), k=m.group(1))

    return {re.sub(r"^layers\.(\d+)\.(mtp_block\.)?", name, k): v.contiguous() for k, v in sd.items()}


LAYOUTS = ("model.layers.{L}.", "mtp.layers.{k}.", "model.mtp.layers.{k}.")  # DeepSeek's, Mellum's / ERNIE's, MiMo's


def saved_with_mtp(model_type: str, folder, n: int = 1, vocab: int | None = None, seed: int = 0):
    """A tiny random ``model_type`` with ``n`` random MTP layers, saved to ``folder`` (the MTP tensors written
    under the first layout the type's own key pattern matches) and reloaded from it, fp32, eval mode.

    Where the type's pattern names the published model's layer number (``model.layers.61`` for DeepSeek-V3), the
    reloaded model's pattern names this model's: its MTP layers sit after its few decoder layers."""
    config = _mtp_config(model_type, n, vocab)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    mtp = MtpModel(model, n)
    _draw([model, mtp], seed)
    if vocab is not None:
        with torch.no_grad():
            model.lm_head.weight.mul_(3.0)  # peaked but not degenerate next-token distributions
    model.save_pretrained(folder)
    layers = config.num_hidden_layers
    tensors = {k: v for k, v in mtp.state_dict().items() if k.startswith("layers.")}
    pattern = MtpModel.get_mtp_weights_regex(model) if model._keys_to_ignore_on_load_unexpected else None
    keys = next((keys for keys in (_checkpoint_keys(tensors, layers, lay) for lay in LAYOUTS)
                 if pattern is not None and all(pattern.search(k) for k in keys)), None)  # fmt: skip
    own_pattern = keys is None
    keys = keys or _checkpoint_keys(tensors, layers, LAYOUTS[0])
    path = f"{folder}/model.safetensors"
    save_file({**load_file(path), **keys}, path, metadata={"format": "pt"})
    transformers.logging.set_verbosity_error()  # the decoder's load reports the MTP tensors as unexpected
    try:
        reloaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    finally:
        transformers.logging.set_verbosity_warning()
    if own_pattern:
        reloaded._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.({'|'.join(str(layers + k) for k in range(n))})\."]
    reloaded.generation_config.pad_token_id, reloaded.generation_config.eos_token_id = 0, None
    return reloaded


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    """``mtp_model(model_type, n=1, vocab=None)``: `saved_with_mtp`, built once per module and arguments."""

    @functools.cache
    def build(model_type: str, n: int = 1, vocab: int | None = None):
        return saved_with_mtp(model_type, tmp_path_factory.mktemp(f"{model_type}-{n}-{vocab}"), n, vocab)

    return build


@pytest.mark.skipif(transformers.__version__ != "5.25.0", reason="the MTP types of the pinned transformers")
def test_the_types_are_every_stock_type_with_mtp_layers():
    found = {t for t in causal_lm_types() if hasattr(AutoConfig.for_model(t), "num_mtp_layers")}
    assert found == set(DRAFTED) | set(REFUSED)


@pytest.mark.parametrize("model_type", DRAFTED)
def test_greedy_equals_vanilla_and_transformers_use_mtp(mtp_model, model_type):
    model = mtp_model(model_type)
    ids = torch.tensor([PROMPTS[0]])
    expected = model.generate(ids, max_new_tokens=12, do_sample=False)
    theirs = model.generate(ids, max_new_tokens=12, do_sample=False, use_mtp=True)
    if model_type in USE_MTP_DIFFERS:  # recorded, so that a fixed transformers shows up here
        assert not torch.equal(theirs, expected), f"transformers' use_mtp=True now equals vanilla on {model_type}"
    else:
        assert_same_tokens(theirs, expected, f"{model_type} transformers' use_mtp=True")
    out = model.generate(ids, max_new_tokens=12, do_sample=False, assistant="mtp", return_dict_in_generate=True,
                         **NO_BUDGET)  # fmt: skip
    assert_same_tokens(out.sequences, expected, f"{model_type} assistant='mtp'")
    assert out.spec_stats.drafted_tokens > 0


@pytest.mark.parametrize("model_type", ["deepseek_v3", "mellum"])
def test_ragged_batch_of_4_equals_each_row_alone(mtp_model, model_type):
    model = mtp_model(model_type)
    ids, mask = left_pad(PROMPTS)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, assistant="mtp", **NO_BUDGET)
    for i, prompt in enumerate(PROMPTS):
        alone = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
        assert_same_tokens(out[i : i + 1, -12:], alone[:, -12:], f"{model_type} row {i}")


def test_two_mtp_layers_load_and_layer_0_drafts(mtp_model):
    """A model shipping 2 MTP layers: transformers chains both, hf_specdec drafts trees with layer 0."""
    model = mtp_model("deepseek_v3", 2)
    ids = torch.tensor([PROMPTS[2]])
    expected = model.generate(ids, max_new_tokens=16, do_sample=False)
    assert_same_tokens(model.generate(ids, max_new_tokens=16, do_sample=False, use_mtp=True), expected, "use_mtp")
    assistant = MTPAssistant(MTPHead.from_model(model), top_k=4, depth=4, num_nodes=12)
    assert len(assistant.head.mtp.layers) == 2
    out = model.generate(ids, max_new_tokens=16, do_sample=False, assistant=assistant, **NO_BUDGET)
    assert_same_tokens(out, expected, "assistant=MTPAssistant")


@pytest.mark.parametrize("model_type", ["deepseek_v3", "mellum"])
def test_the_head_layer_computes_what_transformers_forward_layer_computes(mtp_model, model_type):
    """Teacher-forced over a prompt: `MTPHead.layer_forward` over the draft cache's layout equals transformers'
    `MtpModel.forward_layer` over its `MtpCache` (same positions, norms, mask, rotary embedding)."""
    model = mtp_model(model_type)
    head = MTPHead.from_model(model)
    ids = torch.tensor([PROMPTS[0]])
    t = ids.shape[1] - 1
    pos = torch.arange(t)[None]  # [1, t] the features' positions
    with torch.no_grad():
        feats = model(ids, output_hidden_states=True).hidden_states[-1][:, :t]  # [1, t, H]
        cache = MtpCache(config=model.config.get_mtp_config())
        theirs = head.mtp.forward_layer(0, feats, pos + 1, cache, input_ids=ids[:, 1:])
        empty = head.new_cache(1)
        causal = torch.ones(t, t, dtype=torch.bool).tril()[None]  # [1, t, t]
        ours, key, _ = head.layer_forward(ids[:, 1:], feats, pos, causal, empty.key[:, :, :0], empty.value[:, :, :0])
    torch.testing.assert_close(ours, theirs)
    assert key.shape[2] == t


class FirstTree(MTPAssistant):
    """Keeps the first tree it proposes (row 0's, after prefill)."""

    first = None

    def propose(self, rows):
        trees = super().propose(rows)
        self.first = self.first or (trees[0] if trees[0].tokens.numel() else None)
        return trees


@pytest.mark.parametrize("model_type", ["deepseek_v3", "mellum"])
def test_the_first_tree_is_the_top_k_of_transformers_mtp_draft(mtp_model, model_type):
    """The loop's wiring (the features and tokens the head's cache receives after prefill, the root's position)
    gives the root's children transformers' `MtpModel.forward` ranks first after the same prompt."""
    model = mtp_model(model_type)
    assistant = FirstTree(MTPHead.from_model(model), top_k=3, depth=1, num_nodes=3)
    ids = torch.tensor([PROMPTS[0]])
    t = ids.shape[1]
    root = model.generate(ids, max_new_tokens=4, do_sample=False, assistant=assistant, **NO_BUDGET)[:, t : t + 1]
    with torch.no_grad():
        feats = model(ids, output_hidden_states=True).hidden_states[-1]  # [1, t, H]
        _, logits, _ = assistant.head.mtp(
            input_ids=torch.cat([ids[:, 1:], root], 1), last_hidden_states=feats, attention_mask=None,
            position_ids=torch.arange(1, t + 1)[None], mtp_cache=MtpCache(config=model.config.get_mtp_config()),
        )  # fmt: skip
    assert assistant.first.tokens.tolist() == logits[0, -1].topk(3).indices.tolist()


# --------------------------------------------------------------------------------------------- exact sampling
SAMPLED = ("deepseek_v3", "mellum")
# the packed verify forwards of these MoE / MLA models cost far more per row than a tiny Llama's on the CPU, so
# fewer rows than the EAGLE check: a wrong verifier still gives p < 1e-60 at 300 rows
ROWS = 300


def sampling_assistant(model) -> MTPAssistant:
    return MTPAssistant(MTPHead.from_model(model), top_k=SAMPLING_VOCAB // 2, depth=3, num_nodes=10)


def sampling_model(mtp_model, model_type: str):
    model = mtp_model(model_type, 1, SAMPLING_VOCAB)
    model.generation_config.eos_token_id = 2  # the enumeration pads after EOS
    return model


@pytest.mark.parametrize("model_type", SAMPLED)
def test_sampling_with_mtp_trees_matches_the_target_distribution(mtp_model, model_type):
    model = sampling_model(mtp_model, model_type)
    counts = sample_first_tokens(model, sampling_assistant(model), ROWS, **NO_BUDGET)
    ps = first_tokens_p_values(counts, model)
    assert min(ps) > 1e-4, f"{model_type}: chi-square p-values of the first 1, 2, 3 tokens: {ps}"


def test_a_wrong_verifier_is_caught_with_these_trees(mtp_model):
    """The harness has power: verifying the MTP trees greedily while sampling must be rejected."""
    model = sampling_model(mtp_model, SAMPLED[0])
    with greedy_verification():
        counts = sample_first_tokens(model, sampling_assistant(model), ROWS // 2, check_power=False, **NO_BUDGET)
    ps = first_tokens_p_values(counts, model)
    assert min(ps) < 1e-6, f"greedy verification of a sampled call was not caught: p-values {ps}"


# --------------------------------------------------------------------------------------------- refusals
IDS = torch.tensor([[5, 6, 7, 8]])


def test_a_model_without_mtp_layers_is_refused_by_name():
    with pytest.raises(NoMTPLayersError, match=r"LlamaForCausalLM \(model_type 'llama'\) ships no multi-token"):
        tiny_causal_lm("llama").generate(IDS, max_new_tokens=4, assistant="mtp")
    unsaved = AutoModelForCausalLM.from_config(_mtp_config("deepseek_v3", 1, None)).eval()
    with pytest.raises(NoMTPLayersError, match=r"'deepseek_v3'\) declares 1 MTP layer.*not loaded from a checkpoint"):
        unsaved.generate(IDS, max_new_tokens=4, assistant="mtp")


def test_mtp_layers_with_a_convolution_state_are_refused_by_name(tmp_path):
    model = saved_with_mtp("inkling_text", tmp_path)
    with pytest.raises(UnsupportedModelError, match=rf"InklingForCausalLM .* {REFUSED['inkling_text']}"):
        model.generate(IDS, max_new_tokens=4, assistant="mtp")


def test_use_mtp_beside_an_assistant_is_an_error(mtp_model):
    model = mtp_model("deepseek_v3")
    for assistant in ("mtp", NgramAssistant()):
        with pytest.raises(ValueError, match=r"use_mtp=True .* cannot be combined with assistant="):
            model.generate(IDS, max_new_tokens=4, use_mtp=True, assistant=assistant)
    model.generation_config.use_mtp = True  # the model's own default counts too
    try:
        with pytest.raises(ValueError, match=r"cannot be combined with assistant="):
            model.generate(IDS, max_new_tokens=4, assistant="mtp")
    finally:
        model.generation_config.use_mtp = False


def test_resolution_and_a_head_of_another_model(mtp_model):
    model, other = mtp_model("deepseek_v3"), mtp_model("deepseek_v3", 2)
    proposer = as_proposer("mtp", model)
    assert isinstance(proposer, MTPAssistant) and proposer.hidden_state_layers == (-1,)
    assert as_proposer("mtp", model).head is proposer.head  # read from the checkpoint once per model
    assert isinstance(as_proposer(proposer.head, model), MTPAssistant)
    stack = MtpModel.from_pretrained(model)  # transformers' own object drafts too
    expected = model.generate(IDS, max_new_tokens=8, do_sample=False)
    assert_same_tokens(model.generate(IDS, max_new_tokens=8, do_sample=False, assistant=stack), expected, "MtpModel")
    with pytest.raises(ValueError, match=r"MTP layers of another deepseek_v3 model object"):
        other.generate(IDS, max_new_tokens=4, assistant=proposer.head)
