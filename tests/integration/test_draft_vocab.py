"""A draft model over a draft vocabulary (`DraftModelAssistant(draft_vocab=...)`): it proposes only those ids (and
the call's prompt tokens), greedy output stays vanilla's, sampling keeps the target's distribution (also where its
trees are cut to fewer nodes than it drew), and a draft whose logits are not its last hidden state through its
lm_head falls back to its whole vocabulary."""

from __future__ import annotations

import pytest
import torch

from hf_specdec import DraftModelAssistant
from hf_specdec.generation.budget import PROPOSING_COST_ENV
from hf_specdec.models import draft_model_from_layers
from hf_specdec.testing import (
    SAMPLING_VOCAB,
    assert_same_tokens,
    first_tokens_p_values,
    greedy_verification,
    left_pad,
    sample_first_tokens,
    sampling_target,
    tiny_causal_lm,
)

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 5, 6, 7], [3, 4, 5], [9, 9, 8, 7, 6, 5, 4]]


@pytest.fixture(autouse=True)
def every_level(monkeypatch):
    """Draft every level (the draft's cost is not planned for): the test sees drafts on every step."""
    monkeypatch.setenv(PROPOSING_COST_ENV, "0")


class Recording(DraftModelAssistant):
    """Keeps every token it proposed."""

    def propose(self, rows):
        trees = super().propose(rows)
        self.proposed.extend(t for tree in trees for t in tree.tokens.tolist())
        return trees


def recording(draft, vocab, **kwargs) -> Recording:
    assistant = Recording(draft, draft_vocab=vocab, **kwargs)
    assistant.proposed = []
    return assistant


@pytest.mark.parametrize("arch", ["llama", "gemma2"])  # gemma2: a soft-capped lm_head
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_output_is_vanilla_and_drafts_stay_in_the_draft_vocabulary(arch, batch):
    model = tiny_causal_lm(arch, num_layers=4)
    draft = draft_model_from_layers(model, 2)
    ids, mask = left_pad(PROMPTS[:batch])  # [batch, P]
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
    said = set(expected[:, ids.shape[1] :].flatten().tolist())
    vocab = sorted(set(range(0, model.config.vocab_size, 2)) | said)  # the even ids and what vanilla says
    assistant = recording(draft, vocab, depth=3, top_k=2, num_nodes=6)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, assistant=assistant,
                         return_dict_in_generate=True)  # fmt: skip
    assert_same_tokens(out.sequences, expected, f"{arch} batch={batch}")
    # the tokens the rows held at the first draft forward: the prompts (and padding), then the first new token
    allowed = set(vocab) | set(expected[:, : ids.shape[1] + 1].flatten().tolist())
    assert set(assistant.head.ids.tolist()) == allowed, "the draft vocabulary is the ids given plus the prompts'"
    assert assistant.proposed and set(assistant.proposed) <= allowed
    assert out.spec_stats.accepted_tokens > 0, "a 2-of-4-layer draft of the model agrees sometimes"


@pytest.mark.parametrize("vocab", [None, range(0, SAMPLING_VOCAB, 2)])
def test_sampled_trees_cut_to_fewer_nodes_than_drawn_keep_the_target_distribution(vocab):
    """3 children per node and 9 of the 12 drawn nodes kept: the cut is by structure, not by the draws' own
    probabilities (kept by probability, the 3-token joint was off at p = 1e-7). Over a draft vocabulary (the even
    ids and the prompt's), q is zero where p is not."""
    model = sampling_target()
    draft = draft_model_from_layers(model, 1)
    assistant = DraftModelAssistant(draft, depth=3, top_k=3, num_nodes=9, draft_vocab=vocab)
    counts = sample_first_tokens(model, assistant, 3000, tree_budget=False)
    ps = first_tokens_p_values(counts, model)
    assert min(ps) > 1e-4, f"chi-square p-values of the first 1, 2, 3 tokens: {ps}"
    with greedy_verification():  # the negative control: the harness has power with these trees
        counts = sample_first_tokens(model, assistant, 1000, check_power=False, tree_budget=False)
    assert min(first_tokens_p_values(counts, model)) < 1e-6


def test_a_draft_whose_logits_are_not_its_lm_head_of_its_last_state_drafts_its_whole_vocabulary():
    model = tiny_causal_lm("llama", num_layers=4)
    draft = draft_model_from_layers(model, 2)
    draft.config.final_logit_softcapping = 0.5  # the head would soft-cap; the llama model does not
    ids = torch.tensor([PROMPTS[0]])
    expected = model.generate(ids, max_new_tokens=16, do_sample=False)
    assistant = recording(draft, [1, 2, 3])
    with pytest.warns(UserWarning, match="draft vocabulary is not used"):
        out = model.generate(ids, max_new_tokens=16, do_sample=False, assistant=assistant)
    assert_same_tokens(out, expected, "fallback")
    assert assistant.head is None and assistant.draft_vocab is None


@pytest.mark.parametrize(
    "vocab, message",
    [([], "draft_vocab is empty"), ([0, 500], "outside the vocabulary"), ([-1, 3], "outside the vocabulary")],
)
def test_a_bad_draft_vocabulary_is_refused_by_name(vocab, message):
    model = tiny_causal_lm("llama")
    ids = torch.tensor([PROMPTS[1]])
    with pytest.raises(ValueError, match=message):
        model.generate(ids, max_new_tokens=4, assistant=DraftModelAssistant(tiny_causal_lm("llama", seed=2),
                                                                             draft_vocab=vocab))  # fmt: skip
