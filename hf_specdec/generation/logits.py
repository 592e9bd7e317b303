"""The one place where transformers' logits processors are applied to tree nodes.

Vanilla `generate` applies its `LogitsProcessorList` to the logits of the next position with the row's context
(`input_ids` including any left padding). On a tree, every node has its own context: the row's context followed by
the path from the root's child down to the node. `NodeScorer` applies the processors to all nodes of a tree with
those contexts, grouping the nodes by depth so each group is one rectangular batch.

Only processors whose output depends on nothing but the context and the logits can be applied per node. They are
listed in `PER_NODE_PROCESSORS`; anything else is refused with an error that names it (never silently ignored).
Users with a custom processor that is a pure function of (input_ids, scores) can declare it with
`register_per_node_processor`.
"""

from __future__ import annotations

import copy

import torch
from transformers import generation as hf_generation
from transformers.generation import LogitsProcessorList

from .tree import DraftTree

_SAFE_NAMES = [
    "MinLengthLogitsProcessor",
    "MinNewTokensLengthLogitsProcessor",
    "TemperatureLogitsWarper",
    "RepetitionPenaltyLogitsProcessor",
    "TopPLogitsWarper",
    "TopKLogitsWarper",
    "TopHLogitsWarper",
    "MinPLogitsWarper",
    "TypicalLogitsWarper",
    "EpsilonLogitsWarper",
    "EtaLogitsWarper",
    "NoRepeatNGramLogitsProcessor",
    "SequenceBiasLogitsProcessor",
    "NoBadWordsLogitsProcessor",
    "ForcedBOSTokenLogitsProcessor",
    "ForcedEOSTokenLogitsProcessor",
    "InfNanRemoveLogitsProcessor",
    "ExponentialDecayLengthPenalty",
    "LogitNormalization",
    "SuppressTokensAtBeginLogitsProcessor",
    "SuppressTokensLogitsProcessor",
]
#: Processor classes that are pure functions of (context, logits) and so can be applied node by node.
PER_NODE_PROCESSORS: set[type] = {getattr(hf_generation, n) for n in _SAFE_NAMES if hasattr(hf_generation, n)}

_WHY_NOT = {
    "PrefixConstrainedLogitsProcessor": "it calls prefix_allowed_tokens_fn with the batch index",
    "ClassifierFreeGuidanceLogitsProcessor": "classifier-free guidance needs a second, unconditional forward",
    "UnbatchedClassifierFreeGuidanceLogitsProcessor": "classifier-free guidance needs a second, unconditional forward",
    "WatermarkLogitsProcessor": "watermarking is not supported with speculative decoding yet",
    "SynthIDTextWatermarkLogitsProcessor": "its watermark state is per batch row, not per tree node",
}


def register_per_node_processor(cls: type) -> type:
    """Declare a custom `LogitsProcessor` class as a pure function of ``(input_ids, scores)`` (usable as decorator)."""
    PER_NODE_PROCESSORS.add(cls)
    return cls


def check_per_node(processors: LogitsProcessorList | None) -> None:
    """Raise if a processor cannot be applied per tree node."""
    for proc in processors or []:
        if type(proc) in PER_NODE_PROCESSORS:
            continue
        name = type(proc).__name__
        why = _WHY_NOT.get(name, "hf_specdec cannot tell whether it depends only on each sequence's own tokens")
        raise ValueError(
            f"logits processor {name} cannot be used with an assistant: {why}. If it is a pure function of "
            f"(input_ids, scores), declare it with hf_specdec.register_per_node_processor({name})."
        )


class NodeScorer:
    """Applies the call's logits processors to every position of a draft tree, each with its own context."""

    def __init__(self, processors: LogitsProcessorList | None):
        check_per_node(processors)
        self.processors = processors if processors else None
        self._per_row: dict[int, LogitsProcessorList] = {}

    def for_row(self, row: int) -> LogitsProcessorList | None:
        """The processors as row ``row`` of the batch sees them (batch-indexed state sliced to that row)."""
        if self.processors is None:
            return None
        if row not in self._per_row:
            procs = LogitsProcessorList()
            for proc in self.processors:
                ignore = getattr(proc, "prompt_ignore_length", None)
                if isinstance(proc, hf_generation.RepetitionPenaltyLogitsProcessor) and isinstance(
                    ignore, torch.Tensor
                ):
                    proc = copy.copy(proc)
                    proc.prompt_ignore_length = int(ignore.reshape(-1)[row])  # this row's left padding
                procs.append(proc)
            self._per_row[row] = procs
        return self._per_row[row]

    @property
    def is_identity(self) -> bool:
        return self.processors is None

    def __call__(self, context: torch.Tensor, tree: DraftTree, logits: torch.Tensor, row: int = 0) -> torch.Tensor:
        """Processed scores at every tree position.

        Args:
            context: `[C]` the row's context as vanilla generate sees it (left padding included), ending with the root.
            tree: the row's draft tree.
            logits: `[T + 1, V]` the target's raw logits at the root and every node.
            row: the row's index in the caller's batch.
        Returns:
            `[T + 1, V]` float32 scores.
        """
        scores = logits.float()
        if self.processors is None:
            return scores
        processors = self.for_row(row)
        out = torch.empty_like(scores)
        out[:1] = _apply(processors, context[None], scores[:1].clone())
        if tree.num_nodes == 0:
            return out
        anc = tree.ancestor_mask()[1:, 1:]  # [T, T] node-to-node ancestry
        node_tokens = tree.tokens.to(context.device)
        depth = tree.depth.tolist()
        for d in sorted(set(depth)):
            idx = torch.tensor([i for i, x in enumerate(depth) if x == d], dtype=torch.long)
            # tokens of each node's path, root's child first: every row of anc[idx] holds exactly d ancestors-or-self
            path = node_tokens.expand(idx.numel(), -1)[anc[idx].to(context.device)].view(idx.numel(), d)
            ids = torch.cat([context.expand(idx.numel(), -1), path], dim=1)
            pos = (idx + 1).to(scores.device)
            out[pos] = _apply(processors, ids, scores[pos].clone())
        return out


def _apply(processors: LogitsProcessorList, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """`LogitsProcessorList.__call__` without its per-call signature inspection (our processors take no kwargs)."""
    for proc in processors:
        scores = proc(input_ids, scores)
    return scores
