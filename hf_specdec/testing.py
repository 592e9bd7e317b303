"""Tiny random-weight models of real architectures, for tests and examples that must run anywhere in seconds."""

from __future__ import annotations

import contextlib
import re
from collections import Counter
from dataclasses import dataclass

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


# ----------------------------------------------------------------------------------- the near-tie oracle
# A greedy output of a half-precision target may leave vanilla's where vanilla's own best two logits are within the
# dtype's rounding of each other: the verify forward computes the same logits in another order (other GEMM shapes,
# other kernels), so a near-tie can break the other way. `near_tie` decides whether a difference is such a tie; any
# other difference is a wrong token. At the first differing position, with vanilla's logits ``l`` there:
#
#     max(l) - l[t] <= k * eps(dtype) * max(max_v |l[v]|, 1)   for t = vanilla's token and for the speculative one
#
# (so the speculative token must itself be one of the near-best, not merely follow a close top-2). eps is the dtype's
# machine epsilon (bf16 2**-7, fp16 2**-10, fp32 2**-23); ``eps * max|l|`` is about one rounding step of the largest
# logits (a ulp of x is between eps*|x|/2 and eps*|x|), and the rounding a logit carries is proportional to the size
# of the products it sums, which the largest logit measures better than the best one does (the best can be small
# while others are large: 3.2 against 27, measured).
#
# k, measured (Intel Xeon with AMX; SmolLM2-135M-Instruct, 8 Spec-Bench chat prompts, 48 greedy tokens, 366
# positions; units of eps * max|l|): a logit of a plain bf16 forward of prompt + answer differs from the fp32 one by
# at most 2.6 units (99th percentile 2.1) and from vanilla's own incremental bf16 decode by at most 3.5 (2.7); what
# decides the argmax, the top-2 gap, moves by at most 1.8 (bf16 vs fp32) and 2.1 (plain vs incremental bf16; 99th
# percentile 1.6). A speculative token that wins a near-tie needs vanilla's gap within one such disagreement (the
# verify forward against vanilla's decode), and the oracle reads the gap from a third computation (its plain forward):
# two disagreements, 2 x 2.1 = 4.2, rounded up to k = 5. fp16 (same model, same prompts): see NEAR_TIE_K. The price:
# vanilla's top-2 gap is within 5 units at about a third of this model's positions in bf16 (94 of 366 within 4, 153
# within 8), which is why the speculative token itself must be near the best, not only vanilla's second.
#
# A mixture of experts makes a discrete choice upstream: its router keeps the top-k experts of each token, and where
# the k-th and (k+1)-th router logits are within the same bound (of the router logits' own magnitude) the two orders
# can route a token to different experts, which moves the final logits by far more than rounding (measured on a tiny
# bf16 gpt_oss: router logits 0.2832 and 0.2793, one bf16 step apart, moved a logit by 1.3). When the final logits
# are not a near-tie, `near_tie` recomputes the prefix's router logits (modules with an int ``top_k`` whose class name
# has "Router") and accepts the difference only where such a routing near-tie can reach the position's logits: at the
# last position in any layer, or at an earlier one in a layer before the last (whose output later layers attend to).
NEAR_TIE_K = 5.0


