"""Load test of the Gradio demo: 8 concurrent ``gradio_client`` users (loopback only) for a bounded time, greedy, every
ready-made assistant. Every text is vanilla ``generate``'s, the server still answers afterwards and its memory stays
flat (three phases: what the first allocates once, a leak grows in each later one; the allocator's free pages are
returned before every reading, so its caching is not read as a leak). ``HF_SPECDEC_DEMO_LOAD_S`` sets
the duration of each (default 20 s); the figures are printed (``pytest -s``)."""

from __future__ import annotations

import ctypes
import gc
import itertools
import os
import statistics
import threading
import time

import pytest
import torch

gradio_client = pytest.importorskip("gradio_client", reason="the demo extra is not installed (pip install .[demo])")

from hf_specdec.assistants import available_assistants  # noqa: E402
from hf_specdec.models import chat_prompt_ids  # noqa: E402

pytestmark = pytest.mark.slow  # the default model

USERS = 8
DURATION_S = float(os.environ.get("HF_SPECDEC_DEMO_LOAD_S", 20))
MAX_NEW = 12
PHASES = 3
_LIBC = ctypes.CDLL(None)  # the process's own C library
PROMPTS = [
    "Repeat exactly: the quick brown fox jumps over the lazy dog.",
    "List three colours of the rainbow.",
    "What is 12 times 12?",
    "Name a planet of the solar system.",
    "Translate 'good morning' into French.",
    "Write one sentence about the sea.",
]


def _rss_mb() -> float:
    """The resident set after a collection and glibc's ``malloc_trim`` (free pages of every malloc arena handed
    back: worker threads that come and go leave arenas holding freed memory, which is caching, not a leak)."""
    gc.collect()
    if hasattr(_LIBC, "malloc_trim"):  # glibc only
        _LIBC.malloc_trim(0)
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def _vanilla_texts(model, tokenizer) -> dict[str, str]:
    out = {}
    for prompt in PROMPTS:
        ids = chat_prompt_ids(tokenizer, prompt)
        seq = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False)
        out[prompt] = tokenizer.decode(seq[0, ids.shape[1] :], skip_special_tokens=True)
    return out


def _ask(client, prompt: str, method: str) -> dict:
    # prompt, more prompts, method, do_sample, temperature, top_p, seed, max new tokens
    return client.predict(prompt, "", method, False, 0.7, 0.9, 0, MAX_NEW, 1, api_name="/compare")[4]


class _User(threading.Thread):
    """One client session asking (prompt, method) pairs in turn until the deadline."""

    def __init__(self, url: str, index: int, deadline: float, expected: dict[str, str], methods: list[str]):
        super().__init__(daemon=True)
        self.url, self.deadline, self.expected = url, deadline, expected
        pairs = list(itertools.product(PROMPTS, methods))
        self.pairs = itertools.islice(itertools.cycle(pairs), index * 5, None)  # users start at different pairs
        self.latencies: list[float] = []
        self.failures: list[str] = []

    def run(self) -> None:
        client = gradio_client.Client(self.url, verbose=False)
        try:
            while time.monotonic() < self.deadline:
                prompt, method = next(self.pairs)
                t0 = time.perf_counter()
                try:
                    details = _ask(client, prompt, method)
                except Exception as err:  # noqa: BLE001 - every failure is reported by the test
                    self.failures.append(f"{method} {prompt!r}: {type(err).__name__}: {err}")
                    continue
                self.latencies.append(time.perf_counter() - t0)
                for side in ("vanilla", "speculative"):
                    if details[side]["text"] != self.expected[prompt]:
                        self.failures.append(f"{method} {prompt!r}: {side} {details[side]['text']!r}")
        finally:
            client.close()


def test_eight_concurrent_users_get_vanilla_texts_and_memory_stays_flat(default_model):
    from test_demo import free_port

    from hf_specdec.demo import launch

    model, tokenizer = default_model
    expected = _vanilla_texts(model, tokenizer)
    methods = available_assistants()
    app = launch("127.0.0.1", free_port(), block=False, model=model, tokenizer=tokenizer, warmup=False)
    try:
        warm = gradio_client.Client(app.local_url, verbose=False)
        for method in methods:  # each assistant loaded once; the allocator's arenas settle
            assert _ask(warm, PROMPTS[0], method)["identical_to_vanilla"] is True
        # load phases of the same length: the first warms what concurrency allocates once (a malloc arena per
        # worker thread, per-thread caches); a leak shows as growth in every later one
        rss, users, wall = [], [], 0.0
        for phase in range(PHASES):
            rss.append(_rss_mb())
            t0 = time.monotonic()
            phase_users = [_User(app.local_url, i + phase, t0 + DURATION_S, expected, methods) for i in range(USERS)]
            for user in phase_users:
                user.start()
            for user in phase_users:
                user.join(timeout=DURATION_S + 300)
            wall += time.monotonic() - t0
            users += phase_users
        rss.append(_rss_mb())
        alive = _ask(warm, PROMPTS[1], methods[-1])  # the server still answers
        warm.close()
    finally:
        app.close()
    latencies = sorted(t for u in users for t in u.latencies)
    failures = [f for u in users for f in u.failures]
    print(
        f"\ndemo load: {USERS} users, {wall:.0f} s, {len(latencies)} requests ({len(latencies) / wall:.2f}/s), "
        f"latency p50 {statistics.median(latencies):.1f} s, p95 {latencies[int(0.95 * (len(latencies) - 1))]:.1f} s, "
        f"max {latencies[-1]:.1f} s; RSS (MB) before and after each phase: {', '.join(f'{r:.0f}' for r in rss)}"
    )
    assert not any(u.is_alive() for u in users), "a user never got its answer"
    assert not failures, failures[:5]
    assert all(u.latencies for u in users), "a user was never served"
    assert alive["identical_to_vanilla"] is True
    growth = [after - before for before, after in zip(rss, rss[1:])]
    # a leak grows with the requests served, so in every phase after the first; one phase's noise does not
    assert min(growth[1:]) < max(64.0, 0.5 * growth[0]), f"the server's memory grew by {growth} MB, phase by phase"
