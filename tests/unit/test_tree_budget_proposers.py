"""How each assistant feeds the tree budget: scored candidate trees, verified-node feedback, choosing between two
assistants' trees (no target model forward)."""

from __future__ import annotations

import torch

from hf_specdec import FallbackAssistant, NgramAssistant
from hf_specdec.generation.budget import TreeBudgeter
from hf_specdec.generation.cost_model import StepCostModel
from hf_specdec.generation.proposers.base import Proposer, ProposerSetup, RowFeedback, RowState
from hf_specdec.generation.proposers.medusa import DEFAULT_NUM_NODES, MedusaAssistant
from hf_specdec.generation.tree import DraftTree
from hf_specdec.testing import random_medusa_heads, tiny_causal_lm


def cpu_like_cost() -> StepCostModel:
    cost = StepCostModel()
    for n in range(1, 80):
        for _ in range(3):
            cost.record_verify(n, 1, 0.02 * (1 + 0.1 * (n - 1)))
    return cost


def setup_for(model, budget: TreeBudgeter) -> ProposerSetup:
    return ProposerSetup(target=model, generation_config=model.generation_config, budget=budget)


def state(tokens, row: int = 0, max_depth: int = 50) -> RowState:
    tokens = torch.as_tensor(tokens, dtype=torch.long)
    return RowState(row=row, tokens=tokens, prompt_len=len(tokens), max_depth=max_depth)


def assert_path_probabilities(tree: DraftTree) -> None:
    assert tree.scores is not None and tree.scores.shape == (tree.num_nodes,)
    scores, parents = tree.scores.tolist(), tree.parent.tolist()
    assert all(0.0 < s <= 1.0 for s in scores), scores
    assert all(p < 0 or scores[i] <= scores[p] + 1e-6 for i, p in enumerate(parents)), "a child outscores its parent"


def test_ngram_proposes_the_same_scored_candidates_whether_or_not_the_budget_cuts():
    # three earlier continuations of the suffix [7, 8, 9]: a trie with weak siblings
    tokens = [1, 7, 8, 9, 20, 21, 22, 2, 7, 8, 9, 30, 31, 32, 3, 7, 8, 9, 40, 41, 4, 7, 8, 9]
    trees = []
    for cuts in (True, False):
        ngram = NgramAssistant()
        ngram.start(setup_for(tiny_causal_lm("llama"), TreeBudgeter(cpu_like_cost(), cuts=cuts)))
        st = state(tokens)
        ngram.observe([st], [RowFeedback(st.tokens[:-1], torch.zeros(0, dtype=torch.long), int(st.tokens[-1]))])
        trees.append(ngram.propose([st])[0])
    cut, whole = trees
    assert cut.source == "ngram" and cut.num_nodes > 3
    assert_path_probabilities(cut)
    assert cut.tokens.tolist() == whole.tokens.tolist() and cut.parent.tolist() == whole.parent.tolist()
    assert min(cut.scores.tolist()) < 0.1  # weak siblings are candidates too: the budget decides


def test_ngram_does_not_count_levels_the_budget_cut_as_misses():
    text = [7, 8, 9, 10, 11, 12]
    tokens = [1, *text, 2, *text[:2]]

    def trials_after(verified) -> list[float]:
        ngram = NgramAssistant()
        ngram.start(None)
        st = state(tokens)
        ngram.observe([st], [RowFeedback(st.tokens[:-1], torch.zeros(0, dtype=torch.long), int(st.tokens[-1]))])
        tree = ngram.propose([st])[0]
        assert tree.num_nodes >= 3 and tree.parent.tolist()[:2] == [-1, 0], "a chain is expected here"
        accepted = torch.tensor([0])  # the first node accepted, the second (its child) rejected or not verified
        new = state([*tokens, int(tree.tokens[0]), 99])
        fb = RowFeedback(torch.tensor([tokens[-1], int(tree.tokens[0])]), accepted, 99, tree, None, verified)
        ngram.observe([new], [fb])
        return list(ngram._rows[0].acceptance.trials)

    all_verified = trials_after(None)
    only_first = trials_after(torch.tensor([0]))
    assert sum(all_verified) > sum(only_first), "the level below the cut must not count as a trial"


def test_medusa_proposes_scored_candidates():
    model = tiny_causal_lm("llama")
    heads = random_medusa_heads(model, num_heads=3)
    proposer = MedusaAssistant(heads)
    proposer.validate(model)
    proposer.start(setup_for(model, TreeBudgeter(cpu_like_cost())))
    st = state([1, 2, 3])
    hidden = torch.randn(2, model.config.hidden_size)
    proposer.observe([st], [RowFeedback(st.tokens[:-1], torch.zeros(0, dtype=torch.long), 3, None, {-1: hidden})])
    tree = proposer.propose([st])[0]
    assert tree.source == "medusa" and tree.num_nodes == proposer.template.num_nodes <= DEFAULT_NUM_NODES
    assert_path_probabilities(tree)
    # the same tokens when the budget does not cut, for the same choices
    plain = MedusaAssistant(heads, tree_choices=proposer.tree_choices)
    plain.validate(model)
    plain.start(setup_for(model, TreeBudgeter(cpu_like_cost(), cuts=False)))
    plain.observe([st], [RowFeedback(st.tokens[:-1], torch.zeros(0, dtype=torch.long), 3, None, {-1: hidden})])
    assert plain.propose([st])[0].tokens.tolist() == tree.tokens.tolist()


class FixedChain(Proposer):
    """Always the same scored chain."""

    def __init__(self, tokens, score: float, source: str):
        self.tokens, self.score, self.source = tokens, score, source

    def propose(self, rows):
        scores = torch.tensor([self.score ** (d + 1) for d in range(len(self.tokens))])
        return [DraftTree.chain(self.tokens, scores=scores, source=self.source) for _ in rows]


def test_fallback_takes_the_tree_that_predicts_more():
    model = tiny_causal_lm("llama")
    weak, strong = FixedChain([5, 6, 7], 0.05, "weak"), FixedChain([8, 9, 10], 0.9, "strong")
    fallback = FallbackAssistant(weak, strong)
    fallback.validate(model)
    for cuts in (True, False):  # the same choice whether or not the budget then cuts the tree
        fallback.start(setup_for(model, TreeBudgeter(cpu_like_cost(), cuts=cuts)))
        assert fallback.propose([state([1, 2])])[0].source == "strong"
    # a strong first tree is not second-guessed (the second assistant is not even asked)
    fallback = FallbackAssistant(strong, weak)
    fallback.validate(model)
    fallback.start(setup_for(model, TreeBudgeter(cpu_like_cost())))
    assert fallback.propose([state([1, 2])])[0].source == "strong"
    assert (1, 0) not in fallback._proposed
