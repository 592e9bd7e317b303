"""`FallbackAssistant`: per row, the first assistant with a draft; every assistant observes every step."""

import pytest
import torch

import hf_specdec
from hf_specdec import DraftTree, FallbackAssistant, NgramAssistant, Proposer
from hf_specdec.heads.medusa import MedusaHeads
from hf_specdec.testing import OracleProposer, assert_same_tokens, left_pad, random_medusa_heads, tiny_causal_lm

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 5, 6, 7], [3, 4, 5], [9, 9, 8, 7, 6, 5, 4], [12, 13, 12, 13, 12, 13, 12, 13, 12]]


class Recorder(Proposer):
    """Drafts a one-node chain for the rows ``when(row)`` allows; records what it was asked and shown."""

    def __init__(self, token: int, when=lambda row: True, layers=None):
        self.token, self.when = token, when
        self.hidden_state_layers = layers
        self.asked: list[list[int]] = []
        self.observed: list[tuple[list[int], list]] = []
        self.verdicts: list[list] = []
        self.finished = 0

    def propose(self, rows):
        self.asked.append([(r.row, r.max_depth) for r in rows])
        return [DraftTree.chain([self.token]) if self.when(r) and r.max_depth else DraftTree.empty() for r in rows]

    def observe(self, rows, feedback):
        self.observed.append(([int(fb.new_tokens.numel()) for fb in feedback], [fb.hidden_states for fb in feedback]))
        self.verdicts.append([(fb.tree, fb.accepted.tolist()) for fb in feedback])

    def finish(self):
        self.finished += 1


def test_each_row_drafts_with_the_first_assistant_that_has_a_draft():
    model = tiny_causal_lm("llama")
    first = Recorder(7, when=lambda r: r.row % 2 == 0)
    second = Recorder(8)
    # handoff 1.0: only a row without a tree asks the next assistant (every tree predicts at least a plain step's
    # speed), so which assistant is asked does not depend on the cost curve measured on a loaded machine
    fb = FallbackAssistant(first, second, handoff=1.0)
    ids, mask = left_pad(PROMPTS)
    # the trees as proposed (with the tree budget a weak first tree may also ask the second assistant)
    model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, assistant=fb, tree_budget=False)
    assert [row for row, _ in first.asked[0]] == [0, 1, 2, 3]  # the first assistant is asked for every row
    # the second only for the rows the first left without a draft: the odd ones, and any row with no budget left
    assert any(second.asked)
    assert all(row % 2 == 1 or depth == 0 for asked in second.asked for row, depth in asked), second.asked
    # both observe every step (prefill + each verification), and both are finished
    assert len(first.observed) == len(second.observed) > 1
    assert first.finished == second.finished == 1
    # each sees the verdict of its own trees only: a row it was not asked about has no tree and no accepted nodes
    for step in second.verdicts[1:]:
        for tree, accepted in step:
            assert accepted == [] or (tree is not None and tree.num_nodes)
    assert all(tree is None for tree, _ in first.verdicts[0])  # after prefill
    assert any(tree is not None and tree.num_nodes for step in first.verdicts[1:] for tree, _ in step)


def _started(fallback: FallbackAssistant) -> FallbackAssistant:
    """``fallback`` started as the loop starts it (its setup carries the call's tree budget), outside ``generate``."""
    from hf_specdec.generation.proposers.base import ProposerSetup

    fallback.start(ProposerSetup(target=None, generation_config=None))
    return fallback


def test_trees_come_from_the_right_assistant():
    first = Recorder(7, when=lambda r: r.row == 0)
    second = Recorder(8)
    fb = _started(FallbackAssistant(first, second))
    rows = [hf_specdec.RowState(row=i, tokens=torch.tensor([1, 2, 3]), prompt_len=2, max_depth=4) for i in range(3)]
    trees = fb.propose(rows)
    assert [t.tokens.tolist() for t in trees] == [[7], [8], [8]]
    assert second.asked == [[(1, 4), (2, 4)]]
    none = _started(FallbackAssistant(Recorder(7, when=lambda r: False), Recorder(8, when=lambda r: False)))
    assert [t.num_nodes for t in none.propose(rows)] == [0, 0, 0]


