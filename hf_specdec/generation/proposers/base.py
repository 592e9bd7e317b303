"""The proposer interface: what every assistant (n-gram, draft model, Medusa, EAGLE, MLP speculator) implements.

The loop owns the target and its cache; a proposer only sees token ids and, if it asks, the target's hidden states
(a draft made of the target's own first layers also reads the target's cache: `ProposerSetup.target_cache`).
One generate() call goes:

    proposer.validate(target)                      # before anything runs: refuse a wrong head / vocabulary
    proposer.start(setup)                          # once per call
    proposer.observe(rows, feedback)               # after prefill: feedback[i].new_tokens = row i's prompt
    loop:
        trees = proposer.propose(rows)             # one DraftTree per active row
        ...target verifies...
        proposer.observe(rows, feedback)           # each row's verdict: accepted nodes, new root, hidden states
    proposer.finish()                              # always called, also after an error

``rows[i].tokens`` always ends with the row's *root*: the last token the target chose, not yet in its KV cache.
The trees a proposer returns hang under that root.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from ..budget import TreeBudgeter
from ..cost_model import PriorCurve, StepCostModel
from ..draft_dtype import draft_dtype
from ..target import TargetCache
from ..tree import DraftSampling, DraftTree


@dataclass
class RowState:
    """One active row as a proposer sees it.

    Attributes:
        row: the row's index in the caller's batch (stable for the whole call).
        tokens: `[n]` int64 committed tokens, prompt included, no padding; ``tokens[-1]`` is the root.
        prompt_len: number of prompt tokens at the start of ``tokens``.
        max_depth: the deepest tree the loop will verify for this row now (remaining token budget - 1).
        free_depth: when the tree budget caps the row below its remaining budget (``max_depth`` 0 while it is
            paused because its drafts stopped paying what proposing costs, 1 while it probes, or one level past its
            last verified tree), the depth it would otherwise have; an assistant that proposes at no cost
            (`Proposer.proposes_for_free`) may still draft that deep. 0 when the row is not capped.
    """

    row: int
    tokens: torch.Tensor
    prompt_len: int
    max_depth: int
    free_depth: int = 0

    @property
    def root(self) -> int:
        return int(self.tokens[-1])


@dataclass
class RowFeedback:
    """What the target decided for one row, handed to `Proposer.observe` (no proposer reconstructs acceptance).

    Attributes:
        new_tokens: `[m]` int64 tokens whose K/V the target just committed: the prompt after prefill; after a step
            the old root followed by the accepted draft tokens.
        accepted: `[a]` int64 indices into the nodes of ``tree`` accepted this step (parents before children, in
            path order); empty after prefill.
        next_token: the new root (the correction or bonus token), equal to the row's ``RowState.root``.
        tree: the tree this row proposed this step, exactly as `Proposer.propose` returned it (None after prefill).
        hidden_states: layer index -> `[m, H]` target hidden states at ``new_tokens`` (keys = the proposer's
            ``hidden_state_layers``), or None when the proposer asked for none.
        verified: `[v]` int64 indices into the nodes of ``tree`` that the target verified, or None when it verified
            all of them (the tree budget and the row's remaining length may cut a tree: a node that was not verified
            was neither accepted nor rejected).
    """

    new_tokens: torch.Tensor
    accepted: torch.Tensor
    next_token: int
    tree: DraftTree | None = None
    hidden_states: dict[int, torch.Tensor] | None = None
    verified: torch.Tensor | None = None

    @property
    def num_accepted(self) -> int:
        """Accepted draft nodes this step."""
        return int(self.accepted.numel())


@dataclass
class ProposerSetup:
    """What a proposer may need to know about this generate() call.

    Attributes:
        target: the target model.
        generation_config: the call's merged `GenerationConfig`.
        do_sample: whether the call samples (proposers that draft by sampling must then fill ``draft_probs``).
        logits_processor: the call's `LogitsProcessorList` (apply it to draft logits that enter a ratio p/q).
        generator: the call's torch.Generator for draft sampling, if any.
        batch_size: number of rows in the call.
        budget: the call's `TreeBudgeter`, the one place trees are sized: a proposer proposes the same tree whether
            or not it cuts (``tree_budget=False`` verifies the trees as proposed), scoring its nodes
            (``DraftTree.scores``) so that the budget can keep those that pay; an assistant choosing between trees
            may ask it what each is worth (`TreeBudgeter.speedup`). Default: one that never cuts, over a fresh
            cost curve (a proposer driven outside ``generate``).
        target_cache: the target's cache, lent to a draft made of the target's own first layers (`TargetCache`);
            None where the loop lends none (a proposer driven outside ``generate``, a tensor-parallel target).
    """

    target: torch.nn.Module
    generation_config: object
    do_sample: bool = False
    logits_processor: object | None = None
    generator: torch.Generator | None = None
    batch_size: int = 1
    extras: dict = field(default_factory=dict)
    budget: TreeBudgeter = field(default_factory=lambda: TreeBudgeter(StepCostModel(), cuts=False))
    target_cache: TargetCache | None = None


class Proposer:
    """Base class of every assistant. Subclasses override `propose` and whatever hooks they need.

    Class attributes:
        sampling: how this proposer chooses children (the verifier picks its rule from each tree's own field;
            this is the default a proposer builds its trees with).
        hidden_state_layers: None if the proposer needs no target hidden states; otherwise indices into
            transformers' ``hidden_states`` tuple (``-1`` = the final, normed hidden state fed to the lm_head; ``k`` =
            the residual stream entering decoder layer ``k``). `observe` gets them as a mapping layer -> `[m, H]`.
        proposes_for_free: proposing costs next to nothing (a lookup, no model pass): inside a `FallbackAssistant`
            it keeps drafting as deep as the row allows where the tree budget paused or capped the row
            (``RowState.free_depth``).

    Instance attribute:
        prior_cost: step costs measured where the proposer's head was trained (a `PriorCurve`), or None: the loop
            hands them to the call's tree budget as its prior cost curve until it has measured this machine.
    """

    sampling: DraftSampling = DraftSampling.DETERMINISTIC
    hidden_state_layers: tuple[int, ...] | None = None
    proposes_for_free: bool = False
    prior_cost: PriorCurve | None = None

    @property
    def budget(self) -> TreeBudgeter | None:
        """The call's tree budget (`ProposerSetup.budget`); None before `start`."""
        return getattr(getattr(self, "setup", None), "budget", None)

    def validate(self, target: torch.nn.Module) -> None:
        """Raise a clear error if this proposer cannot serve ``target`` (vocabulary, hidden size, ...)."""

    def start(self, setup: ProposerSetup) -> None:
        """Called once per generate() call, before the prefill's `observe` (subclasses call it first)."""
        self.setup = setup

    def propose(self, rows: Sequence[RowState]) -> list[DraftTree]:
        """One `DraftTree` per row (an empty tree drafts nothing and costs nothing)."""
        raise NotImplementedError

    def drafting_modules(self) -> tuple[torch.nn.Module, ...]:
        """The modules this call drafts with (after `start`: a head, or its `drafting_head` copy). The loop runs
        their CPU fp32 linears as it runs the target's, on the GEMM form measured fastest for each shape and row
        count (``generation/packed_linears.py``): a tree level of a few rows through MKL's re-packing GEMM cost
        more than the same rows through the few-rows kernel. None by default (a lookup drafts with no module)."""
        return ()

    def observe(self, rows: Sequence[RowState], feedback: Sequence[RowFeedback]) -> None:
        """What the target committed for each row after prefill and after every step.

        Args:
            rows: the rows, already updated (``tokens`` ends with the new root).
            feedback: ``feedback[i]`` is the verdict of ``rows[i]`` (see `RowFeedback`).
        """

    def finish(self) -> None:
        """Release per-call state (caches); called at the end of every call, also after an error."""

    @contextlib.contextmanager
    def claimed(self) -> Iterator[None]:
        """Held by a generate() call for its whole length: an assistant keeps per-call state, so one object cannot
        serve two calls at once (two threads); the second gets a clear error instead of corrupted drafts."""
        lock = self.__dict__.setdefault("_hf_specdec_call_lock", threading.Lock())  # atomic in CPython
        if not lock.acquire(blocking=False):
            if self.__dict__.get("_hf_specdec_call_thread") == threading.get_ident():
                raise RuntimeError(
                    f"this {type(self).__name__} is already in use by another generate call in this same thread (a "
                    "generate call made while one with it runs, e.g. from a streamer or a stopping criterion); an "
                    "assistant keeps per-call state: give the inner call an assistant of its own (one assistant per thread "
                    "and per call)"
                )
            raise RuntimeError(
                f"this {type(self).__name__} is already in use by another generate call (another thread); an "
                "assistant keeps per-call state: create one assistant per thread"
            )
        self.__dict__["_hf_specdec_call_thread"] = threading.get_ident()
        try:
            yield
        finally:
            self.__dict__.pop("_hf_specdec_call_thread", None)
            lock.release()


