"""Online training data: teacher-forced conversations whose states the target computes while a head trains, so that
nothing but the token ids is kept (8M tokens of stored fp16 states take 9 GB on disk and in memory; the ids, 64 MB).

    seqs = [templated_ids(tok, c, max_tokens=1024) for c in pick_conversations(load_sharegpt(), 4000, seed=0)]
    source = OnlineTeacherForcing.of(bf16_target, [s for s in seqs if s], recipe={...})
    head, report = train_eagle(model, source, "out/eagle", EagleTrainingConfig())

What needs no target is answered from `tokens`, a `DistillationData` of the ids and assistant masks with zero-width
states: the sequences, their windows, the positions trained on, and the draft vocabulary, which is counted over the
text's own answer tokens (the target's arg-max there would take a pass over all the data; the two agree on about
two thirds of ShareGPT's answer tokens). What needs the target is computed when asked, in batches of at most
``tokens_per_batch`` padded tokens, outside any autocast (the target runs in its own dtype):

- `sequences_data`: whole sequences with their states (the held-out set, once; a sample for the features' spread);
- `window_data`: for a training step's windows, the prefix of each window's sequence up to the window's end plus
  ``lookahead`` tokens (the states at a position depend on every token before it), with the windows re-indexed into
  it. The labels of a window are then the ones stored data would give it.

The cost: a window's prefix is run again for every window of a long sequence, so one epoch runs the target over
more tokens than the text holds (`computed_tokens` counts them); with windows as long as the sequences
(``window >= max_tokens``) every token is run once per epoch. Stored data run it once in all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from .chat_template import TemplatedConversation
from .shards import DistillationData
from .target_states import teacher_forced_states
from .teacher_forced import token_batches


@dataclass
class OnlineTeacherForcing:
    """Teacher-forced training data computed on demand (module docstring).

    Attributes:
        model: the target that computes the states (e.g. a bfloat16 copy; frozen, in eval mode).
        tokens: `DistillationData` of every sequence's ids and assistant mask; ``hidden`` is `[N, 0]`.
        aux_layers: also compute these entries of transformers' ``hidden_states`` (EAGLE-3's feature layers).
        tokens_per_batch: padded tokens per target forward.
        computed_tokens: tokens the target has run over so far (prefixes and whole sequences).
    """

    model: torch.nn.Module
    tokens: DistillationData
    aux_layers: tuple[int, ...] = ()
    tokens_per_batch: int = 8192
    computed_tokens: int = 0

    @classmethod
    def of(
        cls,
        model: torch.nn.Module,
        sequences: Sequence[TemplatedConversation],
        *,
        recipe: dict | None = None,
        aux_layers: Sequence[int] = (),
        tokens_per_batch: int = 8192,
        base_model_name: str | None = None,
    ) -> OnlineTeacherForcing:
        """The online data of ``sequences`` (`chat_template.templated_ids`) for ``model``."""
        from ..heads.hub import base_model_dims
        from ..heads.hub import base_model_name as loaded_name

        if not sequences:
            raise ValueError("no sequences to teacher-force")
        if model.training:  # dropout would make every step's states differ; the user's model is left as it is
            raise ValueError("the target that computes the states must be in eval mode: call model.eval() first")
        lens = torch.tensor([len(s.ids) for s in sequences])  # [S]
        hidden_size, vocab_size = base_model_dims(model)
        manifest = {
            "base_model": base_model_name or loaded_name(model),
            "hidden_size": hidden_size,
            "vocab_size": vocab_size,
            "prompt_recipe": recipe,
            "teacher_forced": True,
            "online": True,
            "target_dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
            "num_sequences": len(sequences),
            "num_tokens": int(lens.sum()),
            "num_answer_tokens": sum(sum(s.answer_mask) for s in sequences),
            "num_prompts": (recipe or {}).get("num_conversations", len(sequences)),
        }
        tokens = DistillationData.from_lengths(
            torch.tensor([t for s in sequences for t in s.ids], dtype=torch.long),
            torch.zeros(int(lens.sum()), 0),
            lens,
            torch.tensor([s.first_answer for s in sequences]),
            manifest,
            answer_mask=torch.tensor([m for s in sequences for m in s.answer_mask], dtype=torch.bool),
        )
        return cls(model, tokens, tuple(int(i) for i in aux_layers), int(tokens_per_batch))

    def first_tokens(self, max_tokens: int) -> OnlineTeacherForcing:
        """The leading sequences that fit in ``max_tokens`` tokens (at least one), as `shards.first_sequences`."""
        from .shards import first_sequences

        return replace(self, tokens=first_sequences(self.tokens, max_tokens), computed_tokens=0)

    def sequences_data(self, seq_ids: torch.Tensor) -> DistillationData:
        """The sequences ``seq_ids`` `[S']` whole, with the target's states: a `DistillationData` of their own."""
        spans = [(s, e) for s, _, e in self.tokens.seq_bounds[seq_ids].tolist()]
        return self._computed(spans)

    def window_data(self, windows: torch.Tensor, lookahead: int = 1) -> tuple[DistillationData, torch.Tensor]:
        """``(data, windows)``: the prefixes the ``(start, end)`` windows `[B, 2]` (`labels.window_starts`) read,
        each up to ``end + lookahead`` (within its sequence), with the target's states, and the windows `[B, 2]`
        re-indexed into it. ``lookahead``: tokens past a window's last pair that its loss reads (1 + the draft
        steps unrolled beyond the first)."""
        ends = self.tokens.seq_bounds[:, 2].contiguous()  # [S]
        seq = torch.searchsorted(ends, windows[:, 0].contiguous(), right=True)  # [B] each window's sequence
        begin = self.tokens.seq_bounds[seq, 0]  # [B]
        stop = torch.minimum(windows[:, 1] + 1 + lookahead, self.tokens.seq_bounds[seq, 2])  # [B]
        data = self._computed(list(zip(begin.tolist(), stop.tolist())))
        offset = data.seq_bounds[:, 0] - begin  # [B] where each prefix starts in ``data``
        return data, windows + offset[:, None]

    def _computed(self, spans: list[tuple[int, int]]) -> DistillationData:
        """The token spans ``[begin, stop)`` of ``tokens`` (each from a sequence's first token) as sequences of a
        `DistillationData` with the target's states and arg-max next tokens, in ``spans``' order."""
        ids = [self.tokens.input_ids[a:b].tolist() for a, b in spans]
        states: list[torch.Tensor | None] = [None] * len(ids)
        nexts: list[torch.Tensor | None] = [None] * len(ids)
        with torch.autocast(next(self.model.parameters()).device.type, enabled=False):
            for batch in token_batches([len(s) for s in ids], self.tokens_per_batch):
                got, nxt = teacher_forced_states(self.model, [ids[i] for i in batch], self.aux_layers)
                for i, g, n in zip(batch, got, nxt):
                    states[i], nexts[i] = g, n
        self.computed_tokens += sum(len(s) for s in ids)
        begin = torch.tensor([a for a, _ in spans])  # [S'] each span's sequence start in ``tokens``
        first_answer = self.tokens.answer_start[begin] - begin  # [S'] within the sequence
        lens = torch.tensor([len(s) for s in ids])  # [S']
        hidden = torch.cat(states)  # [N', H * (1 + len(aux_layers))]
        h = int(self.tokens.manifest["hidden_size"])
        return DistillationData.from_lengths(
            torch.cat([torch.tensor(s, dtype=torch.long) for s in ids]),
            hidden[:, :h],
            lens,
            torch.minimum(first_answer, lens),
            self.tokens.manifest,
            aux_hidden=hidden[:, h:] if self.aux_layers else None,
            aux_layers=self.aux_layers or None,
            answer_mask=torch.cat([self.tokens.answer_mask[a:b] for a, b in spans]),
            target_next=torch.cat(nexts).long(),
        )


__all__ = ["OnlineTeacherForcing"]
