"""What the differential fuzzer draws: a tiny random target, a left-padded batch, generation options and an assistant.

A drawn `Call` is plain data (names, numbers, lists), so hypothesis prints it and shrinks it, an ``@example`` can
hold it, and `Call.code` writes the Python that reproduces it. The objects (model, assistant, tokenizer) are built
from it by `build_model`, `build_assistant` and `char_tokenizer`.

Assistants live in one registry, `ASSISTANTS`: a name, a strategy of its options and a builder from
``(target, options)``. Adding an assistant is one entry.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.database import DirectoryBasedExampleDatabase

import hf_specdec
from hf_specdec import testing
from hf_specdec.generation.proposers.draft_model import DraftModelAssistant
from hf_specdec.generation.proposers.eagle import EagleAssistant
from hf_specdec.generation.proposers.fallback import FallbackAssistant
from hf_specdec.generation.proposers.medusa import MedusaAssistant
from hf_specdec.generation.proposers.mlp_speculator import MLPSpeculatorAssistant
from hf_specdec.heads.eagle import EagleHead
from hf_specdec.heads.medusa import MedusaHeads
from hf_specdec.heads.mlp_speculator import MLPSpeculator
from hf_specdec.testing import _ARCH_KWARGS, RandomTreeProposer, tiny_causal_lm

VOCAB = 97  # every tiny target and draft shares it (a draft model must have the target's vocabulary)
PAD, EOS = 0, 2  # tiny_causal_lm's ids
ARCHS = sorted(_ARCH_KWARGS)
TARGETS_ENV = "HF_SPECDEC_FUZZ_TARGETS"  # comma-separated architectures: draw only these targets (default: ARCHS)


def target_archs() -> list[str]:
    """The architectures targets are drawn from: ``HF_SPECDEC_FUZZ_TARGETS`` when set, else every one of `ARCHS`
    (draft models are drawn from all of `ARCHS` either way)."""
    names = [a.strip() for a in os.environ.get(TARGETS_ENV, "").split(",") if a.strip()]
    unknown = sorted(set(names) - set(ARCHS))
    if unknown:
        raise ValueError(f"{TARGETS_ENV}: unknown architectures {unknown}; choose among {', '.join(ARCHS)}")
    return names or ARCHS


# ------------------------------------------------------------------------------------------------ the call
@dataclass(frozen=True)
class Target:
    """A tiny random target model (`tiny_causal_lm`), in ``dtype`` (the bf16 / fp16 profiles draw half-precision
    targets, whose greedy differences are judged by the near-tie oracle, `hf_specdec.testing.near_tie`)."""

    arch: str
    seed: int = 0
    layers: int = 2
    dtype: torch.dtype = torch.float32


@dataclass
class Call:
    """One ``model.generate`` call with an assistant, as plain data.

    ``prompts`` are the rows (left-padded when their lengths differ or ``mask`` is set); ``options`` are generate's
    keyword arguments; ``assistant`` is ``(registry name, its options)``; ``streamer`` records the streamed ids;
    ``via_config`` passes the options in a ``GenerationConfig`` instead of as keywords.
    """

    target: Target
    prompts: list[list[int]]
    options: dict
    assistant: tuple[str, dict]
    mask: bool = True
    streamer: bool = False
    via_config: bool = False
    tree_budget: bool = True
    refused: tuple[str, dict] | None = None  # an option we refuse: (what its error names, the option)

    @property
    def greedy(self) -> bool:
        return not self.options.get("do_sample", False)

    def code(self) -> str:
        """Python that reproduces the call (from the repository root, with tests/fuzz on ``sys.path``)."""
        name, assistant_options = self.assistant
        options = {**self.options, **(self.refused[1] if self.refused else {})}
        extra = "".join(
            [
                ", attention_mask=mask" if self.mask else "",
                ", tokenizer=char_tokenizer()" if "stop_strings" in options else "",
                ", streamer=RecordingStreamer()" if self.streamer else "",
            ]
        )
        if self.via_config:
            setup = "config = copy.deepcopy(model.generation_config); config.update(**options)"
            how = "generation_config=config"
        else:
            setup, how = "", "**options"
        budget = "" if self.tree_budget else ", tree_budget=False"
        lines = [
            "import copy, torch, hf_specdec",
            "from hf_specdec.testing import tiny_causal_lm, left_pad",
            "from fuzz_calls import build_assistant, char_tokenizer, RecordingStreamer",
            f"model = tiny_causal_lm({self.target.arch!r}, seed={self.target.seed}, num_layers={self.target.layers}"
            + (f", dtype={self.target.dtype})" if self.target.dtype != torch.float32 else ")"),
            f"ids, mask = left_pad({self.prompts!r})",
            f"options = {options!r}",
            setup,
            f"expected = model.generate(ids{extra}, {how})",
            f"assistant = build_assistant(model, {name!r}, {assistant_options!r})",
            f"out = model.generate(ids{extra}, {how}, assistant=assistant{budget})",
        ]
        return "\n".join(line for line in lines if line)


# ------------------------------------------------------------------------------------------------ objects
@functools.lru_cache(maxsize=24)
def build_model(target: Target):
    """The tiny target (cached: tests must leave it unchanged, which the fuzzer checks)."""
    return tiny_causal_lm(target.arch, seed=target.seed, num_layers=target.layers, dtype=target.dtype)


@functools.lru_cache(maxsize=1)
def char_tokenizer():
    """`testing.char_tokenizer` of the tiny vocabulary (``stop_strings`` need a real tokenizer): id i is chr(33 + i)."""
    return testing.char_tokenizer(VOCAB)


def token_text(ids: list[int]) -> str:
    return "".join(chr(33 + i) for i in ids)


class RecordingStreamer:
    """A transformers streamer that keeps every id it is given (``put``) and whether it was ended."""

    def __init__(self):
        self.ids: list[int] = []
        self.ended = False

    def put(self, value: torch.Tensor) -> None:
        self.ids.extend(value.reshape(-1).tolist())

    def end(self) -> None:
        self.ended = True


def _randomised(module: torch.nn.Module, seed: int, std: float) -> torch.nn.Module:
    """``module`` with every matrix redrawn ~ N(0, std) from ``seed`` (random heads that are sometimes right)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return module.eval()


