"""The speculative decoding loop: prefill, then `_step` (propose -> verify in one forward -> commit -> feed back ->
emit) until every row is done.

`generate` has the signature of a transformers ``custom_generate`` callable: transformers' own `generate` prepares the
generation config, the logits processors and the stopping criteria exactly as for vanilla decoding, then calls it.
``import hf_specdec`` routes ``model.generate(..., assistant=X)`` here (see `hook`).

Rows are packed, not padded: tokenizer padding is stripped at entry, each row keeps its own length in the target's
`PagedCache` (owned by a `PlannedModel`), and every forward feeds ``[root, nodes...]`` of every active row back to
back. Prefill and steps end the same way (`_settle`): emit each row's new tokens, free finished rows, tell the
proposer what was committed.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers.generation import (
    EosTokenCriteria,
    GenerateDecoderOnlyOutput,
    LogitsProcessorList,
    MaxLengthCriteria,
    StoppingCriteriaList,
)

from ..text_config import text_config
from .budget import TreeBudgeter, carried_calibration, keep_calibration
from .cost_model import cost_model_for, save_learnt_curve
from .gemm_cache import load_gemm_choices, save_gemm_choices
from .inputs import check_generator, prompt_starts, validate_call
from .logits import NodeScorer
from .packed_linears import packed_linears, tuning_calls
from .proposers import as_proposer
from .proposers.base import Proposer, ProposerSetup, RowFeedback, RowState, checked_proposals
from .stats import SpecStats
from .target import PlannedModel, PlannedOutput, TailMask, TargetCache
from .tensor_parallel import agreed_seconds, check_same_trees, tp_group
from .tree import DraftTree, pack_trees
from .verify import Verdict, sample_from_scores, verify_tree

_INITIAL_ROOM = 256  # generated tokens a row's buffer holds before it first grows


@dataclass
class _Row:
    """Book-keeping of one row of the caller's batch."""

    index: int
    buf: torch.Tensor  # [capacity >= length] vanilla's view of the row: left padding, prompt, generated tokens
    start: int  # first non-pad index in buf
    length: int  # filled length of buf (padded prompt + generated)
    prompt_width: int  # padded prompt width W
    cache_row: int = -1
    root: int = -1  # the last token (the next tree's root), kept on the host so no step reads it back
    finished: bool = False  # no longer decoded
    # generated length when a stopping criterion fired (vanilla's ``unfinished_sequences`` turned 0); a row whose
    # call has no EOS criterion keeps decoding after it, as vanilla does
    done_at: int | None = None
    scores: list[torch.Tensor] = field(default_factory=list)  # per generated token [V] processed scores, if kept
    logits: list[torch.Tensor] = field(default_factory=list)  # per generated token [V] raw logits, if kept

    @property
    def tokens(self) -> torch.Tensor:
        """`[n]` prompt + generated, no padding (last = root)."""
        return self.buf[self.start : self.length]

    @property
    def context(self) -> torch.Tensor:
        """`[W + g]` what vanilla's logits processors and stopping criteria see for this row."""
        return self.buf[: self.length]

    @property
    def generated(self) -> torch.Tensor:
        """`[g]` the generated tokens."""
        return self.buf[self.prompt_width : self.length]

    def append(self, token: int) -> None:
        """Append one generated token, doubling the buffer when it is full (memory follows what was generated,
        not ``max_new_tokens``)."""
        if self.length == self.buf.numel():
            grown = self.buf.new_zeros(2 * self.buf.numel())
            grown[: self.length] = self.buf
            self.buf = grown
        self.buf[self.length] = token
        self.length += 1
        self.root = token


