"""Running the target over training text: its own answers to prompts with the hidden states of every token (greedy
in one pass, or sampled then one forward), and its states and arg-max next tokens over fixed text (teacher forcing).

The states come back per sequence, `[len, H * (1 + len(aux_layers))]` on the CPU: the final normed state (what the
lm_head sees), then the state of each entry ``aux_layers`` of transformers' ``hidden_states`` (EAGLE-3's feature
layers). Storing them is `shards`' business; the builders (`distillation_data`, `teacher_forced`) join the two.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..cache.model_arg import cache_kwarg
from .padding import left_padded, right_padded

LM_HEAD_CHUNK = 2048  # positions per lm_head arg-max (bounds the [chunk, V] logits)


def _generate_answers(
    model, prompts: Sequence[Sequence[int]], max_new_tokens: int, pad_id: int, eos_ids: set[int], gen_kwargs: dict
) -> list[list[int]]:
    """Answers of ``model`` to a batch of prompt id lists (left padding), each cut after its first EOS."""
    device = next(model.parameters()).device
    ids, mask = left_padded(prompts, pad_id)  # [B, W]
    width = ids.shape[1]
    out = model.generate(
        ids.to(device),
        attention_mask=mask.to(device),
        max_new_tokens=max_new_tokens,
        pad_token_id=pad_id,
        **gen_kwargs,
    )
    answers = []
    for row in out[:, width:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos_ids), len(row))
        answers.append(row[:cut])
    return answers


@torch.no_grad()
def greedy_answers_with_states(
    model,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    pad_id: int,
    eos_ids: set[int],
    aux_layers: Sequence[int] = (),
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy answers of ``model`` to a batch of prompt id lists and, in the same forwards, the final hidden states
    of every prompt and answer token (no second pass over the finished sequences).

    The batch is left-padded with position ids counted over real tokens (as `generate` does); rows that reached an
    EOS leave the batch (their cache rows are dropped), so short answers stop costing compute. One last forward over
    each answer's final token gives its state too.

    Args:
        model: the target (a transformers causal LM whose ``get_decoder()`` returns the final-normed states).
        prompts: token ids of each prompt.
        max_new_tokens: answer length cap.
        pad_id / eos_ids: padding id and the ids that end an answer (kept in the answer).
        aux_layers: indices into transformers' ``hidden_states`` tuple (EAGLE-3's feature layers) whose states are
            returned too, concatenated after the final state of each token.
    Returns:
        ``(answers, states)``: per row the answer ids (cut after the first EOS) and `[len(prompt) + len(answer),
        H * (1 + len(aux_layers))]` hidden states (on the CPU): the final state, then each aux layer's.
    """
    from transformers import DynamicCache

    device = next(model.parameters()).device
    decoder, lm_head = model.get_decoder(), model.get_output_embeddings()
    ids, mask = left_padded(prompts, pad_id)  # [B, W]
    width = ids.shape[1]
    ids, mask = ids.to(device), mask.to(device)
    cache = DynamicCache()
    rows = torch.arange(len(prompts), device=device)  # [b] original row of each live batch row
    answers: list[list[int]] = [[] for _ in prompts]
    states: list[list[torch.Tensor]] = [[] for _ in prompts]
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [B, W]
    past = {**cache_kwarg(decoder.forward, cache), "output_hidden_states": bool(aux_layers)}

    def states_of(out) -> torch.Tensor:  # [b, q, H * (1 + len(aux_layers))]
        return torch.cat([out.last_hidden_state] + [out.hidden_states[i] for i in aux_layers], dim=-1)

    out = decoder(input_ids=ids, attention_mask=mask, position_ids=positions, **past)
    h, hs = out.last_hidden_state, states_of(out)
    for i, p in enumerate(prompts):
        states[i].append(hs[i, width - len(p) :].cpu())
    next_pos = positions[:, -1:] + 1  # [b, 1]
    for step in range(max_new_tokens):
        token = lm_head(h[:, -1]).argmax(-1)  # [b]
        live = []
        for r, t in zip(rows.tolist(), token.tolist()):
            answers[r].append(t)
            live.append(t not in eos_ids and step + 1 < max_new_tokens)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        out = decoder(input_ids=token[:, None], attention_mask=mask, position_ids=next_pos, **past)
        h, hs = out.last_hidden_state, states_of(out)  # [b, 1, H]: the state of the token just chosen
        hs = hs.cpu()  # one copy per step, not one per row (on a GPU each .cpu() is a synchronising transfer)
        for j, r in enumerate(rows.tolist()):
            states[r].append(hs[j])
        keep = torch.tensor(live, device=device)
        if not keep.all():
            if not keep.any():
                break
            index = keep.nonzero().flatten()
            cache.batch_select_indices(index)
            rows, mask, h, next_pos = rows[index], mask[index], h[index], next_pos[index]
        next_pos = next_pos + 1
    return answers, [torch.cat(s) for s in states]


