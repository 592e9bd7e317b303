"""The speculative decoding loop: prefill -> (propose -> verify in one forward -> accept -> commit -> feed back -> emit)*.

`generate` has the signature of a transformers ``custom_generate`` callable: transformers' own `generate` prepares the
generation config, the logits processors and the stopping criteria exactly as for vanilla decoding, then calls it.
``import hf_specdec`` routes ``model.generate(..., assistant=X)`` here (see `hook`).

Rows are packed, not padded: tokenizer padding is stripped at entry, each row keeps its own length in the target's
`PagedCache`, and every forward feeds ``[root, nodes...]`` of every active row back to back.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers.generation import (
    EosTokenCriteria,
    GenerateDecoderOnlyOutput,
    LogitsProcessorList,
    MaxLengthCriteria,
    StoppingCriteriaList,
)

from ..cache.paged import PagedCache
from ..kernels.attention import ATTENTION_NAME, PLAN_KWARG, build_plan, planned_forward, register
from ..kernels.cpu_linear import packed_linears
from .logits import NodeScorer
from .proposers import resolve_assistant
from .proposers.base import Proposer, ProposerSetup, RowFeedback, RowState
from .stats import SpecStats
from .tree import DraftTree, pack_trees
from .verify import Verdict, sample_from_scores, verify_tree

# GenerationConfig fields that change vanilla decoding and that this loop does not implement. Each is refused by name.
_UNSUPPORTED_FLAGS = ("output_attentions", "output_hidden_states", "low_memory", "token_healing")


@dataclass
class _Row:
    """Book-keeping of one row of the caller's batch."""

    index: int
    buf: torch.Tensor  # [W + max_new] vanilla's view of the row: left padding, prompt, generated tokens
    start: int  # first non-pad index in buf
    length: int  # filled length of buf (padded prompt + generated)
    prompt_width: int  # padded prompt width W
    cache_row: int
    finished: bool = False

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
        return self.buf[self.prompt_width : self.length]


class _StopChecker:
    """Applies the call's stopping criteria to one row at a time, token by token (fast paths for length and EOS)."""

    def __init__(self, criteria: StoppingCriteriaList | None):
        self.max_length: int | None = None
        self.eos: set[int] = set()
        self.others = StoppingCriteriaList()
        for c in criteria or []:
            if isinstance(c, MaxLengthCriteria):
                self.max_length = c.max_length if self.max_length is None else min(self.max_length, c.max_length)
            elif isinstance(c, EosTokenCriteria):
                self.eos |= set(torch.as_tensor(c.eos_token_id).reshape(-1).tolist())
            else:
                self.others.append(c)

    def __call__(self, context: torch.Tensor, token: int) -> bool:
        """Whether the row stops after ``context`` (which ends with ``token``)."""
        if token in self.eos:
            return True
        if self.max_length is not None and context.numel() >= self.max_length:
            return True
        if self.others:
            return bool(self.others(context[None], None).any())
        return False


def _model_configs(model) -> list:
    """Every distinct config object the modules of ``model`` read their attention implementation from (cached)."""
    configs = model.__dict__.get("_hf_specdec_configs")
    if configs is None:
        configs, seen = [], set()
        for module in model.modules():
            cfg = getattr(module, "config", None)
            if cfg is None or id(cfg) in seen or not hasattr(cfg, "_attn_implementation"):
                continue
            seen.add(id(cfg))
            configs.append(cfg)
        model.__dict__["_hf_specdec_configs"] = configs
    return configs


def _set_attention(model, name: str) -> list[tuple[object, str]]:
    """Point every config of ``model`` at attention ``name``; returns what to restore."""
    saved = []
    for cfg in _model_configs(model):
        saved.append((cfg, cfg._attn_implementation))
        cfg._attn_implementation = name
    return saved


@contextmanager
def speculative_attention(model):
    """Run ``model`` with the ``hf_specdec`` attention inside the block; restores the previous one afterwards."""
    register()
    saved = _set_attention(model, ATTENTION_NAME)
    try:
        yield
    finally:
        for cfg, name in saved:
            cfg._attn_implementation = name


