"""`PlannedModel`: the one owner of planned forwards of a model (the target, or a draft model) over a `PagedCache`.

Every speculative forward goes the same way: build the `AttentionPlan` (reserving the new tokens' slots), run the
model with the plan active in this thread, then decide what the cache keeps (a prefill chunk, accepted tree nodes)
or forget it. The speculative loop, the draft-model assistant, the step-cost measurement and the kernel benchmark
all do it through this class, so none of them touches the cache's allocator or transformers' attention switch::

    with PlannedModel(model) as target:                           # one generate() call
        rows = target.add_rows(2)
        out = target.forward(rows, tokens, positions, q_lens)       # causal chunks (prefill)
        target.commit_chunks(rows, q_lens)
        out = target.forward(rows, tokens, positions, q_lens, masks)  # trees
        target.commit_trees(rows, accepted)

Entering the block chooses the attention backend once for the call (`choose_backend`), makes the model's attention
implementation serve planned forwards (`install_for`: the model and its config are not modified) and, on CPU, runs
the model's linears on pre-packed weights for this thread (`packed_linears`). Leaving it frees every row, also
after an error.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..attention.backend import choose_backend, install_for, planned
from ..attention.plan import AttentionPlan, TailMask, build_plan
from ..attention.unsupported import UnsupportedModelError
from ..cache.paged import PagedCache
from ..text_config import text_config
from .packed_linears import packed_bytes, packed_linears, tuning_calls
from .support import check_config, check_forward, naming_the_model, unclear_failure


@dataclass
class PlannedOutput:
    """What a planned forward returns.

    Attributes:
        logits: `[K, V]` logits at the kept positions (``logits_to_keep``; all `N` packed positions for 0).
        hidden_states: layer -> `[N, H]` hidden states of every packed position (transformers' ``hidden_states``
            indices), or None when none were asked for.
        cu_seqlens: `[B + 1]` int64 (CPU) offsets of each row's tokens in the packed batch.
        tuned: whether CPU linears of this forward ran as timed trials of their GEMM forms (its first calls at a new
            row count): its time is then no fair sample of what such a forward costs.
    """

    logits: torch.Tensor
    hidden_states: dict[int, torch.Tensor] | None
    cu_seqlens: torch.Tensor
    tuned: bool = False


class PlannedModel:
    """Planned forwards of ``model`` over its own `PagedCache` (or one it is lent), for the length of one ``with``
    block.

    Args:
        model: a transformers causal LM.
        backend: ``"triton"``, ``"torch"`` or None (``HF_SPECDEC_ATTENTION``, else automatic; see `choose_backend`).
        block_size: tokens per cache block.
        pack_linears: run the model's CPU fp32 linears on pre-packed weights in this thread (None: when it pays and
            memory allows; see ``generation/packed_linears.py``).
        keep_packed: what happens to the packed copies when the block exits (``generate(..., keep_packed=...)``):
            None (default) keeps those made for the model's later calls, True also packs from the first verify
            forward, False releases them (`packed_linears`' ``keep``).
        lent_cache: another `PlannedModel` whose cache this one writes and reads instead of its own (a layer-skip
            draft, ``model`` being the first layers of the lender's model: its layer ``i`` is the lender's layer
            ``i``). Its backend and rows are the lender's; this one commits nothing there (its tokens stay pending
            until the lender's next forward writes over them) and frees none of its rows.
    """

    def __init__(
        self,
        model,
        *,
        backend: str | None = None,
        block_size: int = 16,
        pack_linears: bool | None = None,
        keep_packed: bool | None = None,
        lent_cache: PlannedModel | None = None,
    ):
        self.model = model
        self.device = next(model.parameters()).device
        self._owns_cache = lent_cache is None
        if lent_cache is not None:
            self.backend, self.cache = lent_cache.backend, lent_cache.cache
        else:
            self.backend = choose_backend(self.device, backend)
            # the torch path reads each row's K/V as SDPA's [H_kv, L, D]: head-major pools make that a unit-stride view
            self.cache = PagedCache(model.config, block_size=block_size, head_major=self.backend == "torch")
        self._pack_linears = pack_linears
        self._keep_packed = keep_packed
        self._stack: contextlib.ExitStack | None = None
        self._checked = False  # the first forward checks the model (generation/support.py)

    # ------------------------------------------------------------------ call scope
    def __enter__(self) -> PlannedModel:
        install_for(self.model)
        stack = contextlib.ExitStack()
        stack.enter_context(packed_linears(self.model, enabled=self._pack_linears, keep=self._keep_packed))
        self._stack = stack
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Free every row of its own cache and leave the call scope (idempotent)."""
        for row in range(self.cache.num_rows if self._owns_cache else 0):
            self.free(row)
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()

    def packed_bytes(self) -> int:
        """Bytes the model's pre-packed CPU weights hold now (0 when none; see ``generation/packed_linears.py``)."""
        return packed_bytes(self.model)

    # ------------------------------------------------------------------ rows
    def add_rows(self, n: int) -> list[int]:
        """``n`` new empty cache rows; returns their indices."""
        return self.cache.add_rows(n)

    def length(self, row: int) -> int:
        """Committed tokens of ``row``."""
        return self.cache.length(row)

    def lengths(self, rows: Sequence[int] | np.ndarray) -> np.ndarray:
        """`[B]` committed tokens of ``rows`` (host int64)."""
        return self.cache.lengths_of(np.asarray(rows, dtype=np.int64))

    def is_active(self, row: int) -> bool:
        return self.cache.is_active(row)

    def free(self, row: int) -> None:
        """Give ``row``'s blocks back (no-op if already freed)."""
        if self.cache.is_active(row):
            self.cache.free(row)

    def commit_chunks(self, rows: Sequence[int], counts: Sequence[int]) -> None:
        """Keep the ``counts[i]`` tokens the last forward wrote after each row's committed prefix."""
        self.cache.commit_chunks(np.asarray(rows, dtype=np.int64), np.asarray(counts, dtype=np.int64))

    def commit_trees(self, rows: Sequence[int], accepted: Sequence[torch.Tensor]) -> None:
        """Keep the accepted tree positions of each row (per row `[1 + a]`, root first; see `PagedCache.commit`)."""
        self.cache.commit(rows, accepted, use_triton=self.backend == "triton")

    def rollback(self, row: int, length: int) -> None:
        """Forget everything of ``row`` past ``length`` tokens."""
        self.cache.rollback(row, length)

    # ------------------------------------------------------------------ forwards
    def _check_first_forward(self, plan: AttentionPlan) -> None:
        """After the call's first forward: the model's every layer ran the plan's attention once, nothing stateful
        beside it (``generation/support.py``), else a refusal naming what is unsupported."""
        check_forward(
            self.model,
            plan.attention_modules,
            len(self.cache.layers) if self._owns_cache else int(text_config(self.model).num_hidden_layers),
            plan.attention_windows,
            plan.mask_windows,
            plan.state_modules,
        )
        self._checked = True

    def plan(
        self,
        rows: Sequence[int],
        positions: torch.Tensor,
        q_lens: Sequence[int],
        masks: TailMask | Sequence[torch.Tensor | None] | None = None,
        pending_lens: Sequence[int] | None = None,
    ) -> AttentionPlan:
        """The `AttentionPlan` of a forward (reserves its slots; see `build_plan`)."""
        return build_plan(self.cache, rows, q_lens, positions, masks, self.device, pending_lens, self.backend)

    def forward(
        self,
        rows: Sequence[int],
        tokens: torch.Tensor,
        positions: torch.Tensor,
        q_lens: Sequence[int],
        masks: TailMask | Sequence[torch.Tensor | None] | None = None,
        *,
        pending_lens: Sequence[int] | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        hidden_layers: Sequence[int] | None = None,
    ) -> PlannedOutput:
        """One packed forward of ``q_lens[b]`` new tokens for each of ``rows``.

        Args:
            rows: `[B]` cache rows.
            tokens: `[N]` int64 packed new tokens (row after row).
            positions: `[N]` int64 their position ids.
            q_lens: `[B]` new tokens per row (sums to N).
            masks: the `TailMask` of the forward (bit-packed, on the model's device: the hot path), or per row a
                `[n, pending + n]` bool visibility of its tail / None for a causal chunk; default all causal.
            pending_lens: `[B]` uncommitted tokens already written after each row's prefix (a draft model's tree).
            logits_to_keep: 0 for logits at every position, or `[K]` packed positions to keep.
            hidden_layers: indices into transformers' ``hidden_states`` to return (None: none).
        Returns:
            a `PlannedOutput`. The cache holds the new tokens' K/V uncommitted until `commit_chunks` /
            `commit_trees`.
        """
        if self._stack is None:
            raise RuntimeError("PlannedModel.forward runs inside its call scope: use `with PlannedModel(model) as m:`")
        plan = self.plan(rows, positions, q_lens, masks, pending_lens)
        trials = tuning_calls()
        first = plan.checking = not self._checked
        if first:
            check_config(self.model)
        with planned(plan):
            try:
                out = self.model(
                    input_ids=tokens[None],
                    position_ids=plan.positions[None],
                    use_cache=False,
                    logits_to_keep=logits_to_keep,
                    output_hidden_states=bool(hidden_layers),
                )
            except UnsupportedModelError as exc:
                raise naming_the_model(self.model, exc) from exc
            except Exception as exc:
                if first and not isinstance(exc, NotImplementedError):
                    raise unclear_failure(self.model, exc) from exc
                raise
        if first:
            self._check_first_forward(plan)
        hidden = None
        if hidden_layers:
            hidden = {layer: out.hidden_states[layer][0] for layer in hidden_layers}  # layer -> [N, H]
        cu = torch.from_numpy(plan.cu_seqlens)
        return PlannedOutput(out.logits[0], hidden, cu, tuning_calls() != trials)  # logits [K, V]


@dataclass(frozen=True)
class TargetCache:
    """The target's planned forwards and each batch row's cache row, lent for one generate call to a draft made of
    the target's own first layers (`ProposerSetup.target_cache`): the keys and values of those layers for every
    committed token are the target's, written by its verify forwards, so the draft keeps no cache of its own.

    Attributes:
        planned: the target's `PlannedModel` (a draft's forwards are ``PlannedModel(draft, lent_cache=planned)``).
        rows: `[B]` the cache row of each batch row (host ints).
    """

    planned: PlannedModel
    rows: tuple[int, ...]


__all__ = ["PlannedModel", "PlannedOutput", "TailMask", "TargetCache"]