class _StopChecker:
    """Applies the call's stopping criteria to one row at a time, token by token (fast paths for length and EOS)."""

    def __init__(self, criteria: StoppingCriteriaList | None):
        self.max_length: int | None = None
        self.eos: set[int] = set()
        self.others = StoppingCriteriaList()
        # vanilla's MaxLengthCriteria warns (once) when a row runs past the model's max_position_embeddings
        self.long_warning: MaxLengthCriteria | None = None
        for c in criteria or []:
            if isinstance(c, MaxLengthCriteria):
                self.max_length = c.max_length if self.max_length is None else min(self.max_length, c.max_length)
                if getattr(c, "max_position_embeddings", None) is not None:
                    self.long_warning = c
            elif isinstance(c, EosTokenCriteria):
                self.eos |= set(torch.as_tensor(c.eos_token_id).reshape(-1).tolist())
            else:
                self.others.append(c)
        # vanilla pads a finished row only when an EOS criterion is present; without one it keeps decoding it
        self.has_eos = bool(self.eos) or any(hasattr(c, "eos_token_id") for c in self.others)

    def __call__(self, context: torch.Tensor, token: int) -> bool:
        """Whether the row stops after ``context`` `[L]` (which ends with ``token``)."""
        if self.long_warning is not None and context.numel() > self.long_warning.max_position_embeddings:
            self.long_warning(context[None], None)  # vanilla's own warning, word for word (logged once)
        if token in self.eos:
            return True
        if self.max_length is not None and context.numel() >= self.max_length:
            return True
        if self.others:
            return bool(self.others(context[None], None).any())
        return False


@dataclass
class _RowResult:
    """What one forward decided for one row: the tokens to append and what the proposer is told.

    ``scores`` / ``logits`` are `[k, V]` (one per token to append) or None when the call does not return them.
    """

    row: _Row
    tokens: list[int]
    scores: torch.Tensor | None
    logits: torch.Tensor | None
    feedback: RowFeedback


@dataclass
class _Call:
    """Everything fixed for one generate() call."""

    model: torch.nn.Module
    target: PlannedModel
    proposer: Proposer
    scorer: NodeScorer
    stopper: _StopChecker
    max_length: int
    do_sample: bool
    generator: torch.Generator | None
    verify_kwargs: dict
    want_scores: bool
    want_logits: bool
    streamer: object | None
    budget: TreeBudgeter
    stats: SpecStats = field(default_factory=SpecStats)
    tp_group: object | None = None  # the ranks of a tensor-parallel target, which decide every step alike

    @property
    def layers(self) -> tuple[int, ...] | None:
        return self.proposer.hidden_state_layers or None


@torch.no_grad()
def generate(
    model,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList | None = None,
    stopping_criteria: StoppingCriteriaList | None = None,
    generation_config=None,
    assistant=None,
    generator: torch.Generator | None = None,
    acceptance: str = "exact",
    typical_epsilon: float = 0.09,
    typical_delta: float = 0.3,
    hf_specdec_streamer=None,
    keep_packed: bool | None = None,
    tree_budget: bool | TreeBudgeter = True,
    **model_kwargs,
):
    """Speculative decoding with ``assistant`` (a transformers ``custom_generate`` callable).

    Usually reached as ``model.generate(ids, assistant=X, ...)`` after ``import hf_specdec``, or as
    ``model.generate(ids, custom_generate=hf_specdec.generate, assistant=X, ...)``.

    Args:
        model: the target causal LM.
        input_ids: `[B, W]` prompts, left-padded when rows differ in length (with ``attention_mask``).
        logits_processor / stopping_criteria / generation_config: prepared by transformers' `generate`.
        assistant: a `Proposer`, a `PreTrainedModel` draft model, or a head (see `as_proposer`).
        generator: optional torch.Generator for reproducible sampling.
        acceptance: ``"exact"`` (lossless; default) or ``"typical"`` (Medusa's typical acceptance with
            ``typical_epsilon`` / ``typical_delta``: faster at high temperature but it does NOT preserve the target's
            distribution). Only used when sampling.
        hf_specdec_streamer: the ``streamer=`` of ``model.generate`` (the hook passes it under this name, because
            transformers does not forward a streamer to a ``custom_generate`` callable).
        keep_packed: on CPU, the target's pre-packed linear weights after the call: None (default) keeps the copies
            the call made for later calls (until ``hf_specdec.release_packed_weights(model)``, or the weights change
            or are freed), True also packs from the first verify forward, False releases them when the call ends;
            see ``generation/packed_linears.py`` and `hf_specdec.packed_weights`.
        tree_budget: size every row's tree each step from the verify cost measured on this machine and the
            assistant's acceptance estimates (a `TreeBudgeter`, the default and the one place trees are sized;
            drafting nothing is always one of the options); False verifies the trees exactly as the assistant
            proposes them, and changes nothing else; a `TreeBudgeter` instance is used as given (its calibration
            carries over between calls).
    Returns:
        `[B, W + G]` token ids like vanilla `generate`, or a `GenerateDecoderOnlyOutput` with an extra
        ``spec_stats`` attribute when ``return_dict_in_generate=True``.
    """
    generation_config = generation_config if generation_config is not None else model.generation_config
    if assistant is None:
        raise ValueError("hf_specdec.generate needs an assistant: model.generate(ids, assistant=...)")
    proposer: Proposer = as_proposer(assistant, model)
    # the claim comes first: validate() may resolve and bind parts of a shared assistant, which must not happen
    # while another thread's call uses it (that call's claim refuses this one before anything is touched)
    with proposer.claimed():
        stopper, max_length, rows = _checked_call(
            model, input_ids, proposer, generation_config, stopping_criteria, hf_specdec_streamer, model_kwargs,
            generator,
        )  # fmt: skip
        return _run(
            model, input_ids, proposer, stopper, max_length, rows, generation_config, logits_processor, generator,
            acceptance, typical_epsilon, typical_delta, hf_specdec_streamer, keep_packed, tree_budget,
            model_kwargs.get("attention_mask"),
        )  # fmt: skip


