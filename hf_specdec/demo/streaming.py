"""Follow one ``generate()`` call token by token: it runs in a worker thread, its tokens arrive through a streamer.

transformers' streamers receive the prompt first, then every group of tokens a decoding step appends. Vanilla
`generate` appends one token per step; hf_specdec's speculative loop appends, per verification step, the accepted
draft tokens followed by the target's own next token (the correction or bonus token). `StepStreamer` keeps those
groups, so the origin of every token is known without any hook in the loop:

    streamer = StepStreamer()
    model.generate(ids, assistant=X, streamer=streamer)   # groups: [t1], [d, d, d, t], [t], [d, t], ...

A step cut short by a stopping criterion (EOS or the token budget inside the accepted draft) puts only drafted
tokens; `mark_origins` resolves that last step from ``spec_stats`` (accepted draft tokens counted by the loop).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from transformers.generation import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

DRAFTED = "drafted"
TARGET = "target"
WAIT_REPORT_S = 0.5


class CancelCriteria(StoppingCriteria):
    """Stops every row once ``event`` is set (how a Stop button ends a running `generate` within one step)."""

    def __init__(self, event: threading.Event):
        self.event = event

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        # input_ids: [B, T]; returns [B] bools
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool, device=input_ids.device)


class StepStreamer(BaseStreamer):
    """A transformers streamer that forwards each emitted group of token ids (one decoding step) to a queue.

    The first ``put`` (the prompt) is skipped. Items on ``sink`` are ``("tokens", list[int], t)`` with ``t`` the
    `time.perf_counter()` of arrival.
    """

    def __init__(self, sink: queue.Queue):
        self.sink = sink
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.sink.put(("tokens", value.reshape(-1).tolist(), time.perf_counter()))

    def end(self) -> None:
        pass  # the worker thread reports the end (also when generate raises before calling end)


@dataclass
class Progress:
    """The state of a followed call after each step.

    Attributes:
        tokens: generated token ids so far (prompt excluded).
        steps: the groups of tokens as emitted, one list per decoding step.
        elapsed: seconds since the call started (once it holds the lock).
        started: whether the call started (it may wait for the lock first).
        done: whether `generate` returned (or raised).
        output: what `generate` returned, once done.
        error: the exception `generate` raised, if any.
    """

    tokens: list[int] = field(default_factory=list)
    steps: list[list[int]] = field(default_factory=list)
    elapsed: float = 0.0
    started: bool = False
    done: bool = False
    output: object | None = None
    error: BaseException | None = None

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.elapsed if self.elapsed > 0 else 0.0


def follow_generate(
    model, inputs: dict, kwargs: dict, cancel: threading.Event | None = None, lock=None, seed: int | None = None
) -> Iterator[Progress]:
    """Run ``model.generate(**inputs, **kwargs, streamer=...)`` in a thread and yield its `Progress` after each step.

    Args:
        model: the causal LM (shared between callers: each call gets its own streamer and cancel criterion).
        inputs: ``input_ids`` `[1, W]` and ``attention_mask`` `[1, W]` (streamers need batch size 1).
        kwargs: the other generate() arguments (``assistant``, ``max_new_tokens``, sampling options ...).
        cancel: when set, generation stops after the current step; it is also set when the consumer stops
            iterating before the end (e.g. a cancelled Gradio event), so an abandoned call does not keep the CPU
            busy.
        lock: held around the call (e.g. one lock per model so that calls sharing it run one at a time); the clock
            starts once it is acquired.
        seed: ``torch.manual_seed(seed)`` right before the call, once the lock is held, so that a concurrent call
            cannot draw from the generator in between (with ``lock=None`` concurrent calls share torch's generator).
    Yields:
        the same `Progress` object, updated; the last one has ``done=True``. While the call waits for ``lock`` it is
        yielded every `WAIT_REPORT_S` seconds with ``started=False``.
    """
    cancel = cancel if cancel is not None else threading.Event()
    sink: queue.Queue = queue.Queue()
    criteria = StoppingCriteriaList(kwargs.get("stopping_criteria") or [])
    criteria.append(CancelCriteria(cancel))
    call = {**kwargs, "stopping_criteria": criteria, "streamer": StepStreamer(sink)}

    def work() -> None:
        try:
            with lock if lock is not None else contextlib.nullcontext():
                if seed is not None:
                    torch.manual_seed(seed)
                sink.put(("start", None, time.perf_counter()))
                out = model.generate(**inputs, **call)
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which shows it
            sink.put(("error", exc, time.perf_counter()))
        else:
            sink.put(("done", out, time.perf_counter()))

    progress = Progress()
    t0 = None
    threading.Thread(target=work, name="hf-specdec-demo-generate", daemon=True).start()
    try:
        while not progress.done:
            try:
                kind, value, t = sink.get(timeout=WAIT_REPORT_S)
            except queue.Empty:
                if not progress.started:
                    yield progress  # still waiting for the lock
                continue
            t0 = t if t0 is None else t0
            progress.elapsed = t - t0
            progress.started = True
            if kind == "tokens":
                progress.steps.append(value)
                progress.tokens.extend(value)
            elif kind != "start":
                progress.done = True
                progress.output, progress.error = (value, None) if kind == "done" else (None, value)
            yield progress
    finally:
        if not progress.done:  # the consumer stopped listening: stop the call too
            cancel.set()


def mark_origins(steps: list[list[int]], speculative: bool, accepted_tokens: int | None = None) -> list[str]:
    """The origin of every emitted token: `DRAFTED` (an accepted draft token) or `TARGET` (the target's own token).

    Args:
        steps: the token groups as emitted (`Progress.steps`).
        speculative: whether they come from hf_specdec's loop (else every token is the target's own).
        accepted_tokens: ``spec_stats.accepted_tokens`` of the call when known: if the loop accepted more draft
            tokens than the groups account for, the last step was cut short by a stopping criterion, so its last
            token was drafted too.
    Returns:
        one origin per token, in order.
    """
    origins: list[str] = []
    for group in steps:
        if speculative:
            origins += [DRAFTED] * (len(group) - 1) + [TARGET]
        else:
            origins += [TARGET] * len(group)
    if speculative and accepted_tokens is not None and origins and len(steps) > 1:
        if accepted_tokens > origins.count(DRAFTED):
            origins[-1] = DRAFTED
    return origins


class IncrementalText:
    """The text of each token of a growing sequence, decoded in context (byte-level BPE pieces and multi-byte
    characters split over tokens come out right; a piece that completes a character carries it).

    Each new token decodes a short window, not the whole text (vLLM's and TGI's incremental detokenisation): the
    tokens from ``prefix_offset`` (a few tokens of context, so that a tokenizer's handling of a leading space applies
    to both decodes alike) to the end, against the same window without the tokens not yet shown. The work per token
    stays constant however long the answer grows.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.pieces: list[str] = []
        self.text = ""
        self._prefix_offset = 0  # the window starts here
        self._read_offset = 0  # tokens before this are in self.text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def extend(self, ids: list[int]) -> list[str]:
        """Add tokens; returns their pieces (their concatenation is the decoded text)."""
        new = []
        for tok in ids:
            self.ids.append(tok)
            shown = self._decode(self.ids[self._prefix_offset : self._read_offset])
            window = self._decode(self.ids[self._prefix_offset :])
            # an incomplete character decodes to U+FFFD: the token that completes it carries it
            if len(window) > len(shown) and not window.endswith("\ufffd"):
                piece = window[len(shown) :]
                self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
            else:
                piece = ""
            self.text += piece
            self.pieces.append(piece)
            new.append(piece)
        return new
