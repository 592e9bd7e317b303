"""Tiny random-weight models of real architectures, for tests and examples that must run anywhere in seconds.

Test helpers: this module imports the package, and no module of the package imports it
(tests/unit/test_import_layers.py).
"""

from __future__ import annotations

import contextlib
from collections import Counter

import torch
from transformers import AutoConfig, AutoModelForCausalLM

# the near-tie oracle lives with the bench that judges its mismatches by it; the tests import it from here too
from .bench.near_tie import (  # noqa: F401
    NEAR_TIE_K,
    NearTie,
    _router_logits,
    _routing_near_tie,
    first_difference,
    near_tie,
    near_ties,
)
from .generation.proposers.base import Proposer
from .generation.tree import DraftTree

# Small but structurally faithful: GQA where the architecture has it, several layers, a real head_dim.
_ARCH_KWARGS = {
    "llama": dict(num_attention_heads=4, num_key_value_heads=2),
    "qwen2": dict(num_attention_heads=4, num_key_value_heads=2),
    "qwen3": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "mistral": dict(num_attention_heads=4, num_key_value_heads=1, sliding_window=None),
    "gemma": dict(num_attention_heads=4, num_key_value_heads=1, head_dim=16),
    # soft-capped logits and attention, sliding-window layers beside global ones (windows shorter than the text)
    "gemma2": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8),
    # attention sinks (s_aux), sliding windows, a mixture of experts
    "gpt_oss": dict(
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=8,
        num_local_experts=4,
        num_experts_per_tok=2,
    ),
    # Llama 4: chunked attention (chunks of 8 tokens, shorter than the fuzzer's texts) with RoPE in layer 0, a NoPE
    # full-attention layer 1 with a mixture of experts (top-2 of 4 beside a shared expert); floor_scale stays at its
    # default, so NoPE layers' attention temperature is 1 (vanilla counts left padding in the positions it scales by)
    "llama4_text": dict(
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        attention_chunk_size=8,
        no_rope_layer_interval=2,
        interleave_moe_layer_step=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        intermediate_size_mlp=128,
    ),
    # hybrids whose recurrent layers are verified on trees: at least `HYBRID_LAYERS` layers (one recurrent, one
    # attention: a model of recurrent layers alone fails in vanilla generate too), the pattern repeated over them
    "lfm2": dict(num_attention_heads=4, num_key_value_heads=2, layer_types=["conv", "full_attention"]),
    "qwen3_next": dict(
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
    ),
    # Mamba-2 mixers scanning in chunks of 8 (prompts and trees cross chunk boundaries)
    "bamba": dict(
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_layer_indices=[1],
        mamba_n_heads=8,
        mamba_d_head=16,
        mamba_n_groups=1,
        mamba_d_state=16,
        mamba_chunk_size=8,
    ),
    "jamba": dict(  # Mamba-1 mixers, attention and experts every second layer
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        mamba_dt_rank=8,
        mamba_d_state=16,
        num_experts=4,
        num_experts_per_tok=2,
    ),
}

# The plain-attention architectures the core equality and cache tests run on every time (the fuzzer covers the rest).
CORE_ARCHS = ("llama", "qwen3", "mistral", "gemma")
HYBRIDS = ("lfm2", "qwen3_next", "bamba", "jamba")
HYBRID_LAYERS = 2


def tiny_causal_lm(
    arch: str = "llama",
    vocab_size: int = 97,
    hidden_size: int = 64,
    num_layers: int = 2,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    **overrides,
):
    """A randomly initialised decoder-only model of ``arch`` (llama, qwen2, qwen3, mistral, gemma, gemma2, gpt_oss,
    llama4_text, and the hybrids lfm2, qwen3_next, bamba, jamba), eval mode.

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
    if arch in HYBRIDS:
        num_layers = kwargs["num_hidden_layers"] = max(num_layers, HYBRID_LAYERS)
    if "layer_types" in kwargs:  # a hybrid's pattern, repeated over the model's layers
        kinds = kwargs["layer_types"]
        kwargs["layer_types"] = [kinds[i % len(kinds)] for i in range(num_layers)]
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


def spec_bench_batch(tokenizer, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`[B, W]` left-padded input ids and attention mask of the first turns of ``batch`` (at most 4) shipped Spec-Bench
    questions from different categories, through the tokenizer's chat template: a real batch for the default model."""
    from .bench.questions import find_questions_file, load_questions
    from .models import chat_prompt_ids

    questions = load_questions(find_questions_file())
    picks = [questions[i]["turns"][0] for i in (0, 41, 122, 200)][:batch]
    return left_pad([chat_prompt_ids(tokenizer, q)[0].tolist() for q in picks], pad=tokenizer.pad_token_id or 0)


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