def _run(
    model, input_ids, proposer, stopper, max_length, rows, generation_config, logits_processor, generator,
    acceptance, typical_epsilon, typical_delta, hf_specdec_streamer, keep_packed, tree_budget, attention_mask,
):  # fmt: skip
    """Prefill and steps of a checked call whose ``proposer`` is claimed; returns vanilla's return value."""
    returns = bool(generation_config.return_dict_in_generate)
    if hf_specdec_streamer is not None:
        hf_specdec_streamer.put(input_ids.cpu())
    load_gemm_choices()  # the GEMM forms an earlier process measured here (read once per process)
    with PlannedModel(model, keep_packed=keep_packed) as target:
        call = _Call(
            model=model,
            target=target,
            proposer=proposer,
            scorer=NodeScorer(logits_processor),
            stopper=stopper,
            max_length=max_length,
            do_sample=bool(generation_config.do_sample),
            generator=generator,
            verify_kwargs=dict(acceptance=acceptance, typical_epsilon=typical_epsilon, typical_delta=typical_delta),
            want_scores=returns and bool(generation_config.output_scores),
            want_logits=returns and bool(generation_config.output_logits),
            streamer=hf_specdec_streamer,
            budget=_tree_budget(tree_budget, model, proposer),
            tp_group=tp_group(model),
        )
        call.budget.tp_group = call.tp_group  # the ranks agree on what proposing costs, as on the step's times
        for row, cache_row in zip(rows, target.add_rows(len(rows))):
            row.cache_row = cache_row
        try:
            proposer.start(_setup(call, generation_config, logits_processor, rows))
            with _drafting_linears(proposer):
                _prefill(call, rows)
                while (active := [r for r in rows if not r.finished]) and any(r.done_at is None for r in rows):
                    _step(call, active)
            _cut_to_vanilla_length(rows)
            call.stats.packed_weight_bytes = target.packed_bytes()
            save_learnt_curve(call.budget.cost)  # for the next process on this machine (throttled; never raises)
            save_gemm_choices()  # likewise
            if tree_budget is True:
                keep_calibration(model, call.budget.calibration)
        finally:
            proposer.finish()
    if hf_specdec_streamer is not None:
        hf_specdec_streamer.end()
    if call.want_scores or call.want_logits:
        _score_finished_rows(call, rows, attention_mask, _pad_id(generation_config))
    return _output(call, input_ids, rows, generation_config)