@dataclass(frozen=True)
class NearTie:
    """The oracle's verdict on one row (`near_tie`).

    ``position``: the generated index of the first token where the speculative output leaves vanilla's (None: equal);
    ``vanilla_token`` / ``speculative_token``: the tokens there; ``top2_gap``: vanilla's best logit minus its second
    there; ``gap``: vanilla's best logit minus the lower of the two tokens' logits (>= ``top2_gap``); ``bound``:
    ``k * eps(dtype) * max(max|l|, 1)``; ``units``: ``gap`` in units of ``eps * max(max|l|, 1)``; ``near_tie``: ``gap
    <= bound``. ``ok``: equal, or first different at a near-tie.
    """

    position: int | None
    vanilla_token: int | None = None
    speculative_token: int | None = None
    top2_gap: float = 0.0
    gap: float = 0.0
    bound: float = 0.0
    units: float = 0.0
    near_tie: bool = True
    dtype: str = ""
    router: str = ""  # the routing near-tie that explains the difference, when the final logits do not

    @property
    def ok(self) -> bool:
        return self.position is None or self.near_tie

    def __str__(self) -> str:
        if self.position is None:
            return "equal to vanilla"
        verdict = "near-tie" if self.near_tie else "WRONG TOKEN"
        if self.router:
            verdict = f"near-tie upstream ({self.router})"
        return (
            f"{verdict} at generated position {self.position}: vanilla {self.vanilla_token}, speculative "
            f"{self.speculative_token}; gap {self.gap:.4g} (top-2 gap {self.top2_gap:.4g}, {self.units:.2f} eps units), "
            f"bound {self.bound:.4g} ({self.dtype})"
        )


def first_difference(a: list[int], b: list[int], pad: int | None = None) -> int | None:
    """The first index where two token lists differ (a missing token reads as ``pad``), or None."""
    for t in range(max(len(a), len(b))):
        x = a[t] if t < len(a) else pad
        y = b[t] if t < len(b) else pad
        if x != y:
            return t
    return None


def near_tie(
    model,
    prompt,
    vanilla,
    speculative,
    *,
    scores: torch.Tensor | None = None,
    pad_token_id: int | None = None,
    k: float | None = None,
) -> NearTie:
    """Whether a speculative greedy output equals vanilla's, or first leaves it where vanilla's own top-2 logits are
    within the dtype's rounding of each other (the bound is in the comment above `NEAR_TIE_K`).

    Args:
        model: the target (its parameters' dtype sets eps).
        prompt: `[P]` the prompt's tokens (padding removed).
        vanilla, speculative: the generated tokens (after the prompt) of vanilla generate and of the speculative call.
        scores: `[G, V]` or a list of `[V]`: vanilla's own processed scores per generated step (``output_scores``), to
            judge calls with logits processors; None: vanilla's logits at the position are recomputed by one plain
            forward of ``prompt + vanilla[:position]`` (batch 1, no padding) in the model's dtype.
        pad_token_id: what a missing token reads as (a row one output ended earlier).
        k: the bound's factor (default `NEAR_TIE_K`).
    """
    to_list = lambda x: x.tolist() if torch.is_tensor(x) else list(x)  # noqa: E731
    prompt, vanilla, speculative = to_list(prompt), to_list(vanilla), to_list(speculative)
    pos = first_difference(vanilla, speculative, pad_token_id)
    dtype = next(model.parameters()).dtype
    if pos is None:
        return NearTie(None, dtype=str(dtype).removeprefix("torch."))
    v = vanilla[pos] if pos < len(vanilla) else pad_token_id
    s = speculative[pos] if pos < len(speculative) else pad_token_id
    if scores is not None:
        logits = scores[pos].reshape(-1).float() if pos < len(scores) else None
    else:
        device = next(model.parameters()).device
        ids = torch.tensor([prompt + vanilla[:pos]], device=device)
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0, -1].float().cpu()
    eps = torch.finfo(dtype).eps
    k = NEAR_TIE_K if k is None else k
    if logits is None or v is None or s is None:
        return NearTie(
            pos, v, s, float("inf"), float("inf"), 0.0, float("inf"), False, str(dtype).removeprefix("torch.")
        )
    top = logits.topk(2).values
    best = float(top[0])
    finite = logits[torch.isfinite(logits)]
    scale = eps * max(float(finite.abs().max()) if finite.numel() else 0.0, 1.0)
    gap = best - min(float(logits[v]), float(logits[s]))
    gap = gap if gap == gap else float("inf")  # nan (inf - inf): not a tie
    bound = k * scale
    router = "" if gap <= bound else _routing_near_tie(model, prompt + vanilla[:pos], eps, k)
    return NearTie(
        pos,
        v,
        s,
        float(top[0] - top[1]),
        gap,
        bound,
        gap / scale,
        gap <= bound or bool(router),
        str(dtype).removeprefix("torch."),
        router,
    )


