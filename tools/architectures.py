"""The architecture sweep: a tiny random model of every causal LM type the installed transformers maps, and what
speculative decoding does with it.

`tiny_model(model_type)` shrinks the type's default config to a few small layers (one of each layer type it has,
sliding windows shorter than the sequence, untied embeddings, weights re-drawn so greedy text is not one repeated
token); `sweep_type` runs vanilla greedy ``generate`` and ``generate(assistant=...)`` with several assistants, batch 1
and a left-padded batch of 2, and says whether every run gave vanilla's tokens, was refused with a clear error, or
neither. ``python -m tools.architectures`` writes the table of docs/architectures.md;
``tests/integration/test_architecture_sweep.py`` fails on any silent difference or unclear crash. Lab equipment of
this repository (tools/, not installed): what a user's model meets is `hf_specdec.generation.support`'s checks.
"""

from __future__ import annotations

import argparse
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_MASKED_LM_MAPPING_NAMES

from hf_specdec.attention.unsupported import UnsupportedModelError
from hf_specdec.generation.proposers.draft_model import DraftModelAssistant
from hf_specdec.generation.proposers.ngram import NgramAssistant
from hf_specdec.testing import OracleProposer, RandomTreeProposer, left_pad

VOCAB = 101
HIDDEN = 64
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 16
SEQUENCE = 40  # prompt + new tokens: sliding windows and chunks are made shorter than this
WINDOW = 8

# size fields, by the names configs use for them (an attribute_map also routes the standard names)
_SIZES = {
    "hidden_size": HIDDEN,
    "intermediate_size": 2 * HIDDEN,
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS,
    "head_dim": HEAD_DIM,
    "vocab_size": VOCAB,
    "max_position_embeddings": 256,
    "moe_intermediate_size": HIDDEN,
    "shared_expert_intermediate_size": HIDDEN,
    "expert_intermediate_size": HIDDEN,
    "n_routed_experts": 4,
    "num_experts": 4,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "kv_lora_rank": 16,
    "q_lora_rank": 24,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "sliding_window": WINDOW,
    "attention_chunk_size": WINDOW,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "mamba_n_heads": 4,
    "mamba_d_head": 16,
    "mamba_n_groups": 1,
    "mamba_d_state": 16,
    "mamba_head_dim": 16,
    "mamba_num_heads": 8,
    "ssm_state_size": 16,
    "state_size": 16,
    "n_groups": 1,
    "time_step_rank": 8,
    "conv_kernel": 4,
    "expand": 2,
    "index_n_heads": 2,
    "index_head_dim": 16,
    "index_topk": 8,
}


def causal_lm_types() -> list[str]:
    """Model types transformers maps to a decoder-only ``...ForCausalLM`` built from one config (no sub-configs):
    the stock causal LMs. Encoder models used as decoders and multimodal wrappers are left out."""
    out = []
    for model_type, class_name in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()):
        if not isinstance(class_name, str) or not class_name.endswith("ForCausalLM"):
            continue
        try:
            config = AutoConfig.for_model(model_type)
        except Exception:  # noqa: BLE001  (a type whose config needs arguments: not a stock causal LM here)
            continue
        if getattr(config, "is_encoder_decoder", False) or getattr(config, "sub_configs", None):
            continue
        if model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES:  # an encoder that can also run as a decoder
            continue
        out.append(model_type)
    return out


