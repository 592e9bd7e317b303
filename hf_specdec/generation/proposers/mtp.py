"""MTP proposer: a model's own multi-token-prediction layers (`MTPHead`) drafting EAGLE-2 dynamic trees.

An MTP layer reads what an EAGLE-1 head reads: the pair (the target's final normed state at t, token t + 1) and
its own keys and values over the committed pairs, and its output is both the next feature and, through the
model's lm_head, the next token's logits. So `MTPAssistant` is `EagleAssistant` over an `MTPHead`: the life cycle
(binding, the head's `DraftKVCache` slot per row, the queued pairs) is `HiddenStateProposer`'s, the trees are
EAGLE-2's (`expand_dynamic_tree`: the root's top-k, each level the best k of the frontier's top-k children by path
probability, the ``num_nodes`` best kept), in ragged batches. Every level runs MTP layer 0 (see `heads/mtp.py` for
why not layer i at level i). Children are a deterministic top-k, so the trees are `DraftSampling.DETERMINISTIC`
and the verifier keeps sampling exact without draft probabilities; ``scores`` carry the path probabilities the
tree budget cuts by.

transformers drafts with the same layers in a chain at batch 1 (``generate(use_mtp=True)``); here
``assistant="mtp"`` (or an `MTPHead`, or transformers' `MtpModel`) drafts trees for any batch. A model without MTP layers is refused by name.
"""

from __future__ import annotations

import torch
from transformers.modeling_layers import MtpModel

from ...heads.checks import check_tree_sizes
from ...heads.mtp import MTPHead
from ..tree import DraftTree
from .base import Proposer, RowState
from .eagle import EagleAssistant
from .hidden_states import HiddenStateProposer

DEFAULT_TOP_K = 6
DEFAULT_DEPTH = 5
DEFAULT_NUM_NODES = 24


class MTPAssistant(EagleAssistant):
    """Drafts EAGLE-2 dynamic trees with a model's MTP layers (`MTPHead`).

    Args:
        head: the model's MTP layers (``MTPHead.from_model(model)``).
        top_k: children per expanded node and frontier width (default: ``head.tree["top_k"]``, else 6).
        depth: tree depth (default: ``head.tree["depth"]``, else 5).
        num_nodes: nodes per tree at most (default: ``head.tree["num_nodes"]``, else 24).
        step_cost: ``{nodes: cost of a step / a plain decoding step}``: the tree budget's prior cost curve.
    """

    default_top_k, default_num_nodes = DEFAULT_TOP_K, DEFAULT_NUM_NODES

    def __init__(
        self,
        head: MTPHead,
        top_k: int | None = None,
        depth: int | None = None,
        num_nodes: int | None = None,
        step_cost: dict[int, float] | None = None,
    ):
        if not isinstance(head, MTPHead):
            raise TypeError(f"MTPAssistant needs an MTPHead (MTPHead.from_model(model)), got {type(head).__name__}")
        HiddenStateProposer.__init__(self, head, top_k, num_nodes, step_cost)
        self.depth = int(depth or head.tree.get("depth") or DEFAULT_DEPTH)
        check_tree_sizes("MTPAssistant", "the tree", top_k=self.top_k, depth=self.depth, num_nodes=self.num_nodes)

    def __repr__(self) -> str:
        return f"MTPAssistant(top_k={self.top_k}, depth={self.depth}, num_nodes={self.num_nodes})"

    def _layers_before_bind(self, head: MTPHead) -> tuple[int, ...]:
        return head.feature_layers

    def _row_tree(self, row: RowState, score, token, parent, node_depth, keep) -> DraftTree:
        tree = super()._row_tree(row, score, token, parent, node_depth, keep)
        if tree.scores is not None:
            tree.source = "mtp"
        return tree


def mtp_assistant_for(obj, target) -> Proposer | None:
    """``assistant=`` resolver: an `MTPAssistant` when ``obj`` is an `MTPHead`, transformers' `MtpModel` of the
    target, or the string ``"mtp"`` (the target's own MTP layers, loaded once per target and kept beside it); a `NoMTPLayersError` (a ValueError) names
    the target's type when ``"mtp"`` is asked of a model that ships none; else None."""
    if isinstance(obj, MTPHead):
        return MTPAssistant(obj)
    if isinstance(obj, MtpModel):  # transformers' own MTP stack, e.g. MtpModel.from_pretrained(target)
        return MTPAssistant(MTPHead(obj.eval(), str(target.config.model_type)).bind(target))
    if isinstance(obj, str) and obj == "mtp":
        return MTPAssistant(_target_head(target))
    return None


def _target_head(target: torch.nn.Module) -> MTPHead:
    """The target's `MTPHead`, read from its checkpoint on first use and kept on the target (not a submodule)."""
    head = target.__dict__.get("_hf_specdec_mtp_head")
    if head is None:
        head = MTPHead.from_model(target)
        target.__dict__["_hf_specdec_mtp_head"] = head
    return head


__all__ = ["MTPAssistant", "mtp_assistant_for"]
