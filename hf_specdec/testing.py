"""Tiny random-weight models of real architectures, for tests and examples that must run anywhere in seconds."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from .generation.proposers.base import Proposer
from .generation.tree import DraftTree

# Small but structurally faithful: GQA where the architecture has it, several layers, a real head_dim.
_ARCH_KWARGS = {
    "llama": dict(num_attention_heads=4, num_key_value_heads=2),
    "qwen2": dict(num_attention_heads=4, num_key_value_heads=2),
    "qwen3": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "mistral": dict(num_attention_heads=4, num_key_value_heads=1, sliding_window=None),
    "gemma": dict(num_attention_heads=4, num_key_value_heads=1, head_dim=16),
}


def tiny_causal_lm(
    arch: str = "llama",
    vocab_size: int = 97,
    hidden_size: int = 64,
    num_layers: int = 2,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    **overrides,
):
    """A randomly initialised decoder-only model of ``arch`` (llama, qwen2, qwen3, mistral, gemma), eval mode.

    The weights are drawn with a larger-than-usual std so that logits are peaked enough to give non-trivial
    greedy continuations (a near-uniform model would make every draft fail).
    """
    if arch not in _ARCH_KWARGS:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose one of {sorted(_ARCH_KWARGS)}")
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    kwargs.update(_ARCH_KWARGS[arch])
    kwargs.update(overrides)
    config = AutoConfig.for_model(arch, **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = 2
    return model.eval()


class RandomTreeProposer(Proposer):
    """Drafts random trees (mostly wrong) with a few target-agnostic shapes; exercises every code path."""

    def __init__(self, vocab: int, nodes: int = 6, seed: int = 0):
        self.vocab, self.nodes = vocab, nodes
        self.gen = torch.Generator().manual_seed(seed)

    def propose(self, rows):
        trees = []
        for _ in rows:
            n = int(torch.randint(0, self.nodes + 1, (1,), generator=self.gen))
            parent = [int(torch.randint(-1, i, (1,), generator=self.gen)) if i else -1 for i in range(n)]
            toks = torch.randint(0, self.vocab, (n,), generator=self.gen)
            trees.append(DraftTree.from_parents(toks, parent).dedup_siblings())
        return trees


class OracleProposer(Proposer):
    """Drafts the target's own greedy continuation (from vanilla generate) plus a wrong sibling at every level."""

    def __init__(self, model, depth: int = 3):
        self.model, self.depth = model, depth

    def propose(self, rows):
        trees = []
        for r in rows:
            d = min(self.depth, r.max_depth)
            if d == 0:
                trees.append(DraftTree.empty())
                continue
            ids = self.model.generate(r.tokens[None], max_new_tokens=d, do_sample=False, pad_token_id=0)
            good = ids[0, r.tokens.numel() :].tolist()
            paths = [good[: i + 1] for i in range(len(good))]
            paths += [good[:i] + [(good[i] + 1) % self.model.config.vocab_size] for i in range(len(good))]
            trees.append(DraftTree.from_paths(sorted(paths, key=len)))
        return trees


def random_medusa_heads(model, share_lm_head: bool = True, num_heads: int = 3, seed: int = 0):
    """`MedusaHeads` for ``model`` with random weights (std 0.3): drafts that are sometimes right on a tiny model."""
    from .heads.medusa import MedusaHeads

    heads = MedusaHeads.for_model(model, num_heads=num_heads, share_lm_head=share_lm_head)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return heads


def left_pad(rows, pad=0):
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r)
        mask[i, width - len(r) :] = 1
    return ids, mask


def assert_same_tokens(actual: torch.Tensor, expected: torch.Tensor, label: str = ""):
    if actual.shape == expected.shape and torch.equal(actual, expected):
        return
    msg = [f"{label}: shapes {tuple(actual.shape)} vs {tuple(expected.shape)}"]
    for b in range(min(actual.shape[0], expected.shape[0])):
        a, e = actual[b].tolist(), expected[b].tolist()
        if a != e:
            i = next((i for i, (x, y) in enumerate(zip(a, e)) if x != y), min(len(a), len(e)))
            msg.append(f"row {b}: first difference at index {i}: got {a[i : i + 5]} expected {e[i : i + 5]}")
    raise AssertionError("\n".join(msg))