@contextlib.contextmanager
def _drafting_linears(proposer: Proposer):
    """The CPU fp32 linears of what ``proposer`` drafts with (`Proposer.drafting_modules`) on the GEMM forms
    measured fastest here, as the target's run (`packed_linears`), until the block exits. A head's copies are kept
    while the head lives (`release_packed_weights(head)` frees them): they are the head's size again, a few percent of
    the target's, and made again on every call they would cost more than the head's drafting saves (packing fresh
    memory is slow where page faults are: docs/lab/measurements.md)."""
    with contextlib.ExitStack() as stack:
        for module in dict.fromkeys(proposer.drafting_modules()):  # a head two proposers share is patched once
            stack.enter_context(packed_linears(module, keep=True))
        yield


def _checked_call(
    model, input_ids, proposer: Proposer, generation_config, stopping_criteria, streamer, model_kwargs, generator=None
):
    """Everything checked before the model runs: the inputs, the options, the (claimed) assistant against the model.

    Returns:
        the stop checker, the max length and one `_Row` per row of `[B, W]` ``input_ids``.
    """
    validate_call(model, input_ids, generation_config, model_kwargs)
    check_generator(generator, model)
    if streamer is not None and input_ids.shape[0] > 1:
        raise ValueError("streamers support batch size 1 only (as in vanilla generate)")
    proposer.validate(model)
    stopper = _StopChecker(stopping_criteria)
    max_length = stopper.max_length if stopper.max_length is not None else generation_config.max_length
    if max_length is None:
        raise ValueError("set max_new_tokens or max_length")
    # vanilla takes a fractional max_new_tokens (2.5): max_length = W + 2.5, and a row stops once its length reaches
    # it, i.e. at the next whole length
    max_length = math.ceil(max_length)
    rows = _rows_from_input(input_ids, model_kwargs.get("attention_mask"), max(0, max_length - input_ids.shape[1]))
    return stopper, max_length, rows


def _setup(call: _Call, generation_config, logits_processor, rows: Sequence[_Row]) -> ProposerSetup:
    return ProposerSetup(
        target=call.model,
        generation_config=generation_config,
        do_sample=call.do_sample,
        logits_processor=logits_processor,
        generator=call.generator,
        batch_size=len(rows),
        budget=call.budget,
        # a draft made of the target's first layers reads their keys and values from the target's cache; a
        # tensor-parallel target's cache holds each rank's heads only
        target_cache=None if call.tp_group is not None else TargetCache(call.target, tuple(r.cache_row for r in rows)),
    )


def _rows_from_input(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, max_new: int) -> list[_Row]:
    """One `_Row` per prompt of the left-padded `[B, W]` ``input_ids``, with room for ``max_new`` tokens at most
    `_INITIAL_ROOM` to start with (a row's buffer grows as it generates: `_Row.append`)."""
    width = input_ids.shape[1]
    rows = []
    for b, start in enumerate(prompt_starts(input_ids, attention_mask)):
        buf = torch.zeros(width + min(max_new, _INITIAL_ROOM), dtype=torch.long, device=input_ids.device)
        buf[:width] = input_ids[b]
        rows.append(_Row(index=b, buf=buf, start=start, length=width, prompt_width=width))
    return rows


def _prefill(call: _Call, rows: Sequence[_Row]) -> None:
    """Every prompt in one packed forward (causal per row), then each row's first token."""
    t0 = time.perf_counter()
    device = rows[0].buf.device
    prompts = [r.tokens for r in rows]  # per row [n]
    q_lens = [p.numel() for p in prompts]
    positions = torch.cat([torch.arange(n, device=device) for n in q_lens])  # [N]
    last = torch.tensor(q_lens, device=device).cumsum(0) - 1  # [B] each prompt's last packed position
    cache_rows = [r.cache_row for r in rows]
    out = call.target.forward(
        cache_rows, torch.cat(prompts), positions, q_lens, logits_to_keep=last, hidden_layers=call.layers
    )
    call.target.commit_chunks(cache_rows, q_lens)  # the prompts are committed
    no_nodes = torch.zeros(0, dtype=torch.long, device=device)
    results = []
    for b, r in enumerate(rows):
        raw = out.logits[b : b + 1]  # [1, V]
        scores = call.scorer(r.context, DraftTree.empty(device), raw, r.index)  # [1, V]
        tok = int(sample_from_scores(scores, call.generator)[0]) if call.do_sample else int(scores[0].argmax())
        hidden = _hidden_at(out, slice(int(out.cu_seqlens[b]), int(out.cu_seqlens[b + 1])))
        feedback = RowFeedback(prompts[b], no_nodes, tok, None, hidden)
        results.append(_kept(call, _RowResult(r, [tok], scores, raw, feedback)))
    call.stats.time_verify += time.perf_counter() - t0
    _settle(call, results)