# Mamba-2 scans in chunks of 8 tokens (default 256): the test sequences span several chunks, so the chunk-to-chunk
# recurrence runs, and a batch of short prompts is not padded to 256 positions each
MAMBA2_CHUNK = 8
# types whose layer pattern or mixer sizes are set by fields of their own (one attention layer among the first few)
_TYPE_OVERRIDES = {
    "jamba": dict(
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        mamba_dt_rank=8,
        mamba_d_state=16,
    ),
    "bamba": dict(attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=16, mamba_chunk_size=MAMBA2_CHUNK),
    "granitemoehybrid": dict(
        layer_types=["linear_attention", "full_attention"],
        mamba_n_heads=8,
        mamba_d_head=16,
        mamba_chunk_size=MAMBA2_CHUNK,
    ),
    "lfm2": dict(layer_types=["conv", "full_attention"]),
    # MiniMax: its prefill in blocks of 8 like Mamba-2's; no sliding window (its config's default: a window would
    # reach the mask of its 'full_attention' layers); attention first, as vanilla builds its decode masks from layer
    # 0's K/V length (a lightning layer 0 has none, and left padding then goes wrong in vanilla itself)
    "minimax": dict(layer_types=["full_attention", "linear_attention"], block_size=MAMBA2_CHUNK, sliding_window=None),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),
    "falcon_h1": dict(mamba_n_heads=8, mamba_d_head=16, mamba_d_ssm=128, mamba_chunk_size=MAMBA2_CHUNK),
    "nemotron_h": dict(chunk_size=MAMBA2_CHUNK),
    "recurrent_gemma": dict(block_types=["recurrent", "attention"], attention_window_size=WINDOW, lru_width=HIDDEN),
    "zamba": dict(
        attention_hidden_size=2 * HIDDEN,
        attention_head_dim=2 * HIDDEN // HEADS,
        mamba_dt_rank=8,
        attn_layer_period=2,
        attn_layer_offset=1,
        n_mamba_heads=2,
    ),
    "zamba2": dict(
        attention_hidden_size=2 * HIDDEN,
        attention_head_dim=2 * HIDDEN // HEADS,
        mamba_headdim=16,
        n_mamba_heads=8,
        hybrid_layer_ids=[1],
        adapter_rank=8,
        chunk_size=MAMBA2_CHUNK,
    ),
    "mamba2": dict(num_heads=8, head_dim=16, chunk_size=MAMBA2_CHUNK),
    "rwkv": dict(attention_hidden_size=HIDDEN),
    "inkling2_text": dict(
        unpadded_vocab_size=VOCAB,
        swa_num_attention_heads=HEADS,
        swa_num_key_value_heads=KV_HEADS,
        swa_head_dim=HEAD_DIM,
        sliding_window_size=WINDOW,
    ),
    "inkling2_loop_text": dict(
        unpadded_vocab_size=VOCAB,
        swa_num_attention_heads=HEADS,
        swa_num_key_value_heads=KV_HEADS,
        swa_head_dim=HEAD_DIM,
        sliding_window_size=WINDOW,
    ),
    "hrm_text": dict(num_layers_per_stack=1, H_cycles=2, L_cycles=2, num_hidden_layers=6),  # 1 x 2 x (2 + 1)
    "codegen": dict(rotary_dim=8),
    "gptj": dict(rotary_dim=8),
}


def _set(config, name: str, value) -> None:
    try:
        setattr(config, name, value)
    except (AttributeError, TypeError):  # a read-only property derived from other fields
        pass


def tiny_config(model_type: str):
    """The default config of ``model_type``, shrunk (see the module docstring)."""
    config = AutoConfig.for_model(model_type)
    kinds = list(dict.fromkeys(getattr(config, "layer_types", None) or []))
    for name, value in _SIZES.items():
        if name in config.__dict__ or name in getattr(config, "attribute_map", {}):
            _set(config, name, value)
    if getattr(config, "qk_rope_head_dim", None):  # multi-head latent attention: rope dims are the head_dim
        _set(config, "head_dim", config.qk_rope_head_dim)
        _set(config, "qk_head_dim", config.qk_rope_head_dim + getattr(config, "qk_nope_head_dim", 0))
        _set(config, "num_key_value_heads", HEADS)
    layers = max(2, len(kinds))
    _set(config, "num_hidden_layers", layers)
    if kinds:
        _set(config, "layer_types", [kinds[i % len(kinds)] for i in range(layers)])
    for name in ("intermediate_size",):
        if isinstance(getattr(config, name, None), list):
            _set(config, name, [2 * HIDDEN] * layers)
    for name in ("mlp_layer_types",):
        if isinstance(getattr(config, name, None), list):
            _set(config, name, (getattr(config, name) * layers)[:layers])
    for name, value in _TYPE_OVERRIDES.get(model_type, {}).items():
        _set(config, name, value)
    _set(config, "tie_word_embeddings", False)
    config.bos_token_id, config.eos_token_id, config.pad_token_id = 1, 2, 0
    return config


