"""Hybrid targets on token trees: short convolutions (LFM2, LFM2-MoE, LFM3: attention/short_conv.py), gated delta
nets (Qwen3-Next, Qwen3.5: attention/gated_delta.py), Mamba mixers (Bamba, GraniteMoE-Hybrid, Falcon-H1, Nemotron-H,
Zamba2, Jamba: attention/mamba.py) and lightning attention (MiniMax: attention/lightning.py), their state in
cache/conv_states.py and recurrent_states.py: every tree node's logits equal vanilla's forward over the node's own
path, node by node, for ragged rows, after a committed path and over a draft model's pending levels; greedy output
equals vanilla's with every assistant, batch 1 and a ragged batch of 4; sampled first tokens follow the target's
distribution."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_specdec
from hf_specdec.attention.plan import TailMask
from hf_specdec.generation.target import PlannedModel
from hf_specdec.kernels.mask_bits import pack_bits
from hf_specdec.testing import (
    SAMPLING_VOCAB,
    OracleProposer,
    RandomTreeProposer,
    assert_same_tokens,
    first_tokens_p_values,
    greedy_verification,
    left_pad,
    sample_first_tokens,
)
from tools.architectures import tiny_config, tiny_model

HYBRIDS = [
    *["lfm2", "lfm2_moe", "lfm3"],  # short convolutions
    *["qwen3_next", "qwen3_5_text"],  # gated delta nets
    *["bamba", "granitemoehybrid", "falcon_h1", "nemotron_h", "zamba2"],  # Mamba-2 mixers
    "jamba",  # Mamba-1 mixers
    "minimax",  # lightning attention
]


def _vanilla_last_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0, -1]


def _tree_mask(parents: list[int]) -> torch.Tensor:
    """`[n, n]` bool: node i sees itself and its ancestors (parents[i] < i, -1 for a root child of the row's root)."""
    n = len(parents)
    mask = torch.eye(n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] |= mask[p]
    return mask


def _paths(parents: list[int], tokens: list[int]) -> list[list[int]]:
    out = []
    for i in range(len(parents)):
        path, j = [], i
        while j >= 0:
            path.append(tokens[j])
            j = parents[j]
        out.append(path[::-1])
    return out


@pytest.mark.parametrize("model_type", HYBRIDS)
def test_each_tree_node_sees_its_own_path_through_the_convolution(model_type):
    model = tiny_model(model_type)
    prompts = [[5, 9, 11, 7, 5, 9, 13, 17, 19], [23, 29, 31]]
    # a tree per row: parents within the row's forward ([root, ...]: the root is index 0, every other node below it)
    trees = [([-1, 0, 0, 1, 1, 3, 2], [41, 42, 43, 44, 45, 46, 47]), ([-1, 0, 1, 1], [51, 52, 53, 54])]
    with torch.no_grad(), PlannedModel(model) as target:
        rows = target.add_rows(2)
        toks = torch.tensor([t for p in prompts for t in p])
        pos = torch.cat([torch.arange(len(p)) for p in prompts])
        target.forward(rows, toks, pos, [len(p) for p in prompts])
        target.commit_chunks(rows, [len(p) for p in prompts])
        masks = [_tree_mask(par) for par, _ in trees]
        depth = [m.sum(-1) - 1 for m in masks]
        out = target.forward(
            rows,
            torch.tensor([t for _, tk in trees for t in tk]),
            torch.cat([len(p) + d for p, d in zip(prompts, depth)]),
            [len(tk) for _, tk in trees],
            masks,
        )
        start = 0
        for prompt, (par, tk) in zip(prompts, trees):
            for i, path in enumerate(_paths(par, tk)):
                want = _vanilla_last_logits(model, prompt + path)
                torch.testing.assert_close(out.logits[start + i], want, rtol=1e-4, atol=1e-4)
            start += len(tk)
        # commit a path in row 0 (root, node 1, node 3) and nothing past the root in row 1, then decode one more token
        target.commit_trees(rows, [torch.tensor([0, 1, 3]), torch.tensor([0])])
        nxt = target.forward(
            rows, torch.tensor([61, 62]), torch.tensor([len(prompts[0]) + 3, len(prompts[1]) + 1]), [1, 1]
        )
        torch.testing.assert_close(
            nxt.logits[0], _vanilla_last_logits(model, prompts[0] + [41, 42, 44, 61]), rtol=1e-4, atol=1e-4
        )
        torch.testing.assert_close(
            nxt.logits[1], _vanilla_last_logits(model, prompts[1] + [51, 62]), rtol=1e-4, atol=1e-4
        )


@pytest.mark.parametrize("model_type", ["lfm2", "qwen3_next", "bamba", "jamba", "minimax"])
def test_pending_levels_of_a_draft_see_their_ancestors(model_type):
    """A draft model writes a tree level per forward; each level sees the earlier ones as pending tokens."""
    model = tiny_model(model_type)
    prompt = [5, 9, 11, 7, 5, 9]
    with torch.no_grad(), PlannedModel(model) as target:
        (row,) = target.add_rows(1)
        target.forward([row], torch.tensor(prompt), torch.arange(6), [6])
        target.commit_chunks([row], [6])
        n = len(prompt)
        target.forward([row], torch.tensor([30, 31]), torch.tensor([n, n]), [2], [torch.eye(2, dtype=torch.bool)])
        # level 2: children 40 (of 30) and 41 (of 31), each seeing its parent among the 2 pending tokens
        mask = torch.tensor([[1, 0, 1, 0], [0, 1, 0, 1]], dtype=torch.bool)
        out = target.forward(
            [row], torch.tensor([40, 41]), torch.tensor([n + 1, n + 1]), [2],
            TailMask(pack_bits(mask), np.zeros(1, dtype=bool)), pending_lens=[2],
        )  # fmt: skip
        torch.testing.assert_close(out.logits[0], _vanilla_last_logits(model, prompt + [30, 40]), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(out.logits[1], _vanilla_last_logits(model, prompt + [31, 41]), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("model_type", ["qwen3_next", "bamba", "jamba", "minimax"])
def test_a_prompt_in_two_chunks_continues_from_the_committed_state(model_type):
    """A second causal chunk after committed tokens starts from the committed state: the prefill rule from it (gated
    delta nets, Mamba-2), or the one-token rule token by token (Mamba-1's scan starts from zeros only)."""
    model = tiny_model(model_type)
    prompts = [[5, 9, 11, 7, 5, 9, 13, 17, 19, 23, 29], [31, 37, 41, 43, 47, 53, 59]]
    with torch.no_grad(), PlannedModel(model) as target:
        rows = target.add_rows(2)
        first = [p[:4] for p in prompts]
        target.forward(rows, torch.tensor([t for p in first for t in p]), torch.arange(4).repeat(2), [4, 4])
        target.commit_chunks(rows, [4, 4])
        rest = [p[4:] for p in prompts]
        out = target.forward(
            rows,
            torch.tensor([t for p in rest for t in p]),
            torch.cat([torch.arange(4, len(p)) for p in prompts]),
            [len(r) for r in rest],
        )
    ends = np.cumsum([len(r) for r in rest]) - 1
    for prompt, end in zip(prompts, ends):
        torch.testing.assert_close(out.logits[end], _vanilla_last_logits(model, prompt), rtol=1e-4, atol=1e-4)


def assert_greedy_equal_with_every_assistant(model, label: str) -> None:
    """Greedy ``generate`` with n-gram, a random tree, the oracle, a draft model's tree and a self-draft equals
    vanilla's, for one row and for a left-padded ragged batch of 4 (shared by tests/integration/test_more_hybrids.py)."""
    rows = [[5, 9, 11, 7, 5, 9, 11, 7, 5], [23, 29], [31, 37, 41, 43, 31, 37], [47, 53, 59, 61, 67, 71, 73]]
    draft = hf_specdec.draft_model_from_layers(model, 1)
    assistants = {
        "ngram": lambda: hf_specdec.NgramAssistant(),
        "random tree": lambda: RandomTreeProposer(model.config.vocab_size, nodes=10, seed=3),
        "oracle": lambda: OracleProposer(model),
        "draft model": lambda: hf_specdec.DraftModelAssistant(draft, depth=3, top_k=2),
        "self draft": lambda: draft,
    }
    for batch in (rows[:1], rows):
        ids, mask = left_pad(batch)
        kw = dict(attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0)
        want = model.generate(ids, **kw)
        for name, make in assistants.items():
            got = model.generate(ids, assistant=make(), **kw)
            assert_same_tokens(got, want, f"{label}, {name}, batch {len(batch)}")


@pytest.mark.parametrize("model_type", HYBRIDS)
def test_greedy_equals_vanilla_with_every_assistant_batch_1_and_ragged_4(model_type):
    assert_greedy_equal_with_every_assistant(tiny_model(model_type), model_type)


@pytest.mark.parametrize(
    "model_type, sizes",
    [("lfm2", {}), ("qwen3_next", {}), ("bamba", {"mamba_n_heads": 4}), ("minimax", {})],
)  # Bamba: 4 heads x 16 = 2 x 32 channels
def test_sampled_first_tokens_follow_the_hybrid_targets_distribution(model_type, sizes):
    """Chi-square of the first 1, 2, 3 sampled tokens (3,000 rows in one batch, a draft model's sampled trees) against
    the hybrid target's own joint distribution, enumerated from vanilla's processed scores."""
    model = _sampling_hybrid(model_type, sizes)
    counts = sample_first_tokens(model, _sampling_draft(model), 3000, tree_budget=False)  # every tree verified whole
    ps = first_tokens_p_values(counts, model)
    assert min(ps) > 1e-4, f"chi-square p-values of the first 1, 2, 3 tokens: {ps}"


def test_a_wrong_verifier_is_caught_on_a_lightning_attention_target():
    """The check has power on MiniMax: verifying its sampled trees greedily while sampling must be rejected."""
    model = _sampling_hybrid("minimax", {})
    with greedy_verification():  # greedy verification rejects most sampled drafts: no power check on the drafts
        counts = sample_first_tokens(model, _sampling_draft(model), 1000, check_power=False, tree_budget=False)
    ps = first_tokens_p_values(counts, model)
    assert min(ps) < 1e-6, f"greedy verification of a sampled call was not caught: p-values {ps}"


def _sampling_hybrid(model_type: str, sizes: dict):
    """The sweep's tiny ``model_type`` (MiniMax: attention in layer 0) shrunk to the `SAMPLING_VOCAB` vocabulary and
    width 32, its weights drawn with std 0.3 (peaked, not degenerate next-token distributions), ``sizes`` set."""
    config = tiny_config(model_type)
    config.vocab_size, config.hidden_size, config.intermediate_size = SAMPLING_VOCAB, 32, 64
    for name, value in sizes.items():
        setattr(config, name, value)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.3)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = 2, 0
    return model


def _sampling_draft(model):
    return hf_specdec.DraftModelAssistant(hf_specdec.draft_model_from_layers(model, 1), depth=2, top_k=2)