def test_hidden_states_are_requested_once_and_each_assistant_gets_its_own_layers():
    model = tiny_causal_lm("llama", num_layers=2)
    ids = torch.tensor([PROMPTS[0]])
    alone = {}
    for layers in [(-1,), (0, -1)]:
        rec = Recorder(7, layers=layers)
        model.generate(ids, max_new_tokens=3, do_sample=False, assistant=rec)
        alone[layers] = rec.observed
    a, b, none = Recorder(7, layers=(-1,)), Recorder(8, layers=(0, -1)), Recorder(9)
    fb = FallbackAssistant(none, a, b)
    model.generate(ids, max_new_tokens=3, do_sample=False, assistant=fb)
    assert fb.hidden_state_layers == (-1, 0)
    assert all(h is None for _, hs in none.observed for h in hs)
    for rec, layers in [(a, (-1,)), (b, (0, -1))]:
        prefill_alone, prefill_here = alone[layers][0][1][0], rec.observed[0][1][0]
        assert sorted(prefill_here) == sorted(prefill_alone) == sorted(layers)
        for layer in layers:
            assert prefill_here[layer].shape == (len(PROMPTS[0]), 64)
            torch.testing.assert_close(prefill_here[layer], prefill_alone[layer])


def test_every_assistant_is_finished_even_when_one_fails():
    class Failing(Recorder):
        def finish(self):
            super().finish()
            raise RuntimeError("boom")

    bad, good = Failing(7), Recorder(8)
    fb = FallbackAssistant(bad, good)
    with pytest.raises(RuntimeError, match="boom"):
        fb.finish()
    assert bad.finished == good.finished == 1


@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_ngram_then_medusa_heads_equals_vanilla(batch):
    model = tiny_causal_lm("llama")
    ids, mask = left_pad(PROMPTS[:batch])
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    for fb in (
        FallbackAssistant(NgramAssistant(), random_medusa_heads(model)),  # heads resolved against the target
        FallbackAssistant(NgramAssistant(), OracleProposer(model, depth=3)),
    ):
        out = model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, assistant=fb)
        assert_same_tokens(out, expected, f"batch {batch}: {fb!r}")


def test_bad_arguments_and_wrong_heads_are_clear_errors():
    with pytest.raises(ValueError, match="at least two"):
        FallbackAssistant(NgramAssistant())
    with pytest.raises(TypeError, match="separate arguments"):
        FallbackAssistant([NgramAssistant(), NgramAssistant()])
    model = tiny_causal_lm("llama")
    wrong = MedusaHeads(hidden_size=32, num_heads=2, vocab_size=model.config.vocab_size)
    ids = torch.tensor([PROMPTS[0]])
    with pytest.raises(ValueError, match="hidden"):
        model.generate(ids, max_new_tokens=4, assistant=FallbackAssistant(NgramAssistant(), wrong))
    assert torch.equal(
        model.generate(ids, max_new_tokens=4, do_sample=False),
        model.generate(ids, max_new_tokens=4, do_sample=False, assistant=NgramAssistant()),
    )


def test_default_ngram_plus_medusa_is_a_fallback_of_both():
    fb = hf_specdec.load_default_assistant("ngram+medusa")
    assert isinstance(fb, FallbackAssistant)
    kinds = [type(p).__name__ for p in fb.proposers]
    assert kinds == ["NgramAssistant", "MedusaAssistant"]
    assert fb.hidden_state_layers == (-1,)


class FreeRecorder(Recorder):
    proposes_for_free = True


def test_a_paused_row_still_drafts_with_the_free_assistant_only():
    from hf_specdec.generation.proposers.base import RowState

    free, paid = FreeRecorder(7), Recorder(8)
    fallback = _started(FallbackAssistant(free, paid))
    tokens = torch.tensor([5, 6, 7])
    rows = [RowState(0, tokens, 2, max_depth=0, free_depth=4), RowState(1, tokens, 2, max_depth=3)]
    free.when = lambda r: r.row == 1  # the free one finds nothing for the paused row 0
    trees = fallback.propose(rows)
    assert free.asked == [[(0, 4), (1, 3)]]  # it sees the paused row at the depth it would have had
    assert paid.asked == [[(0, 0)]]  # the paid one sees it paused
    assert [t.num_nodes for t in trees] == [0, 1]
    free.when = lambda r: True
    trees = fallback.propose(rows)
    assert [t.tokens.tolist() for t in trees] == [[7], [7]]  # the paused row drafts with the free assistant
    assert len(paid.asked) == 1  # and the paid one is not asked at all