def tiny_model(model_type: str, seed: int = 0):
    """A tiny random ``model_type`` causal LM, fp32, eval mode, its weights drawn (std 0.08, larger where greedy text
    would otherwise repeat a few tokens: a weak test) so greedy text varies."""
    config = tiny_config(model_type)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    prompt = torch.tensor([_prompts(config.vocab_size)[0]])
    for std in (0.08, 0.2, 0.5):
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() >= 2 and p.is_floating_point():
                    p.copy_(torch.randn(p.shape, generator=gen) * std)
            text = model.generate(prompt, max_new_tokens=16, do_sample=False)[0, prompt.shape[1] :]
        if len(set(text.tolist())) >= 6:
            break
    return model


@dataclass
class Outcome:
    """What the sweep found for one model type."""

    model_type: str
    verdict: str  # "equal", "refused", "silent difference", "crash", "no tiny model", "vanilla fails"
    # ("no tiny model": the type's default config could not be shrunk generically; nothing was run)
    detail: str = ""
    reason: str = ""  # a refusal's `UnsupportedModelError.reason`
    runs: int = 0
    seconds: float = 0.0


def _assistants(model, full: bool) -> dict:
    """Assistant factories: all of them for the full sweep; for the quick one, one per kind of draft (a lookup, a
    random tree, a draft model's tree with pending levels)."""
    vocab = model.config.vocab_size
    quick = {
        "ngram": lambda: NgramAssistant(),
        "random tree 12": lambda: RandomTreeProposer(vocab, nodes=12, seed=2),
        "draft model tree": lambda: DraftModelAssistant(model, depth=3, top_k=2),
    }
    if not full:
        return quick
    return {
        **quick,
        "random tree 6": lambda: RandomTreeProposer(vocab, nodes=6, seed=1),
        "oracle": lambda: OracleProposer(model),
    }


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    a = torch.randint(3, vocab, (12,), generator=gen).tolist()
    b = torch.randint(3, vocab, (5,), generator=gen).tolist()
    return [a + a[:4], b]  # a repeats itself: prompt lookup has something to draft