def checked_proposals(proposer: Proposer, proposed, rows: int) -> list[DraftTree]:
    """What ``proposer.propose`` returned for ``rows`` rows, checked: one `DraftTree` per row, in a list or tuple.
    Anything else is an error naming the proposer's class, the method and what it returned, so that a proposer of
    one's own fails here rather than deep inside the loop."""
    where = f"{type(proposer).__name__}.propose"
    if not isinstance(proposed, (list, tuple)):
        raise TypeError(f"{where} must return a list of one DraftTree per row ({rows} rows), got {_shown(proposed)}")
    if len(proposed) != rows:
        raise ValueError(f"{where} returned {len(proposed)} trees for {rows} rows ({_shown(proposed)}); return one "
                         "DraftTree per row, DraftTree.empty() for a row without a guess")  # fmt: skip
    bad = next((t for t in proposed if not isinstance(t, DraftTree)), None)
    if bad is not None:
        raise TypeError(f"{where} must return DraftTree objects, one per row; it returned {_shown(bad)} among them")
    return list(proposed)


def _shown(value) -> str:
    """``value`` for an error message: its type and a short repr."""
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 80 else text[:77] + '...'}"


def drafting_head(head: torch.nn.Module) -> torch.nn.Module:
    """``head`` as it drafts on this machine: in the dtype `draft_dtype` finds fastest for its weights (a
    cached bf16 copy where this CPU multiplies bf16 faster than fp32, else the head itself; ``head.drafting_copy``).
    Verification is the target's, in its own dtype, so the output does not depend on this choice."""
    param = next((p for p in head.parameters() if p.is_floating_point()), None)
    return head if param is None else head.drafting_copy(draft_dtype(param))
