"""A layer-skip draft (`draft_model_from_layers`) reads its layers' keys and values from the target's cache (issue
68, LayerSkip's self-speculation): it keeps no cache of its own, feeds each step's root alone, drafts the trees it
would draft over its own cache, and greedy output stays vanilla's. A draft whose weights changed since, a draft of
another model and a hybrid target (whose convolution or recurrent states are not per layer) keep their own cache.
Sampling over the target's cache is checked by the chi-square tests of ``test_draft_vocab.py``, whose drafts are
layer-skip drafts."""

from __future__ import annotations

import pytest
import torch

import hf_specdec.generation.proposers.draft_model as draft_model_module
from hf_specdec import DraftModelAssistant
from hf_specdec.generation.budget import PROPOSING_COST_ENV
from hf_specdec.generation.cost_model import proposing_cost_for
from hf_specdec.models import draft_model_from_layers, is_first_layers_of
from hf_specdec.testing import assert_same_tokens, left_pad, tiny_causal_lm

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 5, 6, 7], [3, 4, 5], [9, 9, 8, 7, 6, 5, 4]]


class Watched(DraftModelAssistant):
    """Records, per step, whether it drafted over the target's cache, and the tokens of each draft forward."""

    def start(self, setup):
        super().start(setup)
        self.over_target_cache, self.forward_tokens = [], []

    def propose(self, rows):
        trees = super().propose(rows)
        self.over_target_cache.append(self.shared is not None)
        return trees

    def _forward(self, tokens, *args):
        self.forward_tokens.append(int(tokens.numel()))
        return super()._forward(tokens, *args)


def drafted(model, draft, ids, mask=None, **kwargs):
    assistant = Watched(draft, depth=3, top_k=2, num_nodes=6)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, assistant=assistant,
                         tree_budget=False, return_dict_in_generate=True, **kwargs)  # fmt: skip
    return out, assistant


def test_a_draft_is_the_first_layers_of_its_target_until_weights_change():
    target = tiny_causal_lm("llama", num_layers=3)
    draft = draft_model_from_layers(target, 2)
    assert is_first_layers_of(draft, target)
    assert not is_first_layers_of(draft, tiny_causal_lm("llama", num_layers=3))
    assert not is_first_layers_of(tiny_causal_lm("llama", num_layers=2), target)
    with torch.no_grad():
        draft.model.layers[1].mlp.up_proj.weight.mul_(1.0)  # an in-place change, even one that keeps the values
    assert not is_first_layers_of(draft, target)
    draft = draft_model_from_layers(target, 2)
    with torch.no_grad():
        target.model.norm.weight.add_(0.5)  # the target changed
    assert not is_first_layers_of(draft, target)
    draft = draft_model_from_layers(target, 2).to(torch.bfloat16)
    assert not is_first_layers_of(draft, target)


@pytest.mark.parametrize("arch", ["llama", "gemma2", "mistral"])  # gemma2, mistral: sliding-window layers
@pytest.mark.parametrize("batch", [1, 3])
def test_a_layer_skip_draft_drafts_over_the_target_cache_as_over_its_own(arch, batch, monkeypatch):
    monkeypatch.setenv(PROPOSING_COST_ENV, "0")  # every step drafts every level
    target = (
        tiny_causal_lm(arch, num_layers=4, sliding_window=6) if arch != "llama" else tiny_causal_lm(arch, num_layers=4)
    )
    draft = draft_model_from_layers(target, 2)
    ids, mask = left_pad(PROMPTS[:batch])
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
    shared, over_target = drafted(target, draft, ids, mask)
    assert_same_tokens(shared.sequences, expected, f"{arch} batch={batch}, over the target's cache")
    assert all(over_target.over_target_cache) and over_target.over_target_cache
    assert over_target.forward_tokens[0] == batch, "level 0 feeds each row's root alone, not its prompt"
    monkeypatch.setattr(draft_model_module, "is_first_layers_of", lambda draft, model: False)
    own, over_own = drafted(target, draft, ids, mask)
    assert_same_tokens(own.sequences, expected, f"{arch} batch={batch}, over its own cache")
    assert not any(over_own.over_target_cache)
    assert over_own.forward_tokens[0] == sum(len(p) + 1 for p in PROMPTS[:batch]), "its prompt and root"
    assert shared.spec_stats.accepted_tokens == own.spec_stats.accepted_tokens > 0
    assert shared.spec_stats.drafted_tokens == own.spec_stats.drafted_tokens


def test_a_paused_layer_skip_draft_resumes_with_its_root_alone(monkeypatch):
    """Off (a level costs 3 plain steps), it drafts on probes only; each probe feeds the root, never the tokens
    committed while it was off, and its guesses match what the model says."""
    target = tiny_causal_lm("llama", num_layers=4)
    draft = draft_model_from_layers(target, 4)  # every layer: its guess is the target's
    ids = torch.tensor([PROMPTS[0]])
    expected = target.generate(ids, max_new_tokens=40, do_sample=False)
    proposing_cost_for(target, draft, "target_cache").record_level(3.0)
    assistant = Watched(draft, depth=3)
    out = target.generate(ids, max_new_tokens=40, do_sample=False, assistant=assistant, return_dict_in_generate=True)
    assert_same_tokens(out.sequences, expected, "paused layer-skip draft")
    stats = out.spec_stats
    assert stats.budget["proposing"]["probes"] >= 1
    assert stats.drafted_tokens >= 1 and stats.accepted_tokens == stats.drafted_tokens
    assert assistant.forward_tokens and set(assistant.forward_tokens) == {1}, "every draft forward is one token"


@pytest.mark.parametrize("arch", ["lfm2", "jamba"])
def test_a_hybrid_target_keeps_the_draft_on_its_own_cache(arch, monkeypatch):
    monkeypatch.setenv(PROPOSING_COST_ENV, "0")
    target = tiny_causal_lm(arch, num_layers=4)
    draft = draft_model_from_layers(target, 2)
    ids = torch.tensor([PROMPTS[0]])
    expected = target.generate(ids, max_new_tokens=24, do_sample=False)
    out, assistant = drafted(target, draft, ids)
    assert_same_tokens(out.sequences, expected, arch)
    assert assistant.over_target_cache and not any(assistant.over_target_cache)