@contextlib.contextmanager
def torch_threads(n: int):
    """Within: ``torch.set_num_threads(n)`` (tiny per-row tensor ops only lose to thread wake-ups on a busy CPU)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|> ' + m['role'] + ' ' + m['content'] + ' <|im_end|> ' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|> assistant ' }}{% endif %}"
)


def tiny_chat_tokenizer(words: list[str], vocab_size: int = 97, chat_template: str | None = TINY_CHAT_TEMPLATE):
    """A real fast tokenizer (word level, split on whitespace) over ``words`` and the chat markers, with a ChatML
    chat template (``chat_template=None``: none, as a base model's tokenizer), for the tiny models: ids 0-4 are pad,
    bos, ``<|im_end|>`` (the tiny models' EOS), unk and ``<|im_start|>``; unknown words map to unk. Needs
    ``len(set(words)) + 5 <= vocab_size``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "<|im_end|>", "<unk>", "<|im_start|>"]
    vocab = {w: i for i, w in enumerate(specials + sorted(set(words) - set(specials)))}
    if len(vocab) > vocab_size:
        raise ValueError(f"{len(vocab)} words do not fit a vocabulary of {vocab_size}")
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>",
                                  eos_token="<|im_end|>", unk_token="<unk>")  # fmt: skip
    tok.chat_template = chat_template
    return tok