def sweep_type(model_type: str, new_tokens: int = 24, full: bool = True) -> Outcome:
    """Against vanilla greedy ``generate``: with ``full``, every assistant with and without the tree budget, batch 1
    and a left-padded batch of 2; otherwise the quick sweep: one assistant of each kind, budget on, the batch of 2."""
    t0 = time.perf_counter()
    try:
        model = tiny_model(model_type)
    except Exception as exc:  # noqa: BLE001
        return Outcome(model_type, "no tiny model", f"{type(exc).__name__}: {exc}"[:300])
    prompts = _prompts(model.config.vocab_size)
    batches = {"batch 1": left_pad(prompts[:1]), "batch 2": left_pad(prompts)}
    if not full:
        del batches["batch 1"]
    out = Outcome(model_type, "equal")
    kw = dict(max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    for batch_name, (ids, mask) in batches.items():
        try:
            with torch.no_grad():
                want = model.generate(ids, attention_mask=mask, **kw)
        except Exception as exc:  # noqa: BLE001
            return Outcome(model_type, "vanilla fails", f"{type(exc).__name__}: {exc}"[:300])
        for name, make in _assistants(model, full).items():
            for budget in (True, False) if full else (True,):
                label = f"{name}, {batch_name}, budget {'on' if budget else 'off'}"
                try:
                    with torch.no_grad():
                        got = model.generate(ids, attention_mask=mask, assistant=make(), tree_budget=budget, **kw)
                except UnsupportedModelError as exc:
                    out.runs += 1
                    if out.verdict == "equal":
                        out.verdict, out.detail, out.reason = "refused", str(exc), exc.reason
                    continue
                except Exception as exc:  # noqa: BLE001
                    out.runs += 1
                    tb = traceback.extract_tb(exc.__traceback__)[-1]
                    where = f"{Path(tb.filename).name}:{tb.lineno}"
                    return Outcome(model_type, "crash", f"{label}: {type(exc).__name__}: {exc} ({where})"[:400],
                                   out.runs, time.perf_counter() - t0)  # fmt: skip
                out.runs += 1
                if not torch.equal(got, want):
                    return Outcome(model_type, "silent difference", label, out.runs, time.perf_counter() - t0)
    out.seconds = time.perf_counter() - t0
    return out


def sweep(types: list[str] | None = None, full: bool = True, progress: bool = True) -> list[Outcome]:
    """`sweep_type` of every stock causal LM type (or of ``types``)."""
    outcomes = []
    for model_type in types or causal_lm_types():
        o = sweep_type(model_type, full=full)
        outcomes.append(o)
        if progress:
            print(f"{o.model_type:28s} {o.verdict:18s} {o.seconds:5.1f}s {o.detail[:150]}", flush=True)
    return outcomes


TABLE_START, TABLE_END = "<!-- sweep table start -->", "<!-- sweep table end -->"


def _reason(o: Outcome) -> str:
    """The refusal's first clause (what is unsupported), one line."""
    text = o.reason or o.detail
    return text.replace("|", "/").replace("\n", " ")[:220]


def table(outcomes: list[Outcome]) -> str:
    """The markdown table of docs/architectures.md."""
    lines = ["| model type | outcome | what is unsupported |", "|---|---|---|"]
    lines += [f"| {o.model_type} | {o.verdict} | {_reason(o)} |" for o in outcomes]
    return "\n".join(lines)


VERSION_MARK = "<!-- swept with transformers {} -->"


def table_version(path: Path) -> str | None:
    """The transformers version the table in ``path`` was last swept with (None if it does not say)."""
    head, _, tail = VERSION_MARK.partition("{}")
    text = path.read_text()
    start = text.find(head)
    return None if start < 0 else text[start + len(head) : text.index(tail, start + len(head))]


def read_table(path: Path) -> dict[str, str]:
    """model type -> outcome, from the table in ``path``."""
    text = path.read_text()
    body = text[text.index(TABLE_START) : text.index(TABLE_END)]
    rows = [line.split("|") for line in body.splitlines() if line.startswith("| ") and not line.startswith("| model")]
    return {cells[1].strip(): cells[2].strip() for cells in rows}


def write_table(path: Path, outcomes: list[Outcome], partial: bool = False) -> None:
    """Replace the table between the markers of ``path``; with ``partial``, only the rows of ``outcomes``' types (the
    others keep theirs)."""
    text = path.read_text()
    head, tail = text[: text.index(TABLE_START) + len(TABLE_START)], text[text.index(TABLE_END) :]
    lines = table(outcomes).splitlines()
    if partial:
        old = [line for line in text[len(head) : text.index(TABLE_END)].splitlines() if not line.startswith("| model")]
        rows = {line.split("|")[1].strip(): line for line in [*old, *lines[2:]] if line.startswith("| ")}
        lines = lines[:2] + [rows[t] for t in sorted(rows)]
    body = "\n".join(lines)
    path.write_text(f"{head}\n{VERSION_MARK.format(transformers.__version__)}\n{body}\n{tail}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("types", nargs="*", help="model types (default: every stock causal LM type)")
    parser.add_argument("--quick", action="store_true", help="one assistant of each kind, the batch of 2 only")
    parser.add_argument(
        "--write",
        type=Path,
        help="rewrite the outcome table in this markdown file (with types given: only their rows)",
    )
    args = parser.parse_args(argv)
    with torch.no_grad():
        outcomes = sweep(args.types or None, full=not args.quick)
    counts = {v: sum(o.verdict == v for o in outcomes) for v in dict.fromkeys(o.verdict for o in outcomes)}
    print(f"transformers {transformers.__version__}: {len(outcomes)} types, {counts}")
    if args.write:
        write_table(args.write, outcomes, partial=bool(args.types))


if __name__ == "__main__":
    main()