@torch.no_grad()
def final_hidden_states(
    model, sequences: Sequence[Sequence[int]], aux_layers: Sequence[int] = ()
) -> list[torch.Tensor]:
    """`[len_i, H * (1 + len(aux_layers))]` per sequence: the model's last entry of ``hidden_states`` (the normed
    states its lm_head sees), then the entries ``aux_layers`` (EAGLE-3's feature layers) if any.

    The batch is right-padded, so (causal attention) no real token sees a pad and positions need no offset.
    Checks, on the longest sequence, that the lm_head applied to the state reproduces the model's logits.
    """
    device = next(model.parameters()).device
    ids, mask = right_padded(sequences)  # [B, W]
    width = ids.shape[1]
    out = model(input_ids=ids.to(device), attention_mask=mask.to(device), output_hidden_states=True, logits_to_keep=1)
    hidden = out.hidden_states[-1]  # [B, W, H]
    longest = max(range(len(sequences)), key=lambda i: len(sequences[i]))
    if len(sequences[longest]) == width:
        lm_head = model.get_output_embeddings()
        again = lm_head(hidden[longest, -1:]).float()
        ref = out.logits[longest, -1:].float()
        if not torch.allclose(again, ref, atol=1e-3 * max(1.0, ref.abs().max().item()), rtol=1e-3):
            raise RuntimeError(
                f"{type(model).__name__}: lm_head(hidden_states[-1]) does not reproduce the logits, so the last "
                "hidden state is not the one fed to the lm_head (a final norm or logit scaling is missing); Medusa "
                "heads need the states the lm_head sees"
            )
    hidden = torch.cat([hidden] + [out.hidden_states[i] for i in aux_layers], dim=-1)
    return [hidden[i, : len(s)].cpu() for i, s in enumerate(sequences)]