def _step(call: _Call, active: Sequence[_Row]) -> None:
    """One speculative step of the active rows: propose, verify in one forward, commit, settle."""
    tuning = tuning_calls()  # a draft head's GEMMs timing slower forms make no fair sample of its cost
    t0 = time.perf_counter()
    proposed = call.proposer.propose(_row_states(active, call.max_length, call.budget))
    t_propose = time.perf_counter() - t0
    propose_tuned = tuning_calls() != tuning
    t0 = time.perf_counter()
    proposed = checked_proposals(call.proposer, proposed, len(active))
    trees, kept = zip(*[_sanitize(t, r, call) for t, r in zip(proposed, active)])
    trees, kept = _budgeted(call.budget, active, trees, kept)
    if call.tp_group is not None:
        check_same_trees(call.tp_group, trees, type(call.proposer).__name__)
    t1 = time.perf_counter()
    out, scores, verdicts = _verify(call, active, trees)
    call.target.commit_trees([r.cache_row for r in active], [v.accepted for v in verdicts])
    t_verify = time.perf_counter() - t1
    tuning = tuning_calls()  # the verify forward's own trials are `out.tuned`
    results = []
    for b, (r, tree, v) in enumerate(zip(active, trees, verdicts)):
        call.stats.record_step(tree.num_nodes, v.num_accepted)
        nodes = v.accepted[1:] - 1  # [a] accepted nodes of the verified tree
        drafted = tree.tokens[nodes.to(tree.device)].tolist()
        where = v.accepted + int(out.cu_seqlens[b])  # [1 + a] packed positions of root + accepted nodes
        new_tokens = torch.tensor([r.root, *drafted], dtype=torch.long, device=r.buf.device)
        accepted = nodes if kept[b] is None else kept[b][nodes.to(kept[b].device)]  # in the proposed tree
        feedback = RowFeedback(new_tokens, accepted, v.next_token, proposed[b], _hidden_at(out, where), kept[b])
        sel = where.to(out.logits.device)
        results.append(_kept(call, _RowResult(r, [*drafted, v.next_token], scores[sel], out.logits[sel], feedback)))
    call.budget.record_verdicts([v.accepted[1:] - 1 for v in verdicts])
    _settle(call, results)
    t_other = time.perf_counter() - t0 - t_verify
    call.stats.time_propose += t_propose
    call.stats.time_verify += t_verify
    call.stats.time_other += t_other
    tokens = sum(t.num_nodes + 1 for t in trees)
    other_tuned = tuning_calls() != tuning  # a head's GEMMs in the feedback (DFlash's context)
    times = (None if out.tuned else t_verify, None if propose_tuned else t_propose, None if other_tuned else t_other)
    if call.tp_group is not None:  # every rank's budget learns the same times, so it cuts the same trees
        times = agreed_seconds(call.tp_group, *times)
    call.budget.record_step(tokens, len(active), *times)


def _tree_budget(tree_budget: bool | TreeBudgeter, model, proposer: Proposer) -> TreeBudgeter:
    """The call's budgeter: a fresh one on the model's shared cost curve (cutting the trees, or with
    ``tree_budget=False`` verifying them as proposed), or the caller's own. The assistant's prior step costs
    (`Proposer.prior_cost`) stand in for this machine's until it has measured them."""
    if isinstance(tree_budget, TreeBudgeter):
        budget = tree_budget
    elif tree_budget in (True, False, None):
        budget = TreeBudgeter(cost_model_for(model), calibration=carried_calibration(model), cuts=bool(tree_budget))
    else:
        raise TypeError(f"tree_budget must be True, False or a TreeBudgeter, got {type(tree_budget).__name__}")
    if proposer.prior_cost is not None:
        budget.cost.set_prior(proposer.prior_cost)
    return budget