def _hidden_layers(outputs, layers: Sequence[int]) -> dict[int, torch.Tensor]:
    """Layer -> `[N, H]` the requested hidden states of the packed forward."""
    hs = outputs.hidden_states
    return {layer: hs[layer][0] for layer in layers}


def _hidden_at(hidden: dict[int, torch.Tensor] | None, index) -> dict[int, torch.Tensor] | None:
    """Layer -> `[m, H]`: the packed positions ``index`` (a slice or `[m]` indices) of every requested layer."""
    if hidden is None:
        return None
    return {layer: h[index if isinstance(index, slice) else index.to(h.device)] for layer, h in hidden.items()}


def _validate_call(model, input_ids: torch.Tensor, generation_config, model_kwargs: dict) -> None:
    if getattr(model.config, "is_encoder_decoder", False):
        raise ValueError(
            f"{type(model).__name__} is an encoder-decoder model; hf_specdec's assistant= supports decoder-only "
            "causal language models"
        )
    if input_ids is None or input_ids.dim() != 2:
        raise ValueError("hf_specdec needs input_ids of shape [batch, length] (inputs_embeds is not supported)")
    if input_ids.shape[1] == 0 or input_ids.shape[0] == 0:
        raise ValueError("empty prompt: input_ids has no tokens; pass at least one token per row")
    if generation_config.num_beams not in (None, 1):
        raise ValueError(
            f"beam search (num_beams={generation_config.num_beams}) cannot be combined with an assistant; "
            "use num_beams=1 (greedy or sampling)"
        )
    if getattr(generation_config, "num_beam_groups", 1) not in (None, 1):
        raise ValueError("diverse beam search (num_beam_groups) cannot be combined with an assistant")
    for flag in _UNSUPPORTED_FLAGS:
        if getattr(generation_config, flag, False):
            raise ValueError(f"generation option {flag}=True is not supported with an assistant")
    if getattr(generation_config, "penalty_alpha", None):
        raise ValueError("contrastive search (penalty_alpha) cannot be combined with an assistant")
    if getattr(generation_config, "guidance_scale", None) not in (None, 1, 1.0):
        raise ValueError("classifier-free guidance (guidance_scale) is not supported with an assistant")
    if getattr(generation_config, "prompt_lookup_num_tokens", None):
        raise ValueError(
            "prompt_lookup_num_tokens is transformers' own n-gram assistant; with assistant= use "
            "hf_specdec.NgramAssistant() instead"
        )
    cache = model_kwargs.get("past_key_values")
    if cache is not None and getattr(cache, "_is_user_defined", False) and cache.get_seq_length() > 0:
        raise ValueError(
            "past_key_values with cached tokens cannot be continued with an assistant; pass the full prompt"
        )
    allowed = {"attention_mask", "position_ids", "logits_to_keep", "use_cache", "past_key_values", "cache_position"}
    extra = sorted(k for k, v in model_kwargs.items() if k not in allowed and v is not None)
    if extra:
        raise ValueError(
            f"model inputs {extra} are not supported with an assistant (only input_ids and attention_mask)"
        )