def char_tokenizer(vocab: int = 97):
    """A fast tokenizer with one printable character per token id (``chr(33 + id)``), for the tiny models where a
    call needs a real tokenizer (``stop_strings``; `StopStringCriteria` reads 'a'..'f' from the vocabulary)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(33 + i) for i in range(vocab)]
    backend = Tokenizer(models.WordLevel(vocab={c: i for i, c in enumerate(chars)}, unk_token=chars[0]))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token=chars[0])


def toy_encode(text: str, vocab: int = 97) -> list[int]:
    """A stand-in tokenizer for the tiny models: BOS + one id per word (ids 3..vocab-1), at most 6 words."""
    return [1] + [3 + sum(map(ord, w)) % (vocab - 3) for w in text.split()[:6]]


# ----------------------------------------------------------------------------------- exact sampling, end to end
# A tiny target whose first three sampled tokens have a joint distribution small enough to enumerate exactly: a
# sampled run with an assistant is compared with it by chi-square (3000 rows: 5 sigma on a cell of probability 0.3
# is a bias of 0.042), and a wrong verifier (`greedy_verification`) must be rejected.
SAMPLING_VOCAB = 8
SAMPLING_PROMPT = (1, 5, 3, 6)
SAMPLING_WARPERS = dict(temperature=0.8, top_k=5)


def sampling_target():
    """The tiny target of the exact-sampling checks: vocabulary `SAMPLING_VOCAB`, peaked but not degenerate
    next-token distributions."""
    model = tiny_causal_lm(vocab_size=SAMPLING_VOCAB, hidden_size=32, num_layers=2, seed=0)
    with torch.no_grad():
        model.lm_head.weight.mul_(2.0)
    return model


def sample_first_tokens(model, assistant, rows: int, *, check_power: bool = True, **generate_kwargs) -> Counter:
    """Counts of the first 3 tokens of ``rows`` rows sampled from `SAMPLING_PROMPT` with ``assistant`` (padded
    after EOS). ``check_power``: fail when 2-token drafts are rarely accepted (the check would then be vacuous)."""
    ids = torch.tensor([list(SAMPLING_PROMPT)] * rows)  # [rows, P]
    torch.manual_seed(0)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), assistant=assistant, do_sample=True,
                         max_new_tokens=4, return_dict_in_generate=True, **SAMPLING_WARPERS, **generate_kwargs)  # fmt: skip
    per_depth = out.spec_stats.accepted_per_depth
    if check_power:
        assert len(per_depth) > 1 and per_depth[1] > 0.05 * rows, f"vacuous: 2-token drafts rarely accepted {per_depth}"
    pad = int(model.generation_config.pad_token_id)
    gen = torch.cat([out.sequences[:, len(SAMPLING_PROMPT) :], torch.full((rows, 3), pad)], 1)[:, :3]  # [rows, 3]
    return Counter(tuple(r) for r in gen.tolist())


def exact_first_tokens(model, length: int) -> dict[tuple[int, ...], float]:
    """P(first ``length`` generated tokens after `SAMPLING_PROMPT`), enumerated in fp64 from vanilla generate's own
    processed scores (a row that emitted EOS is padded)."""
    eos, pad = int(model.generation_config.eos_token_id), int(model.generation_config.pad_token_id)
    probs: dict[tuple[int, ...], list[float]] = {}
    frontier: list[tuple[int, ...]] = [()]
    for _ in range(length):
        live = [g for g in frontier if eos not in g]
        ids = torch.tensor([list(SAMPLING_PROMPT) + list(g) for g in live])
        out = model.generate(ids, do_sample=True, max_new_tokens=1, output_scores=True, return_dict_in_generate=True,
                             attention_mask=torch.ones_like(ids), **SAMPLING_WARPERS)  # fmt: skip
        for g, scores in zip(live, out.scores[0].double()):
            probs[g] = torch.softmax(scores, -1).tolist()
        frontier = [g + (t,) for g in live for t in range(model.config.vocab_size)]
    joint: dict[tuple[int, ...], float] = {}

    def walk(prefix: tuple[int, ...], p: float) -> None:
        if len(prefix) == length:
            joint[prefix] = joint.get(prefix, 0.0) + p
        elif eos in prefix:
            walk(prefix + (pad,), p)
        else:
            for tok, q in enumerate(probs[prefix]):
                if q > 0:
                    walk(prefix + (tok,), p * q)

    walk((), 1.0)
    return joint


def first_tokens_p_values(counts: Counter, model) -> list[float]:
    """Chi-square p-values of the sampled first 1, 2 and 3 tokens (`sample_first_tokens`) against
    `exact_first_tokens` (cells expected fewer than 5 times pooled). Needs scipy (the ``test`` extra)."""
    from scipy.stats import chisquare

    out = []
    n = sum(counts.values())
    for length in (1, 2, 3):
        joint = exact_first_tokens(model, length)
        observed = Counter()
        for seq, c in counts.items():
            observed[seq[:length]] += c
        assert set(observed) <= {k for k, p in joint.items() if p > 0}, "sampled an impossible sequence"
        keys = [k for k, p in joint.items() if p * n >= 5]
        f_obs = [observed[k] for k in keys] + [n - sum(observed[k] for k in keys)]
        f_exp = [joint[k] * n for k in keys] + [n * (1 - sum(joint[k] for k in keys))]
        if f_exp[-1] < 1e-9:
            f_obs, f_exp = f_obs[:-1], f_exp[:-1]
        out.append(float(chisquare(f_obs, f_exp).pvalue))
    return out


@contextlib.contextmanager
def greedy_verification():
    """Within: the loop verifies every tree greedily, also when sampling: the wrong verifier a sampling check must
    reject (its negative control). Not thread-safe: it swaps ``generation.loop.verify_tree``."""
    from .generation import loop

    real = loop.verify_tree
    loop.verify_tree = lambda tree, scores, **kw: real(tree, scores, **{**kw, "do_sample": False})
    try:
        yield
    finally:
        loop.verify_tree = real