@torch.no_grad()
def teacher_forced_states(
    model, sequences: Sequence[Sequence[int]], aux_layers: Sequence[int] = ()
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One forward over a right-padded batch: per sequence `[len, H * (1 + len(aux_layers))]` states (the final
    normed state, then each aux layer's) and `[len]` int64 the target's arg-max next token (full vocabulary).

    Right padding: causal attention keeps every real token from seeing a pad, and positions need no offset.
    """
    device = next(model.parameters()).device
    ids, mask = right_padded(sequences)  # [B, W]
    out = model.get_decoder()(
        input_ids=ids.to(device), attention_mask=mask.to(device), output_hidden_states=bool(aux_layers)
    )
    hidden = out.last_hidden_state  # [B, W, H] what the lm_head sees
    states = torch.cat([hidden] + [out.hidden_states[i] for i in aux_layers], dim=-1)  # [B, W, F]
    lm_head = model.get_output_embeddings()
    states_out, nexts = [], []
    for i, s in enumerate(sequences):
        h = hidden[i, : len(s)]  # [len, H]
        nxt = torch.cat([lm_head(h[c : c + LM_HEAD_CHUNK]).argmax(-1) for c in range(0, len(s), LM_HEAD_CHUNK)])
        states_out.append(states[i, : len(s)].cpu())
        nexts.append(nxt.cpu())
    return states_out, nexts


def agreement_with_dynamic(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, pad_id: int,
                           eos_ids: set[int]) -> float:  # fmt: skip
    """The share of answer positions where the static loop (CUDA graphs where it can) and the dynamic loop chose the
    same token, over the positions both answers reach: a check, before a build, that the replayed graph reads what it
    should (other attention kernels may still decide a near-tie the other way: 1.0 is not required)."""
    from .static_decoding import greedy_answers_static

    static, _ = greedy_answers_static(model, prompts, max_new_tokens, pad_id, eos_ids)
    dynamic, _ = greedy_answers_with_states(model, prompts, max_new_tokens, pad_id, eos_ids)
    same = total = 0
    for a, b in zip(static, dynamic):
        n = min(len(a), len(b))
        same += sum(x == y for x, y in zip(a[:n], b[:n]))
        total += n
    return same / max(total, 1)


@dataclass
class Answering:
    """How `build_distillation_data` lets the target answer: length, batch, greedy or sampled, stop and pad ids."""

    max_new_tokens: int
    batch_size: int
    do_sample: bool
    temperature: float
    top_p: float
    eos_ids: set[int]
    pad: int
    aux_layers: tuple[int, ...] = ()
    tokens_per_batch: int | None = None
    static: bool = False

    @classmethod
    def of(
        cls, model, max_new_tokens, batch_size, do_sample, temperature, top_p, eos_token_id, pad_token_id, aux_layers=(),
        tokens_per_batch=None, static=False,
    ):  # fmt: skip
        """Stop and pad ids default to the model's generation config (pad: the lowest stop id, else 0). ``static``:
        greedy answers over a static cache, each step a replayed CUDA graph on CUDA (`static_decoding`); the same
        answers and states as the dynamic loop, which a batch falls back to where the static one fails."""
        gc = model.generation_config
        eos = eos_token_id if eos_token_id is not None else gc.eos_token_id
        eos_ids = set(torch.as_tensor(eos if eos is not None else []).reshape(-1).tolist())
        pad = pad_token_id if pad_token_id is not None else gc.pad_token_id
        if pad is None:
            pad = min(eos_ids) if eos_ids else 0
        return cls(int(max_new_tokens), int(batch_size), bool(do_sample), float(temperature), float(top_p), eos_ids,
                   int(pad), tuple(int(i) for i in aux_layers), int(tokens_per_batch) if tokens_per_batch else None,
                   bool(static))  # fmt: skip

    def describe(self, seed: int) -> dict:
        """The manifest's ``generation`` entry."""
        return {
            "max_new_tokens": self.max_new_tokens,
            "do_sample": self.do_sample,
            "temperature": self.temperature if self.do_sample else None,
            "top_p": self.top_p if self.do_sample else None,
            "seed": int(seed),
            "eos_token_id": sorted(self.eos_ids),
            "pad_token_id": self.pad,
            "batch_size": self.batch_size,
            **({"tokens_per_batch": self.tokens_per_batch} if self.tokens_per_batch else {}),
            "padding": "left (generate), right (hidden-state forward)" if self.do_sample else "left (one greedy pass)",
            "batch_order": "shortest prompt first within a shard",
        }

    def batches(self, prompts: Sequence[Sequence[int]]) -> list[range]:
        """The consecutive batches ``answer`` runs: at most ``batch_size`` prompts, and with ``tokens_per_batch`` at
        most that many rows x (longest prompt + ``max_new_tokens``) (the cache a batch can grow to), one prompt at
        least."""
        out, start = [], 0
        while start < len(prompts):
            end, longest = start, 0
            while end < len(prompts) and end - start < self.batch_size:
                longest = max(longest, len(prompts[end]))
                cache = (end + 1 - start) * (longest + self.max_new_tokens)
                if end > start and self.tokens_per_batch and cache > self.tokens_per_batch:
                    break
                end += 1
            out.append(range(start, end))
            start = end
        return out

    def answer(self, model, prompts: Sequence[Sequence[int]], bar) -> tuple[list[list[int]], list[torch.Tensor]]:
        """``(prompt + answer ids of each prompt, their final hidden states [len, H] each)``, in the order of
        ``prompts``. The prompts are batched shortest first (`batches` over them in that order), so a batch is
        left-padded to a length near its own prompts' and not to the longest of the shard: on a CPU a decoding step
        over 32 rows padded to 800 tokens costs 2-3x one over 200. A batch that runs out of device memory is
        answered in two halves."""
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        ranked = [list(map(int, prompts[i])) for i in order]
        seqs: list[list[int]] = [[] for _ in prompts]
        hiddens: list[torch.Tensor] = [torch.empty(0) for _ in prompts]
        for rows in self.batches(ranked):
            batch = [ranked[i] for i in rows]
            full, states = self._answer_batch(model, batch)
            for i, seq, state in zip(rows, full, states):
                seqs[order[i]], hiddens[order[i]] = seq, state
            bar.update(len(batch))
        return seqs, hiddens

    def _answer_batch(self, model, batch: list[list[int]]) -> tuple[list[list[int]], list[torch.Tensor]]:
        try:
            if self.do_sample:
                sampling = {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p, "top_k": 0}
                with torch.no_grad():
                    answers = _generate_answers(model, batch, self.max_new_tokens, self.pad, self.eos_ids, sampling)
                full = [p + a for p, a in zip(batch, answers)]
                return full, final_hidden_states(model, full, self.aux_layers)
            answers, states = self._greedy(model, batch)
            return [p + a for p, a in zip(batch, answers)], states
        except torch.OutOfMemoryError:
            if len(batch) == 1:
                raise
        torch.cuda.empty_cache()  # outside the except block: the failed batch's tensors are released by now
        half = len(batch) // 2
        first, second = self._answer_batch(model, batch[:half]), self._answer_batch(model, batch[half:])
        return first[0] + second[0], first[1] + second[1]

    def _greedy(self, model, batch: list[list[int]]) -> tuple[list[list[int]], list[torch.Tensor]]:
        """Greedy answers and states of one batch: the static loop where asked (a failure other than running out of
        memory turns it off for the rest of the build, with a warning), else the dynamic one."""
        args = (model, batch, self.max_new_tokens, self.pad, self.eos_ids, self.aux_layers)
        if self.static:
            from .static_decoding import greedy_answers_static

            try:
                return greedy_answers_static(*args)
            except torch.OutOfMemoryError:
                raise
            except Exception as err:  # e.g. a model StaticCache does not fit: the dynamic loop gives the same data
                warnings.warn(f"static decoding failed ({type(err).__name__}: {err}); decoding dynamically",
                              stacklevel=2)  # fmt: skip
                self.static = False
        return greedy_answers_with_states(*args)


__all__ = [
    "Answering",
    "agreement_with_dynamic",
    "LM_HEAD_CHUNK",
    "final_hidden_states",
    "greedy_answers_with_states",
    "teacher_forced_states",
]