def _draft_vocab(size: int | None, seed: int) -> torch.Tensor | None:
    """`[size]` sorted distinct token ids drawn from ``seed``, or None (the full vocabulary)."""
    if size is None:
        return None
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(VOCAB, generator=g)[:size].sort().values


def _ngram(target, o: dict):
    return hf_specdec.NgramAssistant(**o)


def _draft_model(target, o: dict):
    draft = build_model(Target(o["arch"], o["seed"], o["layers"], target.dtype))  # the target's dtype
    return DraftModelAssistant(draft, **o["tree"]) if o["tree"] is not None else draft


def _layer_skip(target, o: dict):
    """The target's own first layers as its draft: it drafts over the target's cache (`models.is_first_layers_of`)."""
    draft = hf_specdec.draft_model_from_layers(target, min(o["layers"], target.config.num_hidden_layers))
    vocab = _draft_vocab(o["draft_vocab"], o["seed"])
    return DraftModelAssistant(draft, **(o["tree"] or {}), draft_vocab=vocab)


def _medusa(target, o: dict):
    heads = MedusaHeads.for_model(
        target,
        num_heads=o["num_heads"],
        num_layers=o["num_layers"],
        share_lm_head=o["share_lm_head"],
        draft_vocab_size=o["draft_vocab"],
    )
    _randomised(heads, o["seed"], 0.3)
    if o["draft_vocab"] is not None:
        heads.token_map.copy_(_draft_vocab(o["draft_vocab"], o["seed"]))
    return MedusaAssistant(heads, num_nodes=o["num_nodes"]) if o["num_nodes"] is not None else heads


def _eagle(target, o: dict):
    torch.manual_seed(o["seed"])
    head = EagleHead.for_model(target, version=o["version"], draft_vocab=_draft_vocab(o["draft_vocab"], o["seed"]))
    _randomised(head, o["seed"], 0.1)
    return EagleAssistant(head, **o["tree"]) if o["tree"] is not None else head


def _mlp(target, o: dict):
    spec = MLPSpeculator.for_model(
        target,
        inner_dim=o["inner_dim"],
        n_predict=len(o["top_k"]),
        token_map=_draft_vocab(o["draft_vocab"], o["seed"]),
        top_k_tokens_per_head=o["top_k"],
        tie_weights=o["tie_weights"],
        scale_input=o["scale_input"],
    )
    _randomised(spec, o["seed"], 0.2)
    return MLPSpeculatorAssistant(spec) if o["wrap"] else spec


