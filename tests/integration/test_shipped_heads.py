"""The heads that ship in the package, on the real default model: greedy output equal to vanilla `generate` at batch
1 and in a ragged batch of 4, and sampled output distributed as the target's own (chi-square of the first two
tokens against the distribution enumerated from vanilla's processed scores)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import hf_specdec
from hf_specdec.testing import assert_same_tokens, spec_bench_batch

SHIPPED = ("eagle", "medusa", "mlp_speculator", "dflash", "ngram+eagle", "ngram+medusa", "ngram+dflash")
WARPERS = dict(temperature=1.0, top_k=3)
ROWS = 1000  # 5 sigma on a cell of probability 0.3: a bias of 0.07
P_PASS = 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_head_greedy_equality_batch_1_and_4(default_model, name):
    model, tok = default_model
    ids, mask = spec_bench_batch(tok, 4)  # four categories, left-padded
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False,
                         assistant=hf_specdec.load_default_assistant(name))  # fmt: skip
    assert_same_tokens(out, expected, f"{name}, ragged batch of 4")
    row = ids[2:3, int((mask[2] == 0).sum()) :]
    one = model.generate(row, max_new_tokens=40, do_sample=False, assistant=hf_specdec.load_default_assistant(name))
    assert_same_tokens(one, model.generate(row, max_new_tokens=40, do_sample=False), f"{name}, batch 1")


def _exact_first_two(model, prompt: list[int]) -> dict[tuple[int, ...], float]:
    """P(first two generated tokens) under ``WARPERS``, from vanilla generate's processed scores (fp64)."""

    def probs(contexts: list[list[int]]) -> torch.Tensor:  # [C, V]
        ids = torch.tensor(contexts)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=1,
                             output_scores=True, return_dict_in_generate=True, **WARPERS)  # fmt: skip
        return torch.softmax(out.scores[0].double(), -1)

    first = probs([prompt])[0]
    support = first.nonzero().flatten().tolist()
    second = probs([prompt + [a] for a in support])
    return {
        (a, b): float(first[a] * second[i, b])
        for i, a in enumerate(support)
        for b in second[i].nonzero().flatten().tolist()
    }


@pytest.mark.slow
@pytest.mark.parametrize("name", ("eagle", "medusa", "mlp_speculator", "dflash"))
def test_shipped_head_samples_the_target_distribution(default_model, name):
    from scipy.stats import chisquare

    model, tok = default_model
    prompt = hf_specdec.chat_prompt_ids(tok, "Name three things people like about summer.")[0].tolist()
    joint = _exact_first_two(model, prompt)
    ids = torch.tensor([prompt] * ROWS)
    torch.manual_seed(0)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=3,
                         return_dict_in_generate=True, assistant=hf_specdec.load_default_assistant(name),
                         tree_budget=False, **WARPERS)  # fmt: skip
    depth = out.spec_stats.accepted_per_depth
    assert len(depth) > 0 and depth[0] > 0.1 * ROWS, f"vacuous: the head's drafts are rarely accepted {depth}"
    counts = Counter(tuple(r) for r in out.sequences[:, len(prompt) : len(prompt) + 2].tolist())
    assert set(counts) <= set(joint), "sampled a pair the target cannot produce"
    keys = [k for k, p in joint.items() if p * ROWS >= 5]
    f_obs = [counts[k] for k in keys] + [ROWS - sum(counts[k] for k in keys)]
    f_exp = [joint[k] * ROWS for k in keys] + [ROWS * (1 - sum(joint[k] for k in keys))]
    if f_exp[-1] < 1e-9:
        f_obs, f_exp = f_obs[:-1], f_exp[:-1]
    p = float(chisquare(f_obs, f_exp).pvalue)
    assert p > P_PASS, f"{name}: chi-square p = {p:.2e}; observed {dict(counts.most_common(6))}"