def _rows_from_input(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, max_new: int) -> list[_Row]:
    bsz, width = input_ids.shape
    rows = []
    for b in range(bsz):
        if attention_mask is None:
            start = 0
        else:
            keep = attention_mask[b].bool()
            n = int(keep.sum())
            if n == 0:
                raise ValueError(f"empty prompt: row {b} of the batch is all padding")
            start = width - n
            if not bool(keep[start:].all()):
                raise ValueError(
                    f"row {b} is not left-padded (its attention_mask has zeros after tokens); set "
                    "tokenizer.padding_side='left' for decoder-only generation"
                )
        buf = torch.zeros(width + max_new + 1, dtype=torch.long, device=input_ids.device)
        buf[:width] = input_ids[b]
        rows.append(_Row(index=b, buf=buf, start=start, length=width, prompt_width=width, cache_row=-1))
    return rows


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
    streamer=None,
    **model_kwargs,
):
    """Speculative decoding with ``assistant`` (a transformers ``custom_generate`` callable).

    Usually reached as ``model.generate(ids, assistant=X, ...)`` after ``import hf_specdec``, or as
    ``model.generate(ids, custom_generate=hf_specdec.generate, assistant=X, ...)``.

    Args:
        model: the target causal LM.
        input_ids: `[B, W]` prompts, left-padded when rows differ in length (with ``attention_mask``).
        logits_processor / stopping_criteria / generation_config: prepared by transformers' `generate`.
        assistant: a `Proposer`, a `PreTrainedModel` draft model, or a head (see `resolve_assistant`).
        generator: optional torch.Generator for reproducible sampling.
        acceptance: ``"exact"`` (lossless; default) or ``"typical"`` (Medusa's typical acceptance with
            ``typical_epsilon`` / ``typical_delta``: faster at high temperature but it does NOT preserve the target's
            distribution). Only used when sampling.
    Returns:
        `[B, W + G]` token ids like vanilla `generate`, or a `GenerateDecoderOnlyOutput` with an extra
        ``spec_stats`` attribute when ``return_dict_in_generate=True``.
    """
    streamer = hf_specdec_streamer if hf_specdec_streamer is not None else streamer
    if assistant is None:
        raise ValueError("hf_specdec.generate needs an assistant: model.generate(ids, assistant=...)")
    if generation_config is None:
        generation_config = model.generation_config
    _validate_call(model, input_ids, generation_config, model_kwargs)
    if streamer is not None and input_ids.shape[0] > 1:
        raise ValueError("streamers support batch size 1 only (as in vanilla generate)")
    proposer: Proposer = resolve_assistant(assistant, model)
    proposer.validate(model)
    scorer = NodeScorer(logits_processor)
    verify_kwargs = dict(acceptance=acceptance, typical_epsilon=typical_epsilon, typical_delta=typical_delta)
    stopper = _StopChecker(stopping_criteria)
    do_sample = bool(generation_config.do_sample)
    max_length = stopper.max_length if stopper.max_length is not None else generation_config.max_length
    if max_length is None:
        raise ValueError("set max_new_tokens or max_length")
    max_new = max(0, max_length - input_ids.shape[1])
    rows = _rows_from_input(input_ids, model_kwargs.get("attention_mask"), max_new)
    want_scores = bool(generation_config.return_dict_in_generate and generation_config.output_scores)
    want_logits = bool(generation_config.return_dict_in_generate and generation_config.output_logits)
    step_scores: list[list[torch.Tensor]] = [[] for _ in rows]
    step_logits: list[list[torch.Tensor]] = [[] for _ in rows]
    pad_id = generation_config._pad_token_tensor if hasattr(generation_config, "_pad_token_tensor") else None
    if pad_id is None and generation_config.pad_token_id is not None:
        pad_id = torch.tensor(generation_config.pad_token_id)
    if pad_id is None and generation_config.eos_token_id is not None:
        pad_id = torch.as_tensor(generation_config.eos_token_id).reshape(-1)[0]
    stats = SpecStats()
    device = input_ids.device
    layers = proposer.hidden_state_layers
    if streamer is not None and hf_specdec_streamer is not None:
        streamer.put(input_ids.cpu())

    cache = PagedCache(model.config)
    for row, cache_row in zip(rows, cache.add_rows(len(rows))):
        row.cache_row = cache_row

    def emit(row: _Row, tokens: Sequence[int], scores: torch.Tensor | None, logits: torch.Tensor | None) -> int:
        """Append tokens to the row until a stopping criterion fires; returns how many were appended."""
        n = 0
        for i, tok in enumerate(tokens):
            row.buf[row.length] = tok
            row.length += 1
            n += 1
            if scores is not None:
                step_scores[row.index].append(scores[i])
            if logits is not None:
                step_logits[row.index].append(logits[i])
            if stopper(row.context, tok) or row.length >= max_length:
                row.finished = True
                break
        stats.emitted_tokens += n
        if streamer is not None and n:
            streamer.put(row.buf[row.length - n : row.length].cpu())
        return n

    try:
        with speculative_attention(model), packed_linears(model):
            proposer.start(
                ProposerSetup(
                    target=model,
                    generation_config=generation_config,
                    do_sample=do_sample,
                    logits_processor=logits_processor,
                    generator=generator,
                    batch_size=len(rows),
                )
            )
            # ---- prefill: every prompt in one packed forward, causal per row
            t0 = time.perf_counter()
            prompts = [r.tokens for r in rows]
            q_lens = [p.numel() for p in prompts]
            positions = torch.cat([torch.arange(n, device=device) for n in q_lens])
            plan = build_plan(cache, [r.cache_row for r in rows], q_lens, positions, [None] * len(rows), device)
            last = plan.cu_seqlens[1:] - 1
            with planned_forward():
                out = model(
                    input_ids=torch.cat(prompts)[None],
                    position_ids=positions[None],
                    use_cache=False,
                    logits_to_keep=last.to(device),
                    output_hidden_states=bool(layers),
                    **{PLAN_KWARG: plan},
                )
            raw = out.logits[0]  # [B, V]
            hidden = _hidden_layers(out, layers) if layers else None
            del out
            for r, n in zip(rows, q_lens):
                cache.allocator.truncate(r.cache_row, n)  # the prompt is committed
            feedback = []
            no_nodes = torch.zeros(0, dtype=torch.long, device=device)
            for b, r in enumerate(rows):
                scores = scorer(r.context, DraftTree.empty(device), raw[b : b + 1], r.index)
                tok = int(sample_from_scores(scores, generator)[0]) if do_sample else int(scores[0].argmax())
                emit(r, [tok], scores if want_scores else None, raw[b : b + 1] if want_logits else None)
                span = slice(int(plan.cu_seqlens[b]), int(plan.cu_seqlens[b + 1]))
                feedback.append(RowFeedback(prompts[b], no_nodes, tok, None, _hidden_at(hidden, span)))
            stats.time_verify += time.perf_counter() - t0
            _release_finished(rows, cache)
            proposer.observe(_row_states(rows, max_length), feedback)

            # ---- speculative steps
            while True:
                active = [r for r in rows if not r.finished]
                if not active:
                    break
                states = _row_states(active, max_length)
                t0 = time.perf_counter()
                proposed = proposer.propose(states)
                stats.time_propose += time.perf_counter() - t0
                t0 = time.perf_counter()
                if len(proposed) != len(active):
                    raise RuntimeError(f"{type(proposer).__name__}.propose returned the wrong number of trees")
                trees, kept = zip(*[_sanitize(t, s, model) for t, s in zip(proposed, states)])
                verdicts, raw, hidden, plan = _verify_step(
                    model,
                    cache,
                    active,
                    trees,
                    scorer,
                    layers,
                    do_sample=do_sample,
                    generator=generator,
                    **verify_kwargs,
                )
                cache.commit_rows([r.cache_row for r in active], [v.accepted for v in verdicts])
                t1 = time.perf_counter()
                stats.time_verify += t1 - t0
                feedback = []
                for b, (r, tree, v) in enumerate(zip(active, trees, verdicts)):
                    stats.record_step(tree.num_nodes, v.num_accepted)
                    acc_nodes = v.accepted[1:] - 1
                    drafted = tree.tokens[acc_nodes.to(tree.device)].tolist()
                    root = int(r.tokens[-1])
                    s = int(plan.cu_seqlens[b])
                    sel = (v.accepted + s).to(raw[0].device) if (want_scores or want_logits) else None
                    emit(
                        r,
                        drafted + [v.next_token],
                        raw[1][sel] if want_scores else None,
                        raw[0][sel] if want_logits else None,
                    )
                    new_tokens = torch.tensor([root] + drafted, dtype=torch.long, device=device)
                    accepted = acc_nodes if kept[b] is None else kept[b][acc_nodes.to(kept[b].device)]
                    hidden_rows = _hidden_at(hidden, v.accepted + s)
                    feedback.append(RowFeedback(new_tokens, accepted, v.next_token, proposed[b], hidden_rows))
                _release_finished(active, cache)
                proposer.observe(_row_states(active, max_length), feedback)
                stats.time_other += time.perf_counter() - t1
    finally:
        proposer.finish()
        for r in rows:
            if cache.allocator.active[r.cache_row]:
                cache.free_row(r.cache_row)

    if streamer is not None:
        streamer.end()
    sequences = _assemble(input_ids, rows, pad_id)
    if not generation_config.return_dict_in_generate:
        return sequences
    result = GenerateDecoderOnlyOutput(
        sequences=sequences,
        scores=_stack_steps(step_scores, sequences.shape[1] - input_ids.shape[1]) if want_scores else None,
        logits=_stack_steps(step_logits, sequences.shape[1] - input_ids.shape[1]) if want_logits else None,
    )
    result.spec_stats = stats
    return result