def _fallback(target, o: dict):
    return FallbackAssistant(
        *(build_assistant(target, name, sub) for name, sub in o["assistants"]), handoff=o["handoff"]
    )


def _random_tree(target, o: dict):
    return RandomTreeProposer(VOCAB, nodes=o["nodes"], seed=o["seed"])


def _sizes(low: int, high: int):
    return st.integers(low, high)


_SEED = st.integers(0, 7)
_DRAFT_VOCAB = st.none() | st.integers(8, VOCAB - 1)


@st.composite
def _ngram_options(draw) -> dict:
    max_ngram = draw(_sizes(1, 5))
    return {
        "max_ngram": max_ngram,
        "min_ngram": draw(_sizes(1, max_ngram)),
        "max_depth": draw(_sizes(1, 10)),
        "max_matches": draw(_sizes(1, 8)),
        "max_nodes": draw(st.none() | _sizes(1, 48)),
        "min_score": draw(st.none() | st.sampled_from([0.0, 0.02, 0.1, 0.5, 1.0])),
        "adaptive": draw(st.booleans()),
        "decay": draw(st.sampled_from([0.0, 0.5, 0.9, 1.0])),
    }


_DRAFT_TREE = st.none() | st.fixed_dictionaries(
    {"depth": _sizes(1, 5), "top_k": _sizes(1, 3), "num_nodes": _sizes(1, 16)}
)
_EAGLE_TREE = st.none() | st.fixed_dictionaries(
    {"top_k": _sizes(1, 8), "depth": _sizes(1, 6), "num_nodes": _sizes(0, 40)}
)


@dataclass(frozen=True)
class AssistantKind:
    """One assistant of the registry: its options' strategy and ``build(target, options) -> assistant``."""

    options: st.SearchStrategy
    build: Callable = field(compare=False)


ASSISTANTS: dict[str, AssistantKind] = {
    "ngram": AssistantKind(_ngram_options(), _ngram),
    "draft-model": AssistantKind(
        st.fixed_dictionaries(
            {"arch": st.sampled_from(ARCHS), "seed": _SEED, "layers": _sizes(1, 2), "tree": _DRAFT_TREE}
        ),
        _draft_model,
    ),
    "layer-skip": AssistantKind(
        st.fixed_dictionaries(
            {"seed": _SEED, "layers": _sizes(1, 3), "tree": _DRAFT_TREE, "draft_vocab": _DRAFT_VOCAB}
        ),
        _layer_skip,
    ),
    "medusa": AssistantKind(
        st.fixed_dictionaries(
            {
                "seed": _SEED,
                "num_heads": _sizes(1, 4),
                "num_layers": _sizes(0, 2),
                "share_lm_head": st.booleans(),
                "draft_vocab": _DRAFT_VOCAB,
                "num_nodes": st.none() | _sizes(1, 64),
            }
        ),
        _medusa,
    ),
    "eagle": AssistantKind(
        st.fixed_dictionaries(
            {"seed": _SEED, "version": st.sampled_from([1, 3]), "draft_vocab": _DRAFT_VOCAB, "tree": _EAGLE_TREE}
        ),
        _eagle,
    ),
    "mlp-speculator": AssistantKind(
        st.fixed_dictionaries(
            {
                "seed": _SEED,
                "inner_dim": st.sampled_from([0, 16, 32]),
                "top_k": st.lists(_sizes(1, 4), min_size=1, max_size=3),
                "draft_vocab": _DRAFT_VOCAB,
                "tie_weights": st.booleans(),
                "scale_input": st.booleans(),
                "wrap": st.booleans(),
            }
        ),
        _mlp,
    ),
    "random-tree": AssistantKind(st.fixed_dictionaries({"nodes": _sizes(0, 12), "seed": _SEED}), _random_tree),
}
_SINGLE = sorted(ASSISTANTS)


@st.composite
def _fallback_options(draw) -> dict:
    names = draw(st.lists(st.sampled_from(_SINGLE), min_size=2, max_size=3))
    return {
        "assistants": [(n, draw(ASSISTANTS[n].options)) for n in names],
        "handoff": draw(st.sampled_from([0.0, 1.0, 1.3, 5.0])),
    }


