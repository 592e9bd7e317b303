"""DraftModelAssistant: a smaller causal LM sharing the target's vocabulary drafts a chain or a tree.

The draft keeps its own `PagedCache`. Each step it feeds, in one packed forward over the batch, the tokens the
target committed since the last step (ending with the root), then expands the tree one level per forward:

- ``top_k == 1``: a chain of ``depth`` tokens (the classic draft-model speculative decoding).
- ``top_k > 1``: an EAGLE-2-style confidence-ranked tree: every level expands the ``top_k`` best frontier nodes by
  cumulative draft log-probability, and the ``num_nodes`` best nodes overall form the tree (a parent always scores
  at least as well as its child, so they form a tree).

Frontier nodes are written into the draft's cache as *pending* tokens: later levels see their ancestors through the
attention plan's mask, siblings never see each other. After verification the draft rolls back to its committed
prefix; the accepted tokens are fed again at the next step together with the new root (the same forward that the
next step needs anyway), so no extra draft pass is spent on bookkeeping.

With ``do_sample=True`` children are drawn without replacement from the processed draft distribution q
(Gumbel-top-k) and the tree carries q for exact verification (`DraftSampling.WITHOUT_REPLACEMENT`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..target import PlannedModel
from ..tree import DraftSampling, DraftTree, subset_parents
from .base import Proposer, ProposerSetup, RowState


def _vocab_size(model) -> int:
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return int(cfg.vocab_size)


class DraftModelAssistant(Proposer):
    """Drafts with a small causal LM.

    Args:
        model: the draft model (any transformers causal LM with the target's vocabulary).
        depth: tokens per chain / levels of the tree.
        top_k: children expanded per frontier node; 1 drafts a chain.
        num_nodes: tree size budget (ignored for chains).
    """

    def __init__(self, model, depth: int = 4, top_k: int = 1, num_nodes: int = 12):
        if depth < 1 or top_k < 1 or num_nodes < 1:
            raise ValueError(f"depth, top_k and num_nodes must be >= 1, got {depth}, {top_k}, {num_nodes}")
        self.model = model
        self.depth = depth
        self.top_k = top_k
        self.num_nodes = num_nodes if top_k > 1 else depth
        self.draft: PlannedModel | None = None  # the draft's planned forwards and cache, for one generate call

    def validate(self, target) -> None:
        if getattr(self.model.config, "is_encoder_decoder", False):
            raise ValueError("the draft model must be a decoder-only causal LM")
        tv, dv = _vocab_size(target), _vocab_size(self.model)
        if tv != dv:
            raise ValueError(
                f"draft model vocabulary ({dv} tokens, {type(self.model).__name__}) does not match the target's "
                f"({tv} tokens): a draft model must share the target's tokenizer"
            )
        if self.model.device != target.device:
            raise ValueError(f"draft model is on {self.model.device} but the target is on {target.device}")

    def start(self, setup: ProposerSetup) -> None:
        super().start(setup)
        self.finish()
        # entered once per call, not per draft forward (packing the linears scans the modules)
        self.draft = PlannedModel(self.model).__enter__()
        self.cache_rows: dict[int, int] = {}
        self.cached: dict[int, int] = {}  # committed tokens of each row in the draft cache
        self.sample = setup.do_sample
        self.processors = setup.logits_processor if setup.do_sample else None

    def finish(self) -> None:
        draft, self.draft = self.draft, None
        if draft is not None:
            draft.close()

    # ------------------------------------------------------------------ drafting
    def _forward(self, tokens, positions, rows, q_lens, masks, pending, keep) -> torch.Tensor:
        """`[K, V]` fp32 draft logits at the kept positions of one packed forward (see `PlannedModel.forward`)."""
        out = self.draft.forward(rows, tokens, positions, q_lens, masks, pending_lens=pending, logits_to_keep=keep)
        return out.logits.float()

    def _children(self, logits: torch.Tensor, contexts: list[torch.Tensor]):
        """Top-k (greedy) or Gumbel-top-k (sampling) children of each expanded node: (tokens, log q, q)."""
        if self.processors:
            logits = torch.stack([self.processors(c[None], row[None].clone())[0] for c, row in zip(contexts, logits)])
        logq = torch.log_softmax(logits, dim=-1)  # [n, V]
        k = min(self.top_k, logq.shape[-1])
        if self.sample:
            u = torch.rand(logq.shape, generator=self.setup.generator, device=logq.device).clamp_(1e-20, 1.0)
            gumbel = logq - torch.log(-torch.log(u))
            top = gumbel.topk(k, dim=-1).indices
            return top, logq.gather(-1, top), logq.exp()
        top = logq.topk(k, dim=-1)
        return top.indices, top.values, None

    def _feed_new_tokens(self, rows: Sequence[RowState]) -> tuple[list[int], torch.Tensor]:
        """Level 0: feed each row's tokens the draft has not seen (ending with the root) and commit them.

        Returns:
            the rows' draft cache rows, and `[B, V]` fp32 draft logits at each root (the depth-1 distribution).
        """
        device = rows[0].tokens.device
        for r in rows:
            if r.row not in self.cache_rows:
                self.cache_rows[r.row] = self.draft.add_rows(1)[0]
                self.cached[r.row] = 0
        feed = [r.tokens[self.cached[r.row] :] for r in rows]  # per row [n]
        q_lens = [f.numel() for f in feed]
        positions = torch.cat([torch.arange(self.cached[r.row], r.tokens.numel(), device=device) for r in rows])
        cache_rows = [self.cache_rows[r.row] for r in rows]
        last = torch.tensor(q_lens, device=device).cumsum(0) - 1  # [B] each row's root in the packed batch
        logits = self._forward(torch.cat(feed), positions, cache_rows, q_lens, [None] * len(rows), None, last)
        self.draft.commit_chunks(cache_rows, q_lens)  # the fed tokens stay; last step's tree is forgotten
        for r in rows:
            self.cached[r.row] = r.tokens.numel()
        return cache_rows, logits

    def propose(self, rows: Sequence[RowState]) -> list[DraftTree]:
        device = rows[0].tokens.device
        cache_rows, logits = self._feed_new_tokens(rows)

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
        # keep the best num_nodes by score (ties: shallower first, so a parent is never dropped before its child)
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


def draft_model_assistant_for(obj, target) -> Proposer | None:
    """``assistant=<PreTrainedModel>`` -> a chain-drafting `DraftModelAssistant`."""
    from transformers import PreTrainedModel

    if isinstance(obj, PreTrainedModel):
        return DraftModelAssistant(obj)
    return None