def _budgeted(
    budget: TreeBudgeter, active: Sequence[_Row], trees: Sequence[DraftTree], kept: Sequence[torch.Tensor | None]
) -> tuple[list[DraftTree], list[torch.Tensor | None]]:
    """Each row's tree cut to the budget, and `[T']` the proposed tree's index of each kept node (None: all)."""
    cuts = budget.cut_trees([r.index for r in active], trees)
    out_kept = []
    for cut, k in zip(cuts, kept):
        if cut.kept is None or k is None:
            out_kept.append(k if cut.kept is None else cut.kept)
        else:
            out_kept.append(k[cut.kept.to(k.device)])
    return [c.tree for c in cuts], out_kept


def _kept(call: _Call, result: _RowResult) -> _RowResult:
    """Drop the scores / logits the call does not return."""
    result.scores = result.scores if call.want_scores else None
    result.logits = result.logits if call.want_logits else None
    return result


def _settle(call: _Call, results: Sequence[_RowResult]) -> None:
    """After prefill or a step: emit each row's tokens, free finished rows, tell the proposer what was committed."""
    for res in results:
        _emit(call, res)
    for res in results:
        if res.row.finished:
            call.target.free(res.row.cache_row)
    rows = [res.row for res in results]
    call.proposer.observe(_row_states(rows, call.max_length), [res.feedback for res in results])


def _emit(call: _Call, res: _RowResult) -> None:
    """Append ``res.tokens`` to the row until a stopping criterion fires; stream what was appended.

    Without an EOS criterion vanilla keeps decoding a row whose criteria fired (its tokens are not replaced by pad):
    such a row stays active while another row is not done (`_cut_to_vanilla_length` trims it at the end).
    """
    row, n, shown = res.row, 0, 0
    for i, tok in enumerate(res.tokens):
        row.append(tok)
        n += 1
        shown += row.done_at is None
        if res.scores is not None:
            row.scores.append(res.scores[i])
        if res.logits is not None:
            row.logits.append(res.logits[i])
        stopped = row.done_at is None and call.stopper(row.context, tok)
        if stopped:
            row.done_at = row.length - row.prompt_width
        if (stopped and call.stopper.has_eos) or row.length >= call.max_length:
            row.finished = True
            row.done_at = row.length - row.prompt_width if row.done_at is None else row.done_at
            break
    call.stats.emitted_tokens += n
    if call.streamer is not None and shown:
        call.streamer.put(row.buf[row.length - n : row.length - n + shown].cpu())


def _cut_to_vanilla_length(rows: Sequence[_Row]) -> None:
    """Vanilla stops when its last row is done: rows it kept decoding after their criteria fired (no EOS criterion)
    end there too, however many tokens their last step accepted."""
    width = max(r.done_at if r.done_at is not None else r.length - r.prompt_width for r in rows)
    for r in rows:
        r.finished = True
        if r.length - r.prompt_width > width:
            r.length = r.prompt_width + width
            del r.scores[width:], r.logits[width:]


def _hidden_at(out: PlannedOutput, index: slice | torch.Tensor) -> dict[int, torch.Tensor] | None:
    """Layer -> `[m, H]`: the packed positions ``index`` (a slice or `[m]` indices) of every requested layer."""
    if out.hidden_states is None:
        return None
    return {
        layer: h[index if isinstance(index, slice) else index.to(h.device)] for layer, h in out.hidden_states.items()
    }


def _row_states(rows: Sequence[_Row], max_length: int, budget: TreeBudgeter | None = None) -> list[RowState]:
    """What the proposer sees of each row; with the call's ``budget`` (before proposing), its depth cap (0 while the
    row is paused)."""
    states = []
    for r in rows:
        depth = max(0, max_length - r.length - 1)
        capped = depth if budget is None else budget.depth_cap(r.index, depth)
        free = depth if capped < depth else 0
        states.append(RowState(r.index, r.tokens, r.prompt_width - r.start, max_depth=capped, free_depth=free))
    return states