ASSISTANTS["fallback"] = AssistantKind(_fallback_options(), _fallback)


def build_assistant(target, name: str, options: dict):
    """The assistant ``name`` of `ASSISTANTS` built for ``target`` from drawn ``options``."""
    return ASSISTANTS[name].build(target, options)


# ------------------------------------------------------------------------------------------------ strategies
@st.composite
def assistants(draw) -> tuple[str, dict]:
    name = draw(st.sampled_from(sorted(ASSISTANTS)))
    return name, draw(ASSISTANTS[name].options)


_TOKEN = st.integers(0, VOCAB - 1)


@st.composite
def prompts(draw) -> list[list[int]]:
    """1-4 rows of 1-12 tokens; some rows repeat a short alphabet (so that prompt lookup finds matches)."""
    rows = []
    for _ in range(draw(_sizes(1, 4))):
        alphabet = draw(st.lists(_TOKEN, min_size=1, max_size=4)) if draw(st.booleans()) else None
        token = st.sampled_from(alphabet) if alphabet else _TOKEN
        rows.append(draw(st.lists(token, min_size=1, max_size=12)))
    return rows


def _token_lists(max_lists: int, max_len: int):
    return st.lists(st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=max_len), min_size=1, max_size=max_lists)


@st.composite
def options(draw, batch: int) -> dict:
    """Generation options from the set hf_specdec honours, each drawn or left out."""
    opts: dict = {}
    if draw(st.booleans()):
        opts["max_new_tokens"] = draw(_sizes(1, 64))
    else:
        opts["max_length"] = draw(_sizes(2, 12 + 64))  # may be shorter than a prompt (12 tokens at most)
    sample = draw(st.booleans())
    opts["do_sample"] = sample
    maybe = lambda: draw(st.integers(0, 4)) == 0  # noqa: E731  (each processor in about one call of five)
    if sample:
        if maybe():
            opts["temperature"] = draw(st.sampled_from([0.3, 0.7, 1.0, 1.5]))
        if maybe():
            opts["top_k"] = draw(_sizes(1, 20))
        if maybe():
            opts["top_p"] = draw(st.sampled_from([0.5, 0.9, 1.0]))
        if maybe():
            opts["min_p"] = draw(st.sampled_from([0.02, 0.1, 0.3]))
        if maybe():
            opts["typical_p"] = draw(st.sampled_from([0.5, 0.9]))
        if maybe():
            opts["num_return_sequences"] = draw(_sizes(2, 3))
    if maybe():
        opts["repetition_penalty"] = draw(st.sampled_from([0.7, 1.2, 2.0]))
    if maybe():
        opts["no_repeat_ngram_size"] = draw(_sizes(1, 4))
    if maybe():
        opts["bad_words_ids"] = draw(_token_lists(3, 2))
    if maybe():
        opts["min_new_tokens"] = draw(_sizes(1, 64))
    if maybe():
        opts["eos_token_id"] = draw(st.lists(_TOKEN, min_size=1, max_size=3, unique=True))
    if maybe():
        opts["stop_strings"] = [token_text(s) for s in draw(_token_lists(2, 3))]
    if maybe():
        opts["suppress_tokens"] = draw(st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=5, unique=True))
    if maybe():
        opts["sequence_bias"] = {tuple(s): draw(st.sampled_from([-5.0, 5.0])) for s in draw(_token_lists(2, 2))}
    if maybe():
        opts["exponential_decay_length_penalty"] = (draw(_sizes(1, 10)), draw(st.sampled_from([1.1, 1.5])))
    if maybe():
        opts["renormalize_logits"] = True
    if draw(st.booleans()):
        opts["return_dict_in_generate"] = True
        opts["output_scores"] = draw(st.booleans())
        opts["output_logits"] = draw(st.booleans())
    return opts


# Options hf_specdec refuses, each with a word its error must contain.
REFUSED: list[tuple[str, dict]] = [
    ("num_beams", {"num_beams": 2}),
    ("penalty_alpha", {"penalty_alpha": 0.6, "top_k": 4}),
    ("output_attentions", {"output_attentions": True, "return_dict_in_generate": True}),
    ("output_hidden_states", {"output_hidden_states": True, "return_dict_in_generate": True}),
    ("guidance_scale", {"guidance_scale": 1.5}),
    ("prompt_lookup_num_tokens", {"prompt_lookup_num_tokens": 3}),
    ("low_memory", {"low_memory": True}),
    ("PrefixConstrainedLogitsProcessor", {"prefix_allowed_tokens_fn": "allow-all"}),
]


