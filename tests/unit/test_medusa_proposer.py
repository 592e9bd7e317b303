"""MedusaAssistant: the static tree it builds from known head logits, the optimal-tree DP against brute force, and
lossless greedy generation through `model.generate(..., assistant=MedusaHeads(...))`."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

import hf_specdec
from hf_specdec.generation.proposers import as_proposer
from hf_specdec.generation.proposers.base import ProposerSetup, RowFeedback, RowState
from hf_specdec.generation.proposers.medusa import (
    DEFAULT_NUM_NODES,
    MedusaAssistant,
    StaticTreeTemplate,
    default_tree_choices,
    medusa_assistant_for,
)
from hf_specdec.generation.tree import DraftSampling, DraftTree
from hf_specdec.generation.tree_shapes import expected_accepted_tokens, optimal_tree_choices
from hf_specdec.heads.medusa import MedusaHeads
from hf_specdec.testing import random_medusa_heads, tiny_causal_lm

H, V = 32, 97


def assert_same_tree(got: DraftTree, want: DraftTree) -> None:
    assert got.num_nodes == want.num_nodes, f"{got.num_nodes} nodes, expected {want.num_nodes}"
    for name in ("tokens", "parent", "depth"):
        a, b = getattr(got, name).tolist(), getattr(want, name).tolist()
        assert a == b, f"{name} differ first at node {next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)}"


# ---------------------------------------------------------------------------------------------- optimal trees
def brute_force_best(acceptance, num_nodes):
    """Max expected accepted tokens over every prefix-closed set of at most num_nodes paths."""
    paths = [
        p for d in range(1, len(acceptance) + 1) for p in itertools.product(*[range(len(r)) for r in acceptance[:d]])
    ]
    best = 0.0
    for size in range(num_nodes + 1):
        for subset in itertools.combinations(paths, size):
            chosen = set(subset)
            if all(p[:-1] in chosen for p in chosen if len(p) > 1):
                best = max(best, expected_accepted_tokens(chosen, acceptance))
    return best


def is_valid_choices(choices, acceptance, num_nodes):
    chosen = {tuple(c) for c in choices}
    return (
        len(chosen) == len(choices) <= num_nodes
        and all(c[:-1] in chosen for c in chosen if len(c) > 1)
        and all(len(c) <= len(acceptance) and all(k < len(acceptance[d]) for d, k in enumerate(c)) for c in chosen)
    )


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("shape", [(2, 3), (3, 2)])
def test_optimal_tree_matches_brute_force(seed, shape):
    depth, ranks = shape
    rng = random.Random(seed)
    acceptance = []
    for _ in range(depth):
        raw = [rng.random() for _ in range(ranks)]
        if seed % 2:  # also non-monotone rows: the DP must not assume rank order
            acceptance.append([x / (sum(raw) * 1.05) for x in raw])
        else:
            acceptance.append(sorted((x / (sum(raw) * 1.05) for x in raw), reverse=True))
    for n in range(0, 6):
        choices = optimal_tree_choices(acceptance, n)
        assert is_valid_choices(choices, acceptance, n), choices
        got = expected_accepted_tokens(choices, acceptance)
        assert got == pytest.approx(brute_force_best(acceptance, n), abs=1e-12), (n, choices)


def test_optimal_tree_of_a_single_rank_is_a_chain():
    assert optimal_tree_choices([[0.9], [0.8], [0.7]], 5) == [[0], [0, 0], [0, 0, 0]]
    assert optimal_tree_choices([[0.9], [0.8], [0.7]], 2) == [[0], [0, 0]]


def test_optimal_tree_skips_zero_probability_guesses():
    assert optimal_tree_choices([[0.5, 0.0, 0.2]], 3) == [[0], [2]]


def test_optimal_tree_value_grows_with_the_budget():
    acceptance = [[0.6, 0.2, 0.1], [0.5, 0.2], [0.4]]
    values = [expected_accepted_tokens(optimal_tree_choices(acceptance, n), acceptance) for n in range(12)]
    assert all(b >= a for a, b in zip(values, values[1:]))


def test_optimal_tree_rejects_non_probabilities():
    with pytest.raises(ValueError, match=r"acceptance\[0\]\[1\] = 1.5"):
        optimal_tree_choices([[0.5, 1.5]], 3)


def test_default_tree_is_small_prefix_closed_and_as_deep_as_the_heads():
    for heads in (1, 2, 3, 4, 5):
        choices = default_tree_choices(heads)
        assert len(choices) == (DEFAULT_NUM_NODES if heads > 1 else 8)  # one head: its 8 ranks of the prior
        assert max(len(c) for c in choices) == heads
        assert all(tuple(c[:-1]) in {tuple(x) for x in choices} for c in choices if len(c) > 1)


# ---------------------------------------------------------------------------------------------- tree template
def test_template_gather_equals_from_choices():
    g = torch.Generator().manual_seed(0)
    choices = default_tree_choices(4, 24) + [[7]]
    template = StaticTreeTemplate(choices, num_heads=4)
    for _ in range(5):
        topk = torch.stack([torch.randperm(V, generator=g)[: template.k] for _ in range(template.depth)])  # [D, K]
        codes, parent, depth, anc = template.cut(10, torch.device("cpu"))
        got = DraftTree(topk.reshape(-1)[codes], parent, depth, _ancestors=anc)
        want = DraftTree.from_choices(choices, topk)
        assert_same_tree(got, want)
        assert torch.equal(anc, want.ancestor_mask())


def test_choices_deeper_than_the_heads_are_refused():
    heads = MedusaHeads(hidden_size=H, num_heads=2, vocab_size=V)
    with pytest.raises(ValueError, match=r"\[0, 0, 0\] is 3 deep but the Medusa heads have 2 heads"):
        MedusaAssistant(heads, tree_choices=[[0], [0, 0], [0, 0, 0]])


# ---------------------------------------------------------------------------------------------- proposer
def heads_with_known_logits(scores: torch.Tensor, token_map=None) -> MedusaHeads:
    """Heads whose logits for hidden state ``s * e_j`` are ``s * scores[:, j]`` (identity ResBlocks, one-hot lm)."""
    num_heads, vocab, _ = scores.shape
    heads = MedusaHeads(
        hidden_size=H,
        num_heads=num_heads,
        vocab_size=V,
        share_lm_head=False,
        block_bias=False,
        draft_vocab_size=None if token_map is None else vocab,
    )
    with torch.no_grad():
        heads.lm_head_weight.zero_()
        heads.lm_head_weight[:, :, : scores.shape[2]] = scores  # column j = logits when the hidden state is e_j
        if token_map is not None:
            heads.token_map.copy_(token_map)
    return heads


def prefilled(tokens, hidden: torch.Tensor) -> RowFeedback:
    """Feedback after prefill of ``tokens`` with final hidden states ``hidden`` `[m, H]`."""
    return RowFeedback(torch.as_tensor(tokens), torch.zeros(0, dtype=torch.long), 0, None, {-1: hidden})


def start(proposer, model):
    proposer.validate(model)
    proposer.start(ProposerSetup(target=model, generation_config=model.generation_config))


def test_proposer_builds_the_static_tree_from_each_rows_last_hidden_state():
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(3, V, 2, generator=g)  # [heads, V, 2]: two possible hidden states
    heads = heads_with_known_logits(scores)
    choices = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
    proposer = MedusaAssistant(heads, tree_choices=choices)
    assert proposer.sampling == DraftSampling.DETERMINISTIC and proposer.hidden_state_layers == (-1,)
    model = tiny_causal_lm("llama", hidden_size=H)
    start(proposer, model)
    e = torch.eye(H)
    rows = [
        RowState(row=0, tokens=torch.tensor([1, 5, 9]), prompt_len=2, max_depth=10),
        RowState(row=3, tokens=torch.tensor([1, 6]), prompt_len=1, max_depth=10),
    ]
    # row 0's last token entered with hidden e_0, row 3's with e_1; earlier hidden states must not matter
    proposer.observe(rows, [prefilled([1, 5], torch.stack([e[1], e[1], e[0]])), prefilled([1], e[1:2])])
    trees = proposer.propose(rows)
    for tree, j in zip(trees, (0, 1)):
        topk = scores[:, :, j].topk(3, dim=-1).indices  # head d ranks feed depth d + 1
        assert_same_tree(tree, DraftTree.from_choices(choices, topk))
        assert tree.sampling == DraftSampling.DETERMINISTIC


def test_proposer_cuts_the_tree_to_each_rows_budget():
    scores = torch.randn(3, V, 1, generator=torch.Generator().manual_seed(1))
    proposer = MedusaAssistant(heads_with_known_logits(scores), tree_choices=[[0], [1], [0, 0], [0, 0, 0]])
    start(proposer, tiny_causal_lm("llama", hidden_size=H))
    rows = [RowState(row=b, tokens=torch.tensor([1, 2]), prompt_len=1, max_depth=d) for b, d in enumerate((0, 1, 2))]
    proposer.observe(rows, [prefilled([1], torch.eye(H)[:1])] * 3)
    sizes = [t.num_nodes for t in proposer.propose(rows)]
    depths = [t.max_depth for t in proposer.propose(rows)]
    assert sizes == [0, 2, 3] and depths == [0, 1, 2]


def test_proposer_maps_a_truncated_vocabulary_to_token_ids():
    token_map = torch.arange(10) * 9 + 4  # draft index i -> token 9 i + 4
    scores = torch.randn(2, 10, 1, generator=torch.Generator().manual_seed(2))
    proposer = MedusaAssistant(heads_with_known_logits(scores, token_map), tree_choices=[[0], [1], [0, 0]])
    start(proposer, tiny_causal_lm("llama", hidden_size=H))
    row = RowState(row=0, tokens=torch.tensor([1, 2]), prompt_len=1, max_depth=5)
    proposer.observe([row], [prefilled([1], torch.eye(H)[:1])])
    tree = proposer.propose([row])[0]
    topk = token_map[scores[:, :, 0].topk(2, dim=-1).indices]
    assert_same_tree(tree, DraftTree.from_choices([[0], [1], [0, 0]], topk))


def test_assistant_resolution_for_medusa_heads():
    model = tiny_causal_lm("llama", hidden_size=H)
    heads = MedusaHeads.for_model(model, num_heads=2)
    assert isinstance(medusa_assistant_for(heads, model), MedusaAssistant)
    assert medusa_assistant_for(object(), model) is None
    assert isinstance(as_proposer(heads, model), MedusaAssistant)
    assert MedusaAssistant(heads, tree_choices=[[0], [0, 0]]).tree_choices == [[0], [0, 0]]
    with pytest.raises(ValueError, match="hidden size 32 cannot serve a model with hidden size 64"):
        MedusaAssistant(heads).validate(tiny_causal_lm("llama"))


# ---------------------------------------------------------------------------------------------- generate()
def first_difference(a: torch.Tensor, b: torch.Tensor) -> str:
    for r in range(a.shape[0]):
        diff = (a[r] != b[r]).nonzero()
        if diff.numel():
            i = int(diff[0])
            return f"row {r}, position {i}: {int(a[r, i])} vs {int(b[r, i])}"
    return "shapes differ"


@pytest.mark.parametrize("share_lm_head", [True, False])
def test_greedy_generate_with_random_heads_equals_vanilla_batch_1(share_lm_head):
    model = tiny_causal_lm("llama")
    heads = random_medusa_heads(model, share_lm_head)
    ids = torch.tensor([[1, 17, 33, 8, 61, 5]])
    want = model.generate(ids, max_new_tokens=24, do_sample=False)
    got = model.generate(ids, max_new_tokens=24, do_sample=False, assistant=heads)
    assert torch.equal(got, want), first_difference(got, want)


def test_greedy_generate_with_random_heads_equals_vanilla_batch_4_left_padded():
    model = tiny_causal_lm("llama")
    heads = random_medusa_heads(model, seed=1)
    prompts = [[1, 17, 33, 8], [1, 5], [1, 90, 91, 92, 93, 40], [1, 64, 3]]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    want = model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    got = model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, assistant=heads)
    assert torch.equal(got, want), first_difference(got, want)


@pytest.mark.parametrize("arch", ["qwen3", "mistral", "gemma"])
def test_greedy_generate_with_random_heads_equals_vanilla_on_other_architectures(arch):
    model = tiny_causal_lm(arch)
    heads = random_medusa_heads(model, seed=2)
    ids = torch.tensor([[0, 0, 1, 17, 33], [1, 5, 9, 12, 60]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    want = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    got = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, assistant=heads)
    assert torch.equal(got, want), first_difference(got, want)


def permutation_model(num_layers=2):
    """A tiny Llama whose greedy next token is f(current token), f(t) = 5 t + 3 mod 97: attention and MLP outputs
    are zeroed, embeddings are one-hot, the lm_head maps e_t to f(t). Its final hidden state at token t is
    proportional to e_t, so heads that map e_t to f^(i+2)(t) are perfect Medusa heads."""
    model = tiny_causal_lm("llama", hidden_size=128, num_layers=num_layers)
    f = [(5 * t + 3) % V for t in range(V)]
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.zero_()
        model.model.embed_tokens.weight[torch.arange(V), torch.arange(V)] = 1.0
        model.lm_head.weight.zero_()
        model.lm_head.weight[torch.tensor(f), torch.arange(V)] = 1.0
    return model, f


def test_perfect_heads_are_fully_accepted():
    """Pins the alignment: head 0 on the hidden state that produced the root guesses the token after the root."""
    model, f = permutation_model()
    heads = MedusaHeads.for_model(model, num_heads=3, share_lm_head=False)
    with torch.no_grad():
        heads.block_bias.zero_()
        heads.lm_head_weight.zero_()
        for i in range(3):
            target = torch.arange(V)
            for _ in range(i + 2):
                target = torch.tensor([f[t] for t in target.tolist()])
            heads.lm_head_weight[i, target, torch.arange(V)] = 1.0
    ids = torch.tensor([[1, 7]])
    want = model.generate(ids, max_new_tokens=17, do_sample=False)
    out = model.generate(
        ids,
        max_new_tokens=17,
        do_sample=False,
        assistant=MedusaAssistant(heads, tree_choices=[[0], [1], [0, 0], [0, 0, 0]]),
        return_dict_in_generate=True,
    )
    assert torch.equal(out.sequences, want), first_difference(out.sequences, want)
    stats = out.spec_stats
    # 1 token from the prefill, then 4 per step (3 accepted + 1 bonus): 16 tokens in 4 steps
    assert stats.steps == 4 and stats.accepted_tokens == 12 and stats.tau == 4.0


def test_sampling_with_medusa_heads_runs_and_is_reproducible():
    model = tiny_causal_lm("llama")
    heads = random_medusa_heads(model)
    ids = torch.tensor([[1, 17, 33, 8]])
    outs = []
    for _ in range(2):
        torch.manual_seed(0)
        outs.append(model.generate(ids, max_new_tokens=12, do_sample=True, top_k=20, assistant=heads))
    assert outs[0].shape == (1, 16) and torch.equal(outs[0], outs[1])


def test_medusa_heads_are_exposed_at_package_level():
    assert hf_specdec.MedusaHeads is MedusaHeads


# ----------------------------------------------------------------------------------------- tuned trees and costs
def test_tuned_costs_are_the_budgets_prior_and_tuned_choices_are_verified_as_given():
    model = tiny_causal_lm("llama")
    heads = random_medusa_heads(model, seed=3)
    assert MedusaAssistant(heads).prior_cost is None  # untuned heads: the budget starts from its generic prior
    heads.tree_choices = [[0], [1], [0, 0], [0, 0, 0]]
    heads.model_card = {"tree": {"step_cost": {"1": 1.1, "2": 1.2, "3": 1.3, "4": 1.4}, "depth_acceptance": [0.9, 0.9]}}
    default = MedusaAssistant(heads)  # the candidate tree, whatever the heads were tuned to: the budget sizes it
    assert default.template.num_nodes == len(default_tree_choices(heads.num_heads)) and default.prior_cost(5) == 1.4
    assistant = MedusaAssistant(heads, tree_choices=heads.tree_choices)
    assert assistant.tree_choices == heads.tree_choices
    prompts = [[1, 17, 33, 8], [1, 5], [1, 90, 91, 92, 93, 40], [1, 64, 3]]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    want = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
    out = model.generate(
        ids, attention_mask=mask, max_new_tokens=24, do_sample=False, assistant=assistant, return_dict_in_generate=True
    )
    assert torch.equal(out.sequences, want), first_difference(out.sequences, want)
