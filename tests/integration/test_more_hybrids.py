"""More hybrid targets exact on token trees (issue 33), served by attention/gated_delta.py: OLMo-Hybrid's gated delta
nets (its q/k/v/a/b and output gate projected apart, beta scaled to [0, 2]) and the Kimi delta attention of
Kimi-Linear and Bailing-Hybrid (a decay per key channel, its modeling file's own rules; Bailing-Hybrid's output gate
one projection, its forget gate bounded). Every tree node's logits equal vanilla's
forward over the node's own path, node by node (ragged rows, then one token after a committed path), over a draft
model's pending levels and for a prompt in two chunks; greedy output equals vanilla's with every assistant, batch 1 and
a left-padded ragged batch of 4. The helpers are test_hybrid_trees.py's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_hybrid_trees import _paths, _tree_mask, _vanilla_last_logits, assert_greedy_equal_with_every_assistant

from hf_specdec.attention.gated_delta import is_gated_delta
from hf_specdec.attention.plan import TailMask
from hf_specdec.generation.target import PlannedModel
from hf_specdec.kernels.mask_bits import pack_bits
from tools.architectures import tiny_model

MORE = ["olmo_hybrid", "kimi_linear", "bailing_hybrid"]
CLOSE = dict(rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module", params=MORE)
def model(request):
    return tiny_model(request.param)


def test_every_recurrent_layer_is_served_on_trees(model):
    """The sweep's tiny model has recurrent layers, each a module this package recognises (else it would be refused)."""
    kinds = model.config.layer_types
    served = {m.layer_idx for m in model.modules() if is_gated_delta(m)}
    assert "linear_attention" in kinds and "full_attention" in kinds, kinds
    assert served == {i for i, k in enumerate(kinds) if k == "linear_attention"}, (served, kinds)


def test_each_tree_node_sees_its_own_path(model):
    prompts = [[5, 9, 11, 7, 5, 9, 13, 17, 19], [23, 29, 31]]
    trees = [([-1, 0, 0, 1, 1, 3, 2], [41, 42, 43, 44, 45, 46, 47]), ([-1, 0, 1, 1], [51, 52, 53, 54])]
    with torch.no_grad(), PlannedModel(model) as target:
        rows = target.add_rows(2)
        target.forward(
            rows,
            torch.tensor([t for p in prompts for t in p]),
            torch.cat([torch.arange(len(p)) for p in prompts]),
            [len(p) for p in prompts],
        )
        target.commit_chunks(rows, [len(p) for p in prompts])
        masks = [_tree_mask(parents) for parents, _ in trees]
        out = target.forward(
            rows,
            torch.tensor([t for _, tokens in trees for t in tokens]),
            torch.cat([len(p) + m.sum(-1) - 1 for p, m in zip(prompts, masks)]),
            [len(tokens) for _, tokens in trees],
            masks,
        )
        start = 0
        for prompt, (parents, tokens) in zip(prompts, trees):
            for i, path in enumerate(_paths(parents, tokens)):
                want = _vanilla_last_logits(model, prompt + path)
                torch.testing.assert_close(out.logits[start + i], want, **CLOSE, msg=f"node {i} of {path}")
            start += len(tokens)
        # row 0 keeps root, node 1, node 3 (tokens 41 42 44), row 1 the root only; then one more token each
        target.commit_trees(rows, [torch.tensor([0, 1, 3]), torch.tensor([0])])
        nxt = target.forward(
            rows, torch.tensor([61, 62]), torch.tensor([len(prompts[0]) + 3, len(prompts[1]) + 1]), [1, 1]
        )
    torch.testing.assert_close(nxt.logits[0], _vanilla_last_logits(model, prompts[0] + [41, 42, 44, 61]), **CLOSE)
    torch.testing.assert_close(nxt.logits[1], _vanilla_last_logits(model, prompts[1] + [51, 62]), **CLOSE)


def test_pending_levels_of_a_draft_see_their_ancestors(model):
    """A draft model writes a tree level per forward; the second level's nodes start from their pending parents."""
    prompt = [5, 9, 11, 7, 5, 9]
    n = len(prompt)
    with torch.no_grad(), PlannedModel(model) as target:
        (row,) = target.add_rows(1)
        target.forward([row], torch.tensor(prompt), torch.arange(n), [n])
        target.commit_chunks([row], [n])
        target.forward([row], torch.tensor([30, 31]), torch.tensor([n, n]), [2], [torch.eye(2, dtype=torch.bool)])
        mask = torch.tensor([[1, 0, 1, 0], [0, 1, 0, 1]], dtype=torch.bool)  # 40 below 30, 41 below 31
        out = target.forward(
            [row], torch.tensor([40, 41]), torch.tensor([n + 1, n + 1]), [2],
            TailMask(pack_bits(mask), np.zeros(1, dtype=bool)), pending_lens=[2],
        )  # fmt: skip
    torch.testing.assert_close(out.logits[0], _vanilla_last_logits(model, prompt + [30, 40]), **CLOSE)
    torch.testing.assert_close(out.logits[1], _vanilla_last_logits(model, prompt + [31, 41]), **CLOSE)


def test_a_prompt_in_two_chunks_continues_from_the_committed_state(model):
    prompts = [[5, 9, 11, 7, 5, 9, 13, 17, 19, 23, 29], [31, 37, 41, 43, 47, 53, 59]]
    with torch.no_grad(), PlannedModel(model) as target:
        rows = target.add_rows(2)
        target.forward(rows, torch.tensor([t for p in prompts for t in p[:4]]), torch.arange(4).repeat(2), [4, 4])
        target.commit_chunks(rows, [4, 4])
        out = target.forward(
            rows,
            torch.tensor([t for p in prompts for t in p[4:]]),
            torch.cat([torch.arange(4, len(p)) for p in prompts]),
            [len(p) - 4 for p in prompts],
        )
    for prompt, end in zip(prompts, np.cumsum([len(p) - 4 for p in prompts]) - 1):
        torch.testing.assert_close(out.logits[end], _vanilla_last_logits(model, prompt), **CLOSE)


def test_greedy_equals_vanilla_with_every_assistant_batch_1_and_ragged_4(model):
    assert_greedy_equal_with_every_assistant(model, model.config.model_type)