def _routing_near_tie(model, ids: list[int], eps: float, k: float) -> str:
    """The first mixture-of-experts routing near-tie of a plain forward of ``ids`` (a router's k-th and (k+1)-th
    logits within ``k * eps * max(max|router logit|, 1)`` at some position), described, or "" (none, or no router)."""
    routers = [(n, m) for n, m in model.named_modules() if isinstance(getattr(m, "top_k", None), int)
               and "router" in type(m).__name__.lower()]  # fmt: skip
    if not routers or not ids:
        return ""
    found: list[str] = []
    layer_of = lambda name: int(m.group(1)) if (m := re.search(r"layers\.(\d+)\.", name)) else -1  # noqa: E731
    last_layer = max(layer_of(n) for n, _ in routers)

    def hook(name: str, top_k: int):
        def record(module, args, out):
            r = None if found else _router_logits(out, top_k)  # [positions, experts]
            if r is None:
                return
            ranked = r.sort(-1, descending=True).values
            gap = ranked[:, top_k - 1] - ranked[:, top_k]
            bound = k * eps * r.abs().amax(-1).clamp_min(1.0)
            hits = [p for p in (gap <= bound).nonzero().flatten().tolist()
                    if p == r.shape[0] - 1 or layer_of(name) < last_layer or layer_of(name) < 0]  # fmt: skip
            if hits:
                p = hits[0]
                found.append(f"{name} at prefix position {p}: experts' logits {float(ranked[p, top_k - 1]):.4g} and "
                             f"{float(ranked[p, top_k]):.4g} around its top-{top_k}")  # fmt: skip

        return record

    handles = [m.register_forward_hook(hook(n, m.top_k)) for n, m in routers]
    try:
        device = next(model.parameters()).device
        x = torch.tensor([ids], device=device)
        with torch.no_grad():
            model(input_ids=x, attention_mask=torch.ones_like(x))
    finally:
        for h in handles:
            h.remove()
    return found[0] if found else ""


def _router_logits(out, top_k: int) -> torch.Tensor | None:
    """`[positions, experts]` router logits from a router's output: of its tensors wider than ``top_k``, the one with
    the most distinct values (the logits; scores masked to the top-k have fewer, and Llama 4's router returns such
    scores before its logits), or None."""
    tensors = [t for t in (out if isinstance(out, tuple) else (out,))
               if torch.is_tensor(t) and t.is_floating_point() and t.dim() and t.shape[-1] > top_k]  # fmt: skip
    if not tensors:
        return None
    best = max(tensors, key=lambda t: t.unique().numel())  # the first of equals
    return best.detach().float().reshape(-1, best.shape[-1])


def near_ties(model, input_ids, attention_mask, vanilla, speculative, *, pad_token_id: int | None = None):
    """`near_tie` of every row of a left-padded batch: ``input_ids`` / ``attention_mask`` `[B, W]`, ``vanilla`` and
    ``speculative`` the two generate outputs (`[B, W + G]`, sequences). Returns one `NearTie` per row."""
    width = input_ids.shape[1]
    if pad_token_id is None:
        pad = model.generation_config.pad_token_id
        pad_token_id = int(torch.as_tensor(pad).reshape(-1)[0]) if pad is not None else None
    out = []
    for r in range(input_ids.shape[0]):
        prompt = input_ids[r][attention_mask[r].bool()] if attention_mask is not None else input_ids[r]
        out.append(near_tie(model, prompt, vanilla[r, width:], speculative[r, width:], pad_token_id=pad_token_id))
    return out


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
