"""Soak: 1,000 consecutive speculative calls on one tiny model, batch sizes and assistants mixed. Every call gives
vanilla's greedy output, every planned model (target and draft) gives all its cache blocks back, the cache pools do
not grow from call to call, and the process's memory (RSS) stays flat."""

from __future__ import annotations

import gc
import itertools

import pytest
import torch

from hf_specdec import DraftModelAssistant, FallbackAssistant, MedusaAssistant, NgramAssistant
from hf_specdec.generation import target as target_module
from hf_specdec.testing import left_pad, random_medusa_heads, tiny_causal_lm

CALLS = 1000
PROMPTS = [[5, 6, 7, 8, 5, 6, 7], [11, 12, 13, 14, 11, 12], [3, 9, 3, 9, 3], [21, 22, 23, 24, 25, 21, 22, 23]]


def _rss_bytes() -> int:
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.slow
def test_a_thousand_mixed_calls_keep_memory_and_cache_flat(monkeypatch):
    model = tiny_causal_lm("llama", hidden_size=32, num_layers=1)
    draft = tiny_causal_lm("llama", hidden_size=32, num_layers=1, seed=3)
    heads = random_medusa_heads(model, num_heads=2)
    assistants = [
        NgramAssistant,
        lambda: MedusaAssistant(heads),
        lambda: DraftModelAssistant(draft, depth=2),
        lambda: FallbackAssistant(NgramAssistant(), MedusaAssistant(heads)),
    ]
    closed: list[tuple[int, int]] = []  # per closed PlannedModel: (blocks in use, pool blocks)
    real_close = target_module.PlannedModel.close

    def close(self):
        real_close(self)
        closed.append((self.cache.allocator.blocks_in_use(), self.cache.allocator.num_blocks))

    monkeypatch.setattr(target_module.PlannedModel, "close", close)
    batches = {n: left_pad(PROMPTS[:n]) for n in (1, 2, 4)}
    expected = {n: model.generate(ids, attention_mask=mask, max_new_tokens=6) for n, (ids, mask) in batches.items()}
    rss = []
    for i, (make, n) in enumerate(itertools.islice(itertools.cycle(itertools.product(assistants, (1, 2, 4))), CALLS)):
        ids, mask = batches[n]
        out = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, assistant=make())
        assert torch.equal(out, expected[n]), f"call {i}: batch {n} differs from vanilla"
        if i % 100 == 99:
            gc.collect()
            rss.append(_rss_bytes())
    assert all(used == 0 for used, _ in closed), "a planned model kept cache blocks after its call"
    assert max(pool for _, pool in closed) <= 64, "cache pools grew beyond what one call needs"
    growth = rss[-1] - rss[1]  # after warm-up (allocator arenas, lazily built kernels)
    assert growth < 32 * 2**20, f"RSS grew by {growth / 2**20:.1f} MiB over {CALLS - 200} calls: {rss}"