def _row_states(rows: Sequence[_Row], max_length: int) -> list[RowState]:
    return [
        RowState(
            row=r.index,
            tokens=r.tokens,
            prompt_len=r.prompt_width - r.start,
            max_depth=max(0, max_length - r.length - 1),
        )
        for r in rows
    ]


def _release_finished(rows: Sequence[_Row], cache: PagedCache) -> None:
    for r in rows:
        if r.finished and cache.allocator.active[r.cache_row]:
            cache.free_row(r.cache_row)


def _sanitize(tree: DraftTree, state: RowState, model) -> tuple[DraftTree, torch.Tensor | None]:
    """Check a proposer's tree and cut it to the row's remaining budget.

    Returns:
        the tree to verify, and `[T']` int64 the proposed tree's index of each of its nodes (None: the same nodes).
    """
    if not isinstance(tree, DraftTree):
        raise TypeError(f"a proposer must return DraftTree objects, got {type(tree).__name__}")
    if tree.device != state.tokens.device:
        tree = tree.to(state.tokens.device)
    kept = None
    if tree.num_nodes and tree.max_depth > state.max_depth:
        keep = tree.depth <= state.max_depth
        kept = keep.nonzero().flatten()
        tree = tree.subtree_keep(keep)
    if tree.num_nodes == 0:
        return tree, kept
    vocab = model.config.get_text_config().vocab_size if hasattr(model.config, "get_text_config") else None
    if vocab is not None and tree.num_nodes and (int(tree.tokens.max()) >= vocab or int(tree.tokens.min()) < 0):
        raise ValueError(
            f"the assistant drafted token id {int(tree.tokens.max())} outside the target's vocabulary ({vocab})"
        )
    return tree, kept