def _sanitize(tree: DraftTree, row: _Row, call: _Call) -> tuple[DraftTree, torch.Tensor | None]:
    """Cut a proposer's tree (a `DraftTree`: `checked_proposals`) to the row's remaining budget.

    Returns:
        the tree to verify, and `[T']` int64 the proposed tree's index of each of its nodes (None: the same nodes).
    """
    if tree.device != row.buf.device:
        tree = tree.to(row.buf.device)
    max_depth = max(0, call.max_length - row.length - 1)
    kept = None
    bound = tree.depth_bound if tree.depth_bound is not None else tree.num_nodes
    if tree.num_nodes and bound > max_depth and tree.max_depth > max_depth:  # only near the end reads the tree
        keep = tree.depth <= max_depth
        kept = keep.nonzero().flatten()
        tree = tree.subtree_keep(keep)
    return tree, kept


def _vocab_size(model) -> int | None:
    return getattr(text_config(model), "vocab_size", None)


def _check_vocabulary(vocab: int | None, tokens: torch.Tensor, outside: torch.Tensor | None) -> None:
    """Raise if a drafted token was outside the target's vocabulary (``outside``: the flag computed on the device
    before the forward, read after it, when the device is done anyway)."""
    if outside is not None and bool(outside):
        bad = tokens[(tokens >= vocab) | (tokens < 0)]
        raise ValueError(f"the assistant drafted token id {int(bad[0])} outside the target's vocabulary ({vocab})")


def _verify(
    call: _Call, active: Sequence[_Row], trees: Sequence[DraftTree]
) -> tuple[PlannedOutput, torch.Tensor, list[Verdict]]:
    """One target forward over ``[root, nodes...]`` of every active row, then acceptance per row.

    Returns:
        the forward's output (logits `[N, V]` at every packed position), the processed scores `[N, V]`, and one
        `Verdict` per row.
    """
    rows = [r.cache_row for r in active]
    packed = pack_trees([r.root for r in active], trees, base=call.target.lengths(rows))
    bits = packed.ancestor_bits()  # [N, words] int32: every row's tree mask, bit-packed
    mask = TailMask(bits, packed.q_lens == 1)  # a row that drafted nothing is a one-token causal chunk
    tokens, vocab, outside = packed.tokens, _vocab_size(call.model), None
    if vocab is not None and packed.total > len(active):  # drafted ids stay on the device until after the forward
        outside = ((tokens >= vocab) | (tokens < 0)).any()
        tokens = tokens.clamp(0, vocab - 1)
    out = call.target.forward(rows, tokens, packed.positions, packed.q_lens, mask, hidden_layers=call.layers)
    _check_vocabulary(vocab, packed.tokens, outside)
    ancestors = packed.ancestor_masks(bits)  # [N, width] bool, for the rows' acceptance walks
    verdicts, all_scores = [], []
    cu = out.cu_seqlens.tolist()
    for b, (r, tree) in enumerate(zip(active, trees)):
        tree._ancestors = ancestors[cu[b] : cu[b + 1], : cu[b + 1] - cu[b]]
        scores = call.scorer(r.context, tree, out.logits[cu[b] : cu[b + 1]], r.index)  # [T + 1, V]
        all_scores.append(scores)
        verdicts.append(
            verify_tree(tree, scores, do_sample=call.do_sample, generator=call.generator, **call.verify_kwargs)
        )
    return out, torch.cat(all_scores), verdicts


def _pad_id(generation_config) -> torch.Tensor | None:
    """The id vanilla pads finished rows with (the pad token, else the first EOS token)."""
    pad_id = getattr(generation_config, "_pad_token_tensor", None)
    if pad_id is None and generation_config.pad_token_id is not None:
        pad_id = torch.tensor(generation_config.pad_token_id)
    if pad_id is None and generation_config.eos_token_id is not None:
        pad_id = torch.as_tensor(generation_config.eos_token_id).reshape(-1)[0]
    return pad_id


