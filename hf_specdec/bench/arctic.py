"""The peer of `SuffixAssistant` in the benchmark: Arctic Inference's SuffixDecoding (the suffix-tree drafter behind
vLLM's ``suffix`` method), drafting through hf_specdec's loop so that only the drafts differ.

`ArcticSuffixAssistant` wraps ``arctic_inference.suffix_decoding.SuffixDecodingCache``: a request per row (its prompt
in a per-request tree; its answer added to the cache's global tree as it is accepted), ``speculate`` with vLLM's
defaults for the method (tree depth 24, spec factor 1.0, min token probability 0.1, tree speculation) every step, the
cache kept across calls (one object per benchmark run, as one vLLM engine). Its per-node probabilities go to the
loop's tree budget as scores, as hf_specdec's own assistants' do.

``arctic-inference`` ships only a source distribution whose build requires a CUDA torch; its suffix tree is plain
C++ (nanobind) and builds against the installed CPU torch with::

    pip install nanobind==2.9.2 ninja grpcio-tools "protobuf==5.29.6" wheel
    pip install --no-build-isolation --no-deps arctic-inference
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from ..generation.proposers.base import Proposer, ProposerSetup, RowFeedback, RowState
from ..generation.tree import DraftSampling, DraftTree

# vLLM's defaults for method "suffix" (SpeculativeConfig: suffix_decoding_*)
MAX_TREE_DEPTH = 24
MAX_SPEC_FACTOR = 1.0
MIN_TOKEN_PROB = 0.1
MAX_CACHED_REQUESTS = 10000


def arctic_available() -> bool:
    """Whether ``arctic_inference``'s suffix tree imports here."""
    try:
        from arctic_inference.suffix_decoding import SuffixDecodingCache  # noqa: F401
    except Exception:  # noqa: BLE001 - not installed, or built for another torch/python
        return False
    return True


class ArcticSuffixAssistant(Proposer):
    """Arctic Inference's SuffixDecoding drafts, verified by hf_specdec's loop (see the module docstring)."""

    sampling = DraftSampling.DETERMINISTIC
    proposes_for_free = True

    def __init__(self, max_tree_depth: int = MAX_TREE_DEPTH, max_cached_requests: int = MAX_CACHED_REQUESTS) -> None:
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        self.cache = SuffixDecodingCache(max_tree_depth=max_tree_depth, max_cached_requests=max_cached_requests)
        self.max_tree_depth = max_tree_depth
        self._ids = itertools.count()
        self._requests: dict[int, tuple[int, int]] = {}  # row -> (request id, tokens the cache has)

    def __repr__(self) -> str:
        return f"ArcticSuffixAssistant(max_tree_depth={self.max_tree_depth})"

    def start(self, setup: ProposerSetup) -> None:
        super().start(setup)
        self._stop_all()

    def finish(self) -> None:
        self._stop_all()

    def _stop_all(self) -> None:
        for req, _ in self._requests.values():
            self.cache.stop_request(req)
        self._requests = {}

    def observe(self, rows: Sequence[RowState], feedback: Sequence[RowFeedback]) -> None:
        for row in rows:
            tokens = row.tokens.tolist()
            entry = self._requests.get(row.row)
            if entry is None:  # prefill: the prompt (without the first generated token) starts the request
                req = next(self._ids)
                self.cache.start_request(req, tokens[: row.prompt_len])
                entry = (req, row.prompt_len)
            req, known = entry
            if len(tokens) > known:
                self.cache.add_active_response(req, tokens[known:])
            self._requests[row.row] = (req, len(tokens))

    def propose(self, rows: Sequence[RowState]) -> list[DraftTree]:
        out = []
        for row in rows:
            req, _ = self._requests[row.row]
            depth = min(self.max_tree_depth, row.max_depth)
            if depth <= 0:
                out.append(DraftTree.empty())
                continue
            draft = self.cache.speculate(
                req,
                row.tokens.tolist(),
                max_spec_tokens=depth,
                max_spec_factor=MAX_SPEC_FACTOR,
                min_token_prob=MIN_TOKEN_PROB,
                use_tree_spec=True,
            )
            if not draft.token_ids:
                out.append(DraftTree.empty())
                continue
            out.append(
                DraftTree.from_parents(
                    torch.tensor(draft.token_ids, dtype=torch.long),
                    list(draft.parents),
                    sampling=DraftSampling.DETERMINISTIC,
                    scores=torch.tensor(draft.probs, dtype=torch.float32),
                    source="arctic-suffix",
                )
            )
        return out