def _verify_step(model, cache, active, trees, scorer, layers, **verify_kwargs):
    """One target forward over ``[root, nodes...]`` of every active row, then acceptance per row."""
    device = active[0].buf.device
    packed = pack_trees([int(r.tokens[-1]) for r in active], trees)
    q_lens = [t.num_nodes + 1 for t in trees]
    committed = torch.tensor([cache.lengths[r.cache_row] for r in active], device=device)
    positions = packed.depth + committed.repeat_interleave(torch.tensor(q_lens, device=device))
    masks = [t.ancestor_mask() if t.num_nodes else None for t in trees]
    plan = build_plan(cache, [r.cache_row for r in active], q_lens, positions, masks, device)
    with planned_forward():
        out = model(
            input_ids=packed.tokens[None],
            position_ids=positions[None],
            use_cache=False,
            logits_to_keep=0,
            output_hidden_states=bool(layers),
            **{PLAN_KWARG: plan},
        )
    logits = out.logits[0]  # [N, V]
    hidden = _hidden_layers(out, layers) if layers else None
    del out
    verdicts: list[Verdict] = []
    all_scores = []
    cu = plan.cu_seqlens.tolist()
    for b, (r, tree) in enumerate(zip(active, trees)):
        scores = scorer(r.context, tree, logits[cu[b] : cu[b + 1]], r.index)
        all_scores.append(scores)
        verdicts.append(verify_tree(tree, scores, **verify_kwargs))
    return verdicts, (logits, torch.cat(all_scores)), hidden, plan


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
    """Vanilla's layout: one `[B, V]` tensor per generated position (finished rows' later entries are zeros)."""
    ref = next(t for row in per_row for t in row)
    out = []
    for t in range(steps):
        out.append(torch.stack([row[t] if t < len(row) else torch.zeros_like(ref) for row in per_row]))
    return tuple(out)