@st.composite
def calls(draw, greedy: bool | None = None, refused: bool = False) -> Call:
    """A whole `Call`; ``greedy`` forces the decoding mode, ``refused`` adds one option of `REFUSED`."""
    rows = draw(prompts())
    # a refused option is added to a call that is valid otherwise (so that its error is the one raised)
    opts = {"max_new_tokens": draw(_sizes(1, 8)), "do_sample": False} if refused else draw(options(len(rows)))
    if greedy is not None:
        opts["do_sample"] = not greedy
        if greedy:
            for key in ("temperature", "top_k", "top_p", "min_p", "typical_p", "num_return_sequences"):
                opts.pop(key, None)
    streamer = len(rows) == 1 and not opts.get("num_return_sequences") and draw(st.booleans())
    arch = draw(st.sampled_from(target_archs()))
    return Call(
        target=Target(arch, draw(st.integers(0, 3)), draw(_sizes(1, 2)), profile_dtype()),
        prompts=rows,
        options=opts,
        assistant=draw(assistants()),
        mask=refused or len({len(r) for r in rows}) > 1 or draw(st.booleans()),
        streamer=streamer,
        via_config=draw(st.integers(0, 4)) == 0,
        tree_budget=draw(st.booleans()),
        refused=draw(st.sampled_from(REFUSED)) if refused else None,
    )


# ------------------------------------------------------------------------------------------------ profiles
# Chosen by HF_SPECDEC_FUZZ (default ci); applied to the fuzzer's tests only (other tests keep hypothesis' defaults).
# - ci: a bounded, reproducible run (the same examples every time; about a minute on 2 cores), the suite's profile;
# - dev: 200 new examples per property (HF_SPECDEC_FUZZ_EXAMPLES to change it), for a quick look while changing the
#   fuzzer;
# - long: 10,000 new examples per property (HF_SPECDEC_FUZZ_EXAMPLES to change it); failures are remembered in
#   .hypothesis/ (git-ignored) and tried first next time;
# - bf16 / fp16: 200 new examples per property (HF_SPECDEC_FUZZ_EXAMPLES to change it) on targets in that dtype;
#   a greedy output may leave vanilla's only at a near-tie of vanilla's own scores (`hf_specdec.testing.near_tie`).
# HF_SPECDEC_FUZZ_TARGETS=llama4_text,gemma2 draws only those targets in any profile (a look at one architecture).
# Found failures are kept as @example in the test module, which every profile runs.
PROFILE_ENV = "HF_SPECDEC_FUZZ"
_COMMON = dict(
    deadline=None,  # a call's time depends on the machine's load, not on the example
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    print_blob=True,
)
_HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}
PROFILES = {
    "ci": settings(max_examples=30, derandomize=True, database=None, **_COMMON),
    **{
        name: settings(max_examples=int(os.environ.get("HF_SPECDEC_FUZZ_EXAMPLES", 200)), database=None, **_COMMON)
        for name in _HALF
    },
    "dev": settings(max_examples=int(os.environ.get("HF_SPECDEC_FUZZ_EXAMPLES", 200)), database=None, **_COMMON),
    "long": settings(
        max_examples=int(os.environ.get("HF_SPECDEC_FUZZ_EXAMPLES", 10_000)),
        database=DirectoryBasedExampleDatabase(".hypothesis/fuzz"),
        **_COMMON,
    ),
}


def fuzz_settings(ci_examples: int) -> settings:
    """The profile named by ``HF_SPECDEC_FUZZ``; the ci profile runs ``ci_examples`` examples of this property."""
    name = os.environ.get(PROFILE_ENV, "ci")
    if name not in PROFILES:
        raise ValueError(f"{PROFILE_ENV}={name!r}: choose one of {', '.join(PROFILES)}")
    return settings(PROFILES[name], max_examples=ci_examples) if name == "ci" else PROFILES[name]


def profile_dtype() -> torch.dtype:
    """The targets' dtype of the profile named by ``HF_SPECDEC_FUZZ``: bf16 / fp16 for those profiles, else fp32."""
    return _HALF.get(os.environ.get(PROFILE_ENV, "ci"), torch.float32)
