"""The budget plans for what a draft model's own drafting costs (issue 68): given a measured cost per level and the
acceptance its drafts showed, it drafts the levels that pay and none where none does; a draft that does not pay runs
no forward (it catches up lazily, exactly); the cost is kept across calls and processes. Decisions only, no timing:
the costs are set, not measured."""

from __future__ import annotations

import pytest
import torch

from hf_specdec import DraftModelAssistant
from hf_specdec.generation import cost_cache
from hf_specdec.generation.budget import TreeBudgeter
from hf_specdec.generation.cost_model import ProposingCost, StepCostModel, proposing_cost_for
from hf_specdec.testing import assert_same_tokens, left_pad, tiny_causal_lm

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 5, 6, 7], [3, 4, 5], [9, 9, 8, 7, 6, 5, 4]]


def budget_with(ratio: float | None, accepted: float = 0.0, verified: float = 0.0) -> TreeBudgeter:
    """A budget over a flat-ish verify cost (a token costs 5% of a step) planning a proposer whose level costs
    ``ratio`` plain steps, with ``accepted`` of ``verified`` depth-1 nodes accepted so far."""
    cost = StepCostModel()
    for n in range(1, 40):
        cost.record_verify(n, 1, 0.02 * (1 + 0.05 * (n - 1)))
    budget = TreeBudgeter(cost)
    proposing = ProposingCost()
    if ratio is not None:
        proposing.record_level(ratio)
    proposing.accepted[0], proposing.verified[0] = accepted, verified
    budget.plan_proposing(proposing, "draft")
    return budget


def test_a_level_costing_more_than_it_can_return_is_not_drafted():
    assert budget_with(1.2, accepted=50, verified=50).depth_cap(0, 8) == 0, "even sure tokens do not pay"
    assert budget_with(0.5, accepted=5, verified=50).depth_cap(0, 8) == 0, "cheap, but rarely accepted"


def test_a_cheap_level_that_is_accepted_is_drafted_as_deep_as_it_pays():
    cheap = budget_with(0.05, accepted=45, verified=50).depth_cap(0, 8)
    dearer = budget_with(0.3, accepted=45, verified=50).depth_cap(0, 8)
    assert cheap >= dearer >= 1
    assert budget_with(0.05, accepted=45, verified=50).depth_cap(0, 2) <= 2


def test_an_unmeasured_proposer_drafts_one_level_to_measure_it():
    assert budget_with(None).depth_cap(0, 8) == 1


def test_drafting_off_probes_on_a_schedule_that_doubles():
    budget = budget_with(2.0, accepted=50, verified=50)
    caps = []
    for _ in range(60):
        caps.append(budget.depth_cap(0, 8))
        budget.cut([])  # the step ends (nothing proposed)
    probes = [i for i, c in enumerate(caps) if c]
    assert probes == [15, 47], "first after 16 off steps, the next after 32"
    assert all(c in (0, 1) for c in caps)


def test_a_much_cheaper_sample_replaces_the_old_ones_and_a_backlog_does_not_count():
    cost = ProposingCost()
    for _ in range(5):
        cost.record_level(1.0)
    cost.record_level(3.0, catching_up=True)
    assert cost.ratio() == 1.0
    cost.record_level(0.2, catching_up=True)
    assert cost.ratio() == 0.2, "a draft that became cheap comes back at once"


def _counted_forwards(model) -> list[int]:
    calls = [0]
    model.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.parametrize("batch", [1, 3])
def test_a_draft_that_cannot_pay_runs_no_forward_and_output_is_vanilla(batch):
    model, draft = tiny_causal_lm("llama"), tiny_causal_lm("llama", seed=7)
    ids, mask = left_pad(PROMPTS[:batch])
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
    cost = proposing_cost_for(model, draft)
    cost.record_level(5.0)
    cost.probe_interval = 512  # no probe within this call
    forwards = _counted_forwards(draft)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, assistant=draft,
                         return_dict_in_generate=True)  # fmt: skip
    assert_same_tokens(out.sequences, expected, f"batch={batch}")
    assert forwards[0] == 0
    assert set(out.spec_stats.budget["proposing"]["levels_per_step"]) == {0}


def test_a_paused_self_draft_catches_up_exactly_on_its_probe():
    model = tiny_causal_lm("llama")
    ids = torch.tensor([PROMPTS[0]])
    expected = model.generate(ids, max_new_tokens=40, do_sample=False)
    cost = proposing_cost_for(model, model)
    cost.record_level(3.0)  # off: only probes draft, after 16 steps of committed tokens it never saw
    out = model.generate(ids, max_new_tokens=40, do_sample=False, assistant=DraftModelAssistant(model, depth=3),
                         return_dict_in_generate=True)  # fmt: skip
    assert_same_tokens(out.sequences, expected, "self-draft")
    stats = out.spec_stats
    assert stats.budget["proposing"]["probes"] >= 1
    assert stats.drafted_tokens >= 1 and stats.accepted_tokens == stats.drafted_tokens, "caught up: its guess holds"


def test_the_cost_is_kept_for_the_next_process(tmp_path, monkeypatch):
    monkeypatch.setenv(cost_cache.ENV_VAR, str(tmp_path))
    model, draft = tiny_causal_lm("llama"), tiny_causal_lm("llama", seed=3)
    ids = torch.tensor([PROMPTS[0]])
    model.generate(ids, max_new_tokens=16, do_sample=False, assistant=draft)
    files = list(tmp_path.glob("proposing-llama-*.json"))
    assert len(files) == 1
    saved = proposing_cost_for(model, draft)
    again = ProposingCost()
    again.load_state(cost_cache.proposing_file(model, draft).read())
    assert again.state() == saved.state() and again.ratio() is not None


def test_a_probe_that_costs_more_than_a_share_of_its_interval_spaces_the_next_one_further():
    """A probe that caught a deep draft up on a long prompt cost 30 plain steps: the next waits 3,000 steps (1% of
    the time), past the 512 the doubling stops at; a cheap probe keeps the doubling schedule."""
    for seconds, expected in ((30.0, 3000), (0.05, 32)):
        budget = budget_with(2.0, accepted=50, verified=50)
        plain = budget.cost.predict(1) + budget.cost.other_seconds(1)
        for _ in range(16):
            cap = budget.depth_cap(0, 8)
            if cap:
                budget.record_proposing(seconds * plain, 1, catching_up=True)
            budget.cut([])
        assert cap == 1 and budget.proposing.probe_interval == expected
