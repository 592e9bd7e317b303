"""``print(out.spec_stats)`` shows τ, acceptance, per-depth acceptance, tokens and timings in a few lines; the tree
budget's detail stays one attribute away (``.budget``) instead of being dumped."""

from __future__ import annotations

import torch

import hf_specdec
from hf_specdec.generation.stats import SpecStats
from hf_specdec.testing import tiny_causal_lm


def test_repr_is_a_few_readable_lines():
    stats = SpecStats(emitted_tokens=12, time_propose=0.25, time_verify=1.5, time_other=0.25)
    for drafted, accepted in ((4, 3), (4, 1), (4, 0), (2, 2)):
        stats.record_step(drafted, accepted)
    stats.budget = {"nodes_per_row": {0: 1, 4: 2, 2: 1}, "draft_nothing_fraction": 0.25, "cost": {"curve": {1: 0.1}}}
    text = repr(stats)
    lines = text.splitlines()
    assert 4 <= len(lines) <= 6 and all(len(line) <= 120 for line in lines)
    assert (
        lines[0]
        == "SpecStats: τ = 2.50 tokens per verify step (4 steps), acceptance 0.43 (6 of 14 drafted tokens accepted)"
    )
    assert "accepted >= d drafted tokens: d=1 0.75 d=2 0.50 d=3 0.25" in text
    assert "tokens: 12 emitted, 6 of them accepted draft tokens" in text
    assert "time: 2.000 s = propose 0.250 + verify 1.500 + other 0.250" in text
    assert "tree budget: 2.5 nodes per row and step, drafted nothing in 25%" in text
    assert "curve" not in text and "{" not in text  # the budget's detail is not dumped
    assert str(stats) == text


def test_printing_a_real_calls_stats():
    model = tiny_causal_lm("llama")
    ids = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]])  # [1, 13]
    out = model.generate(ids, max_new_tokens=12, do_sample=False, assistant=hf_specdec.NgramAssistant(),
                         return_dict_in_generate=True)  # fmt: skip
    text = repr(out.spec_stats)
    assert text.startswith(f"SpecStats: τ = {out.spec_stats.tau:.2f}")
    assert f"tokens: {out.spec_stats.emitted_tokens} emitted" in text
    assert out.spec_stats.budget and "calibration" not in text
