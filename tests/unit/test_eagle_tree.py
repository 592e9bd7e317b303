"""EAGLE-2 dynamic trees: the kept set is a tree, parents precede children, cumulative scores fall along paths, the
budget is respected, rows of a batch are independent, and the batched expansion equals a node-by-node reference."""

from __future__ import annotations

import pytest
import torch

from hf_specdec.generation.draft_dtype import ENV_VAR
from hf_specdec.generation.proposers.base import ProposerSetup, RowFeedback, RowState
from hf_specdec.generation.proposers.eagle import EagleAssistant, expand_dynamic_tree, select_tree_nodes
from hf_specdec.heads.eagle import EagleHead
from hf_specdec.testing import tiny_causal_lm

CONTEXTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4], [9, 9, 8, 7, 6], [12, 13, 12, 13, 12, 13, 12, 13]]


@pytest.fixture(scope="module")
def setup():
    model = tiny_causal_lm("llama", num_layers=2)
    torch.manual_seed(0)
    head = EagleHead.for_model(model, draft_vocab=torch.arange(2, 90)).eval()
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.15)
    return model, head


def prefilled(model, head, contexts, **tree):
    """An EagleAssistant that has observed each context's prefill (features from the model itself)."""
    a = EagleAssistant(head, **tree)
    a.validate(model)
    a.start(ProposerSetup(target=model, generation_config=None, batch_size=len(contexts)))
    rows, fbs = [], []
    for i, ctx in enumerate(contexts):
        ids = torch.tensor(ctx)
        with torch.no_grad():
            out = model(ids[None], output_hidden_states=True)
        root = int(out.logits[0, -1].argmax())
        rows.append(RowState(i, torch.tensor([*ctx, root]), len(ctx), max_depth=8))
        fbs.append(RowFeedback(ids, torch.zeros(0, dtype=torch.long), root, None, {-1: out.hidden_states[-1][0]}))
    a.observe(rows, fbs)
    return a, rows


def check_tree(tree, num_nodes, max_depth):
    n = tree.num_nodes
    assert 0 < n <= num_nodes
    par = tree.parent.tolist()
    assert all(-1 <= p < i for i, p in enumerate(par)), "parents precede children"
    for i, p in enumerate(par):
        assert int(tree.depth[i]) == (1 if p < 0 else int(tree.depth[p]) + 1)
        if p >= 0:
            assert float(tree.scores[i]) <= float(tree.scores[p]) + 1e-7, "path probabilities fall along paths"
    assert tree.max_depth <= max_depth
    assert tree.dedup_siblings().num_nodes == n, "siblings carry distinct tokens"


@pytest.mark.parametrize("tree_kwargs", [dict(top_k=3, depth=4, num_nodes=10), dict(top_k=5, depth=3, num_nodes=50)])
def test_trees_are_trees_within_budget(setup, tree_kwargs):
    model, head = setup
    a, rows = prefilled(model, head, CONTEXTS, **tree_kwargs)
    rows[2].max_depth = 2
    trees = a.propose(rows)
    for r, tree in zip(rows, trees):
        check_tree(tree, tree_kwargs["num_nodes"], min(r.max_depth, tree_kwargs["depth"]))
    k, d = tree_kwargs["top_k"], tree_kwargs["depth"]
    assert trees[0].num_nodes == min(tree_kwargs["num_nodes"], k + (d - 1) * k * k)


@pytest.mark.parametrize("draft_dtype", [torch.float32, torch.bfloat16])
def test_rows_of_a_batch_are_independent(setup, draft_dtype, monkeypatch):
    """A row drafts the same tree alone and in a batch; its path probabilities agree to the rounding of the dtype the
    head drafts in (bf16 wherever the CPU multiplies it faster, e.g. AMX or AVX512-BF16: pinned here both ways)."""
    monkeypatch.setenv(ENV_VAR, str(draft_dtype).removeprefix("torch."))
    model, head = setup
    depth = 4
    batch, rows = prefilled(model, head, CONTEXTS, top_k=3, depth=depth, num_nodes=12)
    together = batch.propose(rows)
    # a path probability is a product of `depth` softmax values, each rounded to the draft dtype (relative eps)
    rtol = max(1e-4, 2 * depth * torch.finfo(draft_dtype).eps)
    for i, ctx in enumerate(CONTEXTS):
        alone, alone_rows = prefilled(model, head, [ctx], top_k=3, depth=depth, num_nodes=12)
        (tree,) = alone.propose(alone_rows)
        assert torch.equal(tree.tokens, together[i].tokens) and torch.equal(tree.parent, together[i].parent)
        torch.testing.assert_close(tree.scores, together[i].scores, rtol=rtol, atol=1e-6)


