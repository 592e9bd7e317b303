"""The draft model's node table is tensors over the batch (`_NodeTable`): its trees equal, node for node, those of the
per-row dict-of-lists table it replaced (kept below as the oracle), greedy and sampled, with and without logits
processors, for rows of different depth caps."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor

from hf_specdec.generation.proposers.base import ProposerSetup, RowState
from hf_specdec.generation.proposers.draft_model import DraftModelAssistant
from hf_specdec.generation.tree import DraftSampling, DraftTree, subset_parents
from hf_specdec.testing import tiny_causal_lm


class DictOfListsDraft(DraftModelAssistant):
    """The replaced implementation: one dict of node lists per row, one Python pass per node."""

    def _children(self, logits: torch.Tensor, contexts: list[torch.Tensor]):
        """Top-k (greedy) or Gumbel-top-k (sampling) children of each expanded node: (tokens, log q, q)."""
        if self.processors:  # the test's processors hold no per-row state: row 0's view is every row's
            procs = self.processors.for_row(0)
            logits = torch.stack([procs(c[None], row[None].clone())[0] for c, row in zip(contexts, logits)])
        return self._top_children(logits)  # the node table is what this oracle replaces, not the sampling

    def propose(self, rows: Sequence[RowState]) -> list[DraftTree]:
        device = rows[0].tokens.device
        cache_rows, logits, _ = self._feed_new_tokens(rows)

        depth_cap = [min(self.depth, r.max_depth) for r in rows]
        # Per row: node lists (token, parent, depth, score); q rows per expanded position (sampling).
        nodes = [dict(tok=[], par=[], dep=[], score=[], fed=[]) for _ in rows]
        q_rows: list[dict[int, torch.Tensor]] = [dict() for _ in rows]
        frontier: list[list[int]] = [[-1] for _ in rows]  # node indices to expand (-1 = root)
        scores_parent = [[0.0] for _ in rows]
        contexts = [[r.tokens] for r in rows]
        for level in range(1, max(depth_cap, default=0) + 1):
            toks, lq, q = self._children(logits, [c for cs in contexts for c in cs])
            i = 0
            new_frontier: list[list[int]] = []
            for b in range(len(rows)):
                nb = nodes[b]
                cand = []
                for parent, pscore in zip(frontier[b], scores_parent[b]):
                    if q is not None:
                        q_rows[b][parent] = q[i]
                    if level <= depth_cap[b]:
                        for t, s in zip(toks[i].tolist(), lq[i].tolist()):
                            nb["tok"].append(t)
                            nb["par"].append(parent)
                            nb["dep"].append(level)
                            nb["score"].append(pscore + s)
                            nb["fed"].append(-1)
                            cand.append(len(nb["tok"]) - 1)
                    i += 1
                cand.sort(key=lambda j: -nb["score"][j])
                new_frontier.append(cand[: self.top_k] if level < depth_cap[b] else [])
            frontier = new_frontier
            if not any(frontier):
                break
            # Expand the frontier: one packed forward of every row's frontier nodes.
            feed_toks, feed_pos, masks, q_lens, pend = [], [], [], [], []
            exp_rows = [b for b in range(len(rows)) if frontier[b]]
            contexts, scores_parent = [[] for _ in rows], [[] for _ in rows]
            for b in exp_rows:
                nb, r = nodes[b], rows[b]
                n_fed = sum(1 for f in nb["fed"] if f >= 0)
                fr = frontier[b]
                mask = torch.zeros(len(fr), n_fed + len(fr), dtype=torch.bool)
                for j, node in enumerate(fr):
                    path, a = [], node
                    while a >= 0:
                        path.append(a)
                        if nb["fed"][a] >= 0:
                            mask[j, nb["fed"][a]] = True
                        a = nb["par"][a]
                    mask[j, n_fed + j] = True
                    contexts[b].append(
                        torch.cat([r.tokens, torch.tensor([nb["tok"][x] for x in reversed(path)], device=device)])
                    )
                    scores_parent[b].append(nb["score"][node])
                for j, node in enumerate(fr):
                    nb["fed"][node] = n_fed + j
                feed_toks += [nb["tok"][x] for x in fr]
                feed_pos += [r.tokens.numel() - 1 + nb["dep"][x] for x in fr]
                masks.append(mask)
                q_lens.append(len(fr))
                pend.append(n_fed)
            logits = self._forward(
                torch.tensor(feed_toks, device=device),
                torch.tensor(feed_pos, device=device),
                [cache_rows[b] for b in exp_rows],
                q_lens,
                masks,
                pend,
                0,
            )
        return [self._build_tree(nodes[b], q_rows[b], device) for b in range(len(rows))]

    def _build_tree(self, nb: dict, q_rows: dict[int, torch.Tensor], device) -> DraftTree:
        n = len(nb["tok"])
        if n == 0:
            return DraftTree.empty(device)
        # keep the best num_nodes by score (ties: shallower first, so a parent is never dropped before its child);
        # sampled nodes by structure only, level by level in creation order (never by a draw's own probability)
        if self.sample:
            order = sorted(range(n), key=lambda j: (nb["dep"][j], j))[: self.num_nodes]
        else:
            order = sorted(range(n), key=lambda j: (-nb["score"][j], nb["dep"][j], j))[: self.num_nodes]
        keep = set(order)
        if self.sample:
            keep = self._prefix_closed(nb, keep)
        kept = sorted(keep, key=lambda j: (nb["dep"][j], j))  # parents first
        tokens = [nb["tok"][j] for j in kept]
        parent = subset_parents(nb["par"], kept)
        if not self.sample:  # scores: the draft's own probability of each path, for the loop's tree budget
            scores = torch.tensor([nb["score"][j] for j in kept], device=device).exp()
            return DraftTree.from_parents(torch.tensor(tokens, device=device), parent, scores=scores, source="draft")
        vocab = next(iter(q_rows.values())).numel()
        q = torch.zeros(len(kept) + 1, vocab, device=device)
        q[0] = q_rows[-1]
        for i, j in enumerate(kept):
            if j in q_rows:
                q[i + 1] = q_rows[j]
        return DraftTree.from_parents(
            torch.tensor(tokens, device=device),
            parent,
            sampling=DraftSampling.WITHOUT_REPLACEMENT,
            draft_probs=q,
            scores=torch.tensor([nb["score"][j] for j in kept], device=device).exp(),
            source="draft",
        )

    @staticmethod
    def _prefix_closed(nb: dict, keep: set[int]) -> set[int]:
        """Children sampled without replacement must stay a prefix of their draw order: drop any later sibling."""
        by_parent: dict[int, list[int]] = {}
        for j in range(len(nb["tok"])):
            by_parent.setdefault(nb["par"][j], []).append(j)  # draw order = creation order
        out: set[int] = set()

        def visit(parent: int) -> None:
            for child in by_parent.get(parent, []):
                if child not in keep:
                    break
                out.add(child)
                visit(child)

        visit(-1)
        return out


def _propose(cls, model, draft, sample, kwargs, processors):
    assistant = cls(draft, **kwargs)
    setup = ProposerSetup(
        target=model, generation_config=model.generation_config, do_sample=sample,
        generator=torch.Generator().manual_seed(0), logits_processor=processors,
    )  # fmt: skip
    assistant.start(setup)
    gen = torch.Generator().manual_seed(1)
    caps = [5, 2, 0, 1, 4]
    rows = [
        RowState(row=i, tokens=torch.randint(0, 90, (5 + 3 * i,), generator=gen), prompt_len=3, max_depth=cap)
        for i, cap in enumerate(caps)
    ]
    try:
        return assistant.propose(rows)
    finally:
        assistant.finish()


@pytest.mark.parametrize(
    "sample,kwargs,penalty",
    [
        (False, dict(depth=3), None),  # a chain
        (False, dict(depth=4, top_k=3, num_nodes=8), 1.3),
        (True, dict(depth=4, top_k=3, num_nodes=8), None),  # prefix-closed draws, q rows
        (True, dict(depth=3, top_k=2, num_nodes=50), 1.3),
    ],
)
def test_tensor_node_table_drafts_the_trees_of_the_per_row_table(sample, kwargs, penalty):
    model, draft = tiny_causal_lm("llama"), tiny_causal_lm("llama", seed=7)
    processors = None if penalty is None else LogitsProcessorList([RepetitionPenaltyLogitsProcessor(penalty)])
    want = _propose(DictOfListsDraft, model, draft, sample, kwargs, processors)
    got = _propose(DraftModelAssistant, model, draft, sample, kwargs, processors)
    assert [t.num_nodes for t in got] == [t.num_nodes for t in want] and got[2].num_nodes == 0
    for w, g in zip(want, got):
        assert torch.equal(g.tokens, w.tokens) and torch.equal(g.parent, w.parent) and torch.equal(g.depth, w.depth)
        assert g.sampling == w.sampling and g.source == w.source
        if w.num_nodes:
            torch.testing.assert_close(g.scores, w.scores)
            assert g.depth_bound is not None and g.depth_bound >= int(g.depth.max())
        if w.draft_probs is not None:
            torch.testing.assert_close(g.draft_probs, w.draft_probs)