def _score_finished_rows(
    call: _Call, rows: Sequence[_Row], attention_mask: torch.Tensor | None, pad_id: torch.Tensor | None
) -> None:
    """The scores / logits of the positions where a row had finished while others went on, as vanilla computes
    them: vanilla keeps every finished row in its forwards, feeding the pad token after the row's last token (its
    attention mask and position ids growing as for any token), and returns the scores of those forwards. Here each
    such row runs one forward of the model, outside the speculative loop, over its context followed by those pads
    (`[W + g + p]`, causal), and the call's logits processors score every position with the context vanilla's saw.
    """
    steps = max(r.length - r.prompt_width for r in rows)
    fill = int(pad_id) if pad_id is not None else 0
    for r in rows:
        missing = steps - (r.length - r.prompt_width)  # positions of vanilla's output this row has no scores for
        if missing <= 0:
            continue
        device = r.buf.device
        pads = torch.full((missing - 1,), fill, dtype=torch.long, device=device)
        ids = torch.cat([r.context, pads])  # [W + g + missing - 1]
        mask = torch.ones_like(ids)
        if attention_mask is not None:
            mask[: r.prompt_width] = attention_mask[r.index].to(device=device, dtype=mask.dtype)
        positions = (mask.cumsum(0) - 1).masked_fill(mask == 0, 0)
        accepts = "logits_to_keep" in inspect.signature(call.model.forward).parameters
        keep = {"logits_to_keep": missing} if accepts else {}
        out = call.model(
            input_ids=ids[None], attention_mask=mask[None], position_ids=positions[None], use_cache=False, **keep
        )
        raw = out.logits[0, -missing:].to(dtype=torch.float32)  # [missing, V]: after the last token, then each pad
        chain = DraftTree.from_parents(pads, list(range(-1, missing - 2))) if missing > 1 else DraftTree.empty(device)
        scores = call.scorer(r.context, chain, raw, r.index)  # [missing, V] each with the context vanilla's saw
        if call.want_scores:
            r.scores.extend(scores.to(r.scores[0].device if r.scores else scores.device).unbind(0))
        if call.want_logits:
            r.logits.extend(raw.unbind(0))


def _output(call: _Call, input_ids: torch.Tensor, rows: Sequence[_Row], generation_config):
    """Vanilla's return value: `[B, W + G]` ids, or a `GenerateDecoderOnlyOutput` with ``spec_stats``."""
    pad_id = _pad_id(generation_config)
    sequences = _assemble(input_ids, rows, pad_id)
    if not generation_config.return_dict_in_generate:
        return sequences
    steps = sequences.shape[1] - input_ids.shape[1]
    result = GenerateDecoderOnlyOutput(
        sequences=sequences,
        scores=_stack_steps([r.scores for r in rows], steps) if call.want_scores else None,
        logits=_stack_steps([r.logits for r in rows], steps) if call.want_logits else None,
    )
    call.stats.budget = call.budget.summary()
    result.spec_stats = call.stats
    return result


def _assemble(input_ids: torch.Tensor, rows: Sequence[_Row], pad_id) -> torch.Tensor:
    """`[B, W + G]` prompts followed by generated tokens, shorter rows padded like vanilla generate."""
    gen = [r.generated for r in rows]
    longest = max(g.numel() for g in gen)
    fill = int(pad_id) if pad_id is not None else 0
    out = torch.full((len(rows), input_ids.shape[1] + longest), fill, dtype=torch.long, device=input_ids.device)
    out[:, : input_ids.shape[1]] = input_ids
    for b, g in enumerate(gen):
        out[b, input_ids.shape[1] : input_ids.shape[1] + g.numel()] = g
    return out


def _stack_steps(per_row: list[list[torch.Tensor]], steps: int) -> tuple[torch.Tensor, ...]:
    """Vanilla's layout: one `[B, V]` tensor per generated position (`_score_finished_rows` filled the positions
    after a row finished)."""
    ref = next(t for row in per_row for t in row)
    out = []
    for t in range(steps):
        out.append(torch.stack([row[t] if t < len(row) else torch.zeros_like(ref) for row in per_row]))
    return tuple(out)