def reference_expansion(head, cache_slot_len, pk, pv, root_out, root_logp, k, depth):
    """Node by node: each frontier node attends to the row's cache and its own ancestors; returns candidates as
    (score, token, parent, depth) in creation order."""
    cands = []
    top = root_logp.topk(k)
    frontier = []  # (cand index, score, token, parent feature, ancestor k/v list)
    for s, i in zip(top.values.tolist(), top.indices.tolist()):
        cands.append((s, int(head.draft_to_token(torch.tensor(i))), -1, 1))
        frontier.append((len(cands) - 1, s, cands[-1][1], root_out, []))
    for d in range(1, depth):
        children = []
        for cand, score, tok, feat, anc in frontier:
            keys = torch.cat([pk[:, :cache_slot_len]] + [kv[0] for kv in anc], dim=1)[None]
            vals = torch.cat([pv[:, :cache_slot_len]] + [kv[1] for kv in anc], dim=1)[None]
            mask = torch.ones(1, 1, keys.shape[2] + 1, dtype=torch.bool)
            pos = torch.tensor([[cache_slot_len - 1 + d]])
            out, nk, nv = head.layer_forward(torch.tensor([[tok]]), feat[None, None], pos, mask, keys, vals)
            logp = torch.log_softmax(head.logits(out[0, 0]), -1)
            best = logp.topk(k)
            for lp, i in zip(best.values.tolist(), best.indices.tolist()):
                cands.append((score + lp, int(head.draft_to_token(torch.tensor(i))), cand, d + 1))
                children.append((len(cands) - 1, score + lp, cands[-1][1], out[0, 0], [*anc, (nk[0], nv[0])]))
        children.sort(key=lambda c: -c[1])
        frontier = children[:k]
    return cands


def test_batched_expansion_equals_the_node_by_node_reference(setup):
    model, head = setup
    a, rows = prefilled(model, head, CONTEXTS, top_k=3, depth=3, num_nodes=12)
    slots = torch.arange(len(CONTEXTS))
    root_out = a._commit([r.row for r in rows])  # every row's queued pairs into the head's cache
    root_logp = torch.log_softmax(head.logits(root_out), -1)
    with torch.no_grad():
        score, token, parent, depth = expand_dynamic_tree(head, a.cache, slots, root_out, root_logp, 3, 3)
        for b in range(len(CONTEXTS)):
            n = int(a.cache.lengths[b])
            ref = reference_expansion(head, n, a.cache.key[b], a.cache.value[b], root_out[b], root_logp[b], 3, 3)
            assert token[b].tolist() == [c[1] for c in ref]
            assert parent[b].tolist() == [c[2] for c in ref]
            assert depth[b].tolist() == [c[3] for c in ref]
            torch.testing.assert_close(score[b], torch.tensor([c[0] for c in ref]), rtol=1e-4, atol=1e-5)


def test_selection_keeps_parents_on_ties_and_respects_depth():
    # a chain of probability-1 nodes ties with its parent: the parent must win the tie
    score = torch.tensor([[0.0, -1.0, 0.0, 0.0, -2.0]])
    depth = torch.tensor([[1, 1, 2, 3, 2]])
    keep = select_tree_nodes(score, depth, torch.tensor([3]), num_nodes=2)
    assert keep[0].tolist() == [True, False, True, False, False]
    keep = select_tree_nodes(score, depth, torch.tensor([1]), num_nodes=4)
    assert keep[0].tolist() == [True, True, False, False, False]
