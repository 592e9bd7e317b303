"""Differential fuzzing of ``model.generate(..., assistant=X)`` against vanilla ``generate`` (hypothesis).

Each example is a drawn `fuzz_calls.Call`: a tiny random target of one of `testing.tiny_causal_lm`'s architectures,
a left-padded batch, generation options from the set hf_specdec honours and an assistant of the registry (n-gram,
draft model, random Medusa / EAGLE / MLP-speculator heads, the fallback of several, random trees). Properties:

- greedy: token for token vanilla's (fp32), the same scores / logits where both return them, the same streamed ids;
  on bf16 / fp16 targets (profiles ``HF_SPECDEC_FUZZ=bf16`` / ``fp16``) each row equals vanilla's or first leaves it
  at a near-tie of vanilla's own processed scores (`hf_specdec.testing.near_tie`), scores equal within the rounding;
- sampling: the call succeeds where vanilla does, and every row is a valid output of the options (lengths, EOS and
  stop strings, padding, each token allowed by the processed scores, banned tokens and n-grams absent);
- refused options: our error names the option;
- always: the target's parameters, config, generation config, attention implementation and hooks are unchanged.

A failure prints the minimal call hypothesis shrank it to, as Python (`Call.code`). Profiles: see
`fuzz_calls.fuzz_settings` (``HF_SPECDEC_FUZZ=long`` for 10,000 examples per property).
"""

from __future__ import annotations

import copy
import json
import os
import time

import pytest
import torch
from fuzz_calls import (
    PAD,
    VOCAB,
    Call,
    RecordingStreamer,
    Target,
    build_assistant,
    build_model,
    calls,
    char_tokenizer,
    fuzz_settings,
    token_text,
)
from hypothesis import assume, event, example, given, note
from transformers import LogitsProcessor, LogitsProcessorList

from hf_specdec.testing import NEAR_TIE_K, _routing_near_tie, assert_same_tokens, left_pad, near_tie, tiny_causal_lm

SCORE_TOL = dict(atol=1e-4, rtol=1e-4)
TIE = 1e-4  # a greedy step whose best two processed scores are closer than this is a tie fp32 may break either way


LOG_ENV = "HF_SPECDEC_FUZZ_LOG"  # a file: one JSON line per example run (property, assistant, seconds, outcome)


def _run(call: Call, prop: str, check) -> None:
    """``check(call)`` with the call's Python attached to a failure, and a line in the log file if one is set."""
    note(call.code())
    cpu, wall = time.process_time(), time.perf_counter()
    outcome = "pass"
    try:
        check(call)
    except BaseException as err:
        outcome = type(err).__name__
        raise
    finally:
        if os.environ.get(LOG_ENV):
            line = {
                "property": prop,
                "assistant": call.assistant[0],
                "rows": len(call.prompts),
                "cpu_s": round(time.process_time() - cpu, 3),
                "wall_s": round(time.perf_counter() - wall, 3),
                "outcome": outcome,
                "call": repr(call),
            }
            with open(os.environ[LOG_ENV], "a", encoding="utf-8") as f:
                f.write(json.dumps(line) + "\n")


# ------------------------------------------------------------------------------------------------ running a call
def _kwargs(call: Call, model, *, speculative: bool) -> dict:
    """generate's keyword arguments for ``call`` (fresh streamer and assistant each time)."""
    options = {**call.options, **(call.refused[1] if call.refused else {})}
    if options.get("prefix_allowed_tokens_fn") == "allow-all":
        options["prefix_allowed_tokens_fn"] = lambda batch_id, ids: list(range(VOCAB))
    kwargs: dict = {}
    if call.via_config:
        config = copy.deepcopy(model.generation_config)
        rest = config.update(**options)
        kwargs["generation_config"] = config
        kwargs.update(rest)
    else:
        kwargs.update(options)
    ids, mask = left_pad(call.prompts, pad=PAD)
    if call.mask:
        kwargs["attention_mask"] = mask
    if "stop_strings" in options:
        kwargs["tokenizer"] = char_tokenizer()
    if call.streamer:
        kwargs["streamer"] = RecordingStreamer()
    if speculative:
        kwargs["assistant"] = build_assistant(model, *call.assistant)
        if not call.tree_budget:
            kwargs["tree_budget"] = False
    return {"input_ids": ids, **kwargs}


def _generate(model, kwargs: dict, seed: int = 0):
    """``(output, error)`` of one call (sampling seeded)."""
    torch.manual_seed(seed)
    try:
        return model.generate(**kwargs), None
    except (ValueError, TypeError) as err:
        return None, err


def _sequences(out) -> torch.Tensor:
    return out.sequences if hasattr(out, "sequences") else out


def _refusal(call: Call, model) -> str | None:
    """A word our error must contain where hf_specdec refuses, by design, a call vanilla runs (None: no refusal).

    Without an attention_mask, transformers marks every pad id of input_ids as padding (unless the pad id is an EOS
    id): a pad id inside a prompt, or a prompt of pad ids only, is masked out by vanilla and refused here (rows are
    packed from their first real token; there is no masking inside a row).
    """
    if call.mask or PAD in _eos_set(model, call.options):
        return None
    for row in call.prompts:
        real = [t != PAD for t in row]
        if not any(real) or not all(real[real.index(True) :]):
            return "attention_mask"
    return None


def _check_errors(call: Call, model, expected_err, err) -> bool:
    """Whether the call was refused (by both, or by us by design); fails where only one side raised otherwise."""
    if expected_err is None and err is not None and _refusal(call, model) is not None:
        assert _refusal(call, model) in str(err), f"our error does not say what to do: {err}"
        event("refused by design: a pad id inside a prompt without attention_mask")
        return True
    if expected_err is not None or err is not None:
        assert expected_err is not None and err is not None, f"vanilla: {expected_err!r}; ours: {err!r}"
        event(f"both refused: {type(err).__name__}: {str(err)[:70]}")
        return True
    return False


# ------------------------------------------------------------------------------------------------ the model's state
def _state(model) -> dict:
    """Everything a call must leave as it found it."""
    modules = list(model.named_modules())
    return {
        "tensors": {n: t.detach().clone() for n, t in [*model.named_parameters(), *model.named_buffers()]},
        "requires_grad": {n: p.requires_grad for n, p in model.named_parameters()},
        "training": [m.training for _, m in modules],
        "modules": [(n, type(m)) for n, m in modules],
        "hooks": [(n, _hooks(m), "forward" in vars(m)) for n, m in modules],
        "global_hooks": (
            len(torch.nn.modules.module._global_forward_hooks),
            len(torch.nn.modules.module._global_forward_pre_hooks),
        ),
        "config": model.config.to_dict(),
        "attn": model.config._attn_implementation,
        "generation_config": model.generation_config.to_dict(),
    }


def _hooks(module) -> list[str]:
    """The names of a module's hooks, less transformers' own output-capturing hooks (installed once per model the
    first time any forward asks for hidden states, by vanilla calls as well, and inert otherwise)."""
    hooks = [*module._forward_hooks.values(), *module._forward_pre_hooks.values(), *module._backward_hooks.values()]
    return [h.__qualname__ for h in hooks if getattr(h, "__name__", "") != "output_capturing_hook"]


def _assert_unchanged(before: dict, model, label: str) -> None:
    after = _state(model)
    for key in before:
        if key == "tensors":
            changed = [n for n, t in before[key].items() if not torch.equal(t, after[key][n])]
            assert not changed, f"{label}: the call changed {changed[:5]}"
        else:
            assert before[key] == after[key], f"{label}: the call changed the model's {key}"


# ------------------------------------------------------------------------------------------------ greedy
def _first_difference(got: torch.Tensor, expected: torch.Tensor, width: int) -> tuple[int, int] | None:
    """``(row, generated position)`` of the first token where two `[R, W + G]` outputs differ."""
    for r in range(expected.shape[0]):
        a, e = got[r, width:].tolist(), expected[r, width:].tolist()
        for t in range(max(len(a), len(e))):
            if t >= len(a) or t >= len(e) or a[t] != e[t]:
                return r, t
    return None


def _is_tie(model, call: Call, row: int, step: int) -> bool:
    """Whether vanilla's processed scores at ``step`` of ``row`` have their best two within `TIE`."""
    kwargs = _kwargs(call, model, speculative=False)
    kwargs.pop("streamer", None)
    if "generation_config" in kwargs:
        kwargs["generation_config"].update(return_dict_in_generate=True, output_scores=True)
    else:
        kwargs.update(return_dict_in_generate=True, output_scores=True)
    out = model.generate(**kwargs)
    if step >= len(out.scores):
        return False
    top = out.scores[step][row].float().topk(2).values
    return bool(torch.isfinite(top).all()) and float(top[0] - top[1]) < TIE * max(1.0, abs(float(top[0])))


def _compare_scores(out, expected, lengths: list[int], label: str) -> None:
    """Scores / logits equal at every step each row was still generating (ours are zeros after a row stopped; vanilla's
    are what the padded row would score, which nobody reads)."""
    for name in ("scores", "logits"):
        ours, theirs = getattr(out, name, None), getattr(expected, name, None)
        assert (ours is None) == (theirs is None), f"{label}: {name} returned by one call only"
        if ours is None:
            continue
        assert len(ours) == len(theirs), f"{label}: {len(ours)} {name} steps, vanilla {len(theirs)}"
        for r, n in enumerate(lengths):
            for t in range(n):
                torch.testing.assert_close(ours[t][r], theirs[t][r], **SCORE_TOL, msg=f"{label}: {name}[{t}] row {r}")


def _stop_positions(seqs: torch.Tensor, width: int, eos: set[int], stop_strings) -> list[int | None]:
    """Per row: the generated length at which it stopped (its EOS or the end of a stop string), or None."""
    out = []
    for row in seqs.tolist():
        stop = None
        for t in range(width, len(row)):
            if row[t] in eos or (stop_strings and any(token_text(row[: t + 1]).endswith(s) for s in stop_strings)):
                stop = t - width + 1
                break
        out.append(stop)
    return out


def _eos_set(model, options: dict) -> set[int]:
    eos = options.get("eos_token_id", model.generation_config.eos_token_id)
    return set(torch.as_tensor(eos).reshape(-1).tolist()) if eos is not None else set()


@fuzz_settings(ci_examples=30)
@given(call=calls(greedy=True))
@example(
    call=Call(
        Target("llama"), [[5, 6, 7, 5, 6, 7, 5], [3, 4]], {"max_new_tokens": 24}, ("ngram", {}), tree_budget=False
    )
)
def test_greedy_is_vanilla_token_for_token(call: Call):
    _run(call, "greedy", _check_greedy)


def _check_greedy(call: Call) -> None:
    if call.target.dtype != torch.float32:
        return _check_greedy_half(call)
    model = build_model(call.target)
    width = max(len(p) for p in call.prompts)
    expected_kwargs = _kwargs(call, model, speculative=False)
    expected, expected_err = _generate(model, expected_kwargs)
    before = _state(model)
    kwargs = _kwargs(call, model, speculative=True)
    t0 = time.perf_counter()
    out, err = _generate(model, kwargs)
    if time.perf_counter() - t0 > 2:
        event(f"slow (> 2 s): {call.assistant[0]}")
    _assert_unchanged(before, model, "greedy")
    if _check_errors(call, model, expected_err, err):
        return
    got, want = _sequences(out), _sequences(expected)
    diff = _first_difference(got, want, width)
    if diff is not None and _is_tie(model, call, *diff):
        event("fp32 tie at the first difference")
        assume(False)
    assert_same_tokens(got, want, "greedy")
    stops = _stop_positions(want, width, _eos_set(model, call.options), call.options.get("stop_strings"))
    _compare_scores(out, expected, [s if s is not None else want.shape[1] - width for s in stops], "greedy")
    if call.streamer:
        ours, theirs = kwargs["streamer"], expected_kwargs["streamer"]
        assert ours.ids == theirs.ids and ours.ended and theirs.ended, "streamed ids differ from vanilla's"
    event(f"assistant {call.assistant[0]}")


def _vanilla_scores(model, call: Call) -> list[torch.Tensor]:
    """Vanilla's processed scores of ``call``, per step `[B, V]` (``output_scores``)."""
    kwargs = _kwargs(call, model, speculative=False)
    kwargs.pop("streamer", None)
    if "generation_config" in kwargs:
        kwargs["generation_config"].update(return_dict_in_generate=True, output_scores=True)
    else:
        kwargs.update(return_dict_in_generate=True, output_scores=True)
    return list(model.generate(**kwargs).scores)


def _check_greedy_half(call: Call) -> None:
    """A bf16 / fp16 target: each row is vanilla's, or first leaves it at a near-tie of vanilla's own processed scores
    there (the oracle); the scores / logits up to that step equal vanilla's within the rounding."""
    model = build_model(call.target)
    width = max(len(p) for p in call.prompts)
    expected_kwargs = _kwargs(call, model, speculative=False)
    expected, expected_err = _generate(model, expected_kwargs)
    before = _state(model)
    kwargs = _kwargs(call, model, speculative=True)
    out, err = _generate(model, kwargs)
    _assert_unchanged(before, model, "greedy")
    if _check_errors(call, model, expected_err, err):
        return
    got, want = _sequences(out), _sequences(expected)
    assert got.shape[0] == want.shape[0], f"{got.shape[0]} rows, vanilla {want.shape[0]}"
    pad = int(model.generation_config.pad_token_id)
    stops = _stop_positions(want, width, _eos_set(model, call.options), call.options.get("stop_strings"))
    lengths = [s if s is not None else want.shape[1] - width for s in stops]
    scores, differ = None, False
    for r in range(want.shape[0]):
        a, e = got[r, width:].tolist(), want[r, width:].tolist()
        if a == e:
            continue
        scores = scores if scores is not None else _vanilla_scores(model, call)
        prompt = call.prompts[r] if call.mask else [t for t in call.prompts[r] if t != PAD]
        verdict = near_tie(model, prompt, e, a, scores=[s[r] for s in scores], pad_token_id=pad)
        assert verdict.ok, f"row {r}: {verdict}"
        if verdict.position is None:  # equal up to trailing padding (another row ran longer after its near-tie)
            continue
        lengths[r] = min(lengths[r], verdict.position + 1)  # both computed the scores of the tied step
        differ = True
        event(f"{call.target.dtype}: a near-tie ({verdict.units:.1f} eps units)")
    eps = torch.finfo(call.target.dtype).eps
    for name in ("scores", "logits"):
        ours, theirs = getattr(out, name, None), getattr(expected, name, None)
        assert (ours is None) == (theirs is None), f"greedy: {name} returned by one call only"
        for r, n in enumerate(lengths if ours is not None else []):
            for t in range(min(n, len(ours), len(theirs))):
                a, e = ours[t][r].float(), theirs[t][r].float()
                finite = e[torch.isfinite(e)]
                atol = NEAR_TIE_K * eps * max(float(finite.abs().max()) if finite.numel() else 0.0, 1.0)
                try:
                    torch.testing.assert_close(a, e, atol=atol, rtol=0, msg=f"greedy: {name}[{t}] row {r}")
                except AssertionError:  # a mixture of experts may route a token differently at a routing near-tie
                    prompt = call.prompts[r] if call.mask else [x for x in call.prompts[r] if x != PAD]
                    if not _routing_near_tie(model, prompt + want[r, width : width + t].tolist(), eps, NEAR_TIE_K):
                        raise
                    event(f"{call.target.dtype}: scores moved by a routing near-tie")
                    break
    if call.streamer and not differ:
        ours, theirs = kwargs["streamer"], expected_kwargs["streamer"]
        assert ours.ids == theirs.ids and ours.ended and theirs.ended, "streamed ids differ from vanilla's"
    event(f"assistant {call.assistant[0]}" + (" (a near-tie)" if differ else ""))


# ------------------------------------------------------------------------------------------------ sampling
def _check_row(row: list[int], width: int, call: Call, eos: set[int], scores, r: int) -> None:
    """One sampled row is a valid output of the call's options."""
    o = call.options
    gen = row[width:]
    stop = _stop_positions(torch.tensor([row]), width, eos, o.get("stop_strings"))[0]
    n = stop if stop is not None else len(gen)
    limit = o["max_new_tokens"] if "max_new_tokens" in o else o["max_length"] - width
    assert 1 <= n <= max(1, limit), f"row {r}: {n} tokens, the limit is {limit}"
    if stop is None:
        assert n == max(1, limit), f"row {r} stopped after {n} of {limit} tokens without EOS or a stop string"
    assert all(t == PAD for t in gen[n:]), f"row {r}: not padding after its stop: {gen[n:]}"
    assert all(0 <= t < VOCAB for t in gen[:n])
    min_new = max(o.get("min_new_tokens", 0), 0)
    assert not any(t in eos for t in gen[: min(n, min_new)]), f"row {r}: EOS before min_new_tokens={min_new}"
    banned = set(o.get("suppress_tokens", [])) | {w[0] for w in o.get("bad_words_ids", []) if len(w) == 1}
    assert not banned & set(gen[:n]), f"row {r}: generated a banned token {banned & set(gen[:n])}"
    size = o.get("no_repeat_ngram_size")
    for p in range(width, width + n) if size else ():
        if p + 1 >= size:
            gram = tuple(row[p - size + 1 : p + 1])
            earlier = {tuple(row[j : j + size]) for j in range(0, p - size + 1)}
            assert gram not in earlier, f"row {r}: repeated the {size}-gram {gram} at {p}"
    if scores is not None:
        assert len(scores) == len(gen)
        for t in range(n):
            assert bool(torch.isfinite(scores[t][r][gen[t]])), f"row {r}: token {gen[t]} at step {t} had score -inf"


@fuzz_settings(ci_examples=15)
@given(call=calls(greedy=False))
@example(
    call=Call(
        target=Target(arch="gemma", seed=0, layers=1),
        prompts=[[0], [0, 0]],
        options={"max_length": 5, "do_sample": True, "repetition_penalty": 0.7, "renormalize_logits": True},
        assistant=(
            "draft-model",
            {
                "arch": "gemma",
                "seed": 0,
                "layers": 1,
                "tree": None,
            },
        ),
        mask=True,
        streamer=False,
        via_config=True,
        tree_budget=False,
        refused=None,
    ),
).via("discovered failure")
def test_sampling_gives_valid_outputs(call: Call):
    _run(call, "sampling", _check_sampling)


def _check_sampling(call: Call) -> None:
    model = build_model(call.target)
    _, expected_err = _generate(model, _kwargs(call, model, speculative=False))
    before = _state(model)
    kwargs = _kwargs(call, model, speculative=True)
    out, err = _generate(model, kwargs, seed=1)
    _assert_unchanged(before, model, "sampling")
    if _check_errors(call, model, expected_err, err):
        return
    seqs = _sequences(out)
    width = max(len(p) for p in call.prompts)
    copies = call.options.get("num_return_sequences", 1)
    assert seqs.shape[0] == len(call.prompts) * copies
    ids, _ = left_pad(call.prompts, pad=PAD)
    assert torch.equal(seqs[:, :width], ids.repeat_interleave(copies, 0)), "the prompts were changed"
    eos = _eos_set(model, call.options)
    scores = getattr(out, "scores", None)
    for r, row in enumerate(seqs.tolist()):
        _check_row(row, width, call, eos, scores, r)
    if call.streamer:  # batch 1: prompt, then every generated token, then end()
        assert kwargs["streamer"].ids == seqs[0].tolist() and kwargs["streamer"].ended, "streamed ids differ"
    event(f"assistant {call.assistant[0]}")


# ------------------------------------------------------------------------------------------------ refusals
class _Unregistered(LogitsProcessor):
    def __call__(self, input_ids, scores):
        return scores


@fuzz_settings(ci_examples=8)
@given(call=calls(refused=True))
def test_refused_options_name_themselves(call: Call):
    _run(call, "refused", _check_refused)


def _check_refused(call: Call) -> None:
    model = build_model(call.target)
    before = _state(model)
    with pytest.raises((ValueError, TypeError)) as info:
        model.generate(**_kwargs(call, model, speculative=True))
    _assert_unchanged(before, model, "refused")
    assert call.refused[0] in str(info.value), f"the error does not name {call.refused[0]}: {info.value}"


def test_an_undeclared_logits_processor_and_a_batched_streamer_are_refused(tiny_models):
    model = tiny_models["llama"]
    ids, mask = left_pad([[5, 6, 7], [8, 9]])
    assistant = build_assistant(model, "ngram", {})
    before = _state(model)
    with pytest.raises(ValueError, match="_Unregistered"):
        model.generate(ids, attention_mask=mask, logits_processor=LogitsProcessorList([_Unregistered()]),
                       max_new_tokens=4, assistant=assistant)  # fmt: skip
    with pytest.raises(ValueError, match="streamer"):
        model.generate(ids, attention_mask=mask, streamer=RecordingStreamer(), max_new_tokens=4, assistant=assistant)
    _assert_unchanged(before, model, "refused")


def test_the_routing_oracle_reads_llama4s_router_logits_not_its_masked_scores():
    """Llama 4's router returns sigmoid scores masked to its top-k (zeros elsewhere) before its logits; the bf16
    profile's oracle must judge the logits. Experts 0-2 share one router row and expert 3 its negation, so the 2nd and
    3rd logits tie at every position (the masked scores there differ by about 0.5)."""
    model = tiny_causal_lm("llama4_text", num_layers=2, dtype=torch.bfloat16)
    router = model.model.layers[1].feed_forward.router  # layer 1 is the mixture of experts
    with torch.no_grad():
        router.weight[:3] = router.weight[0]
        router.weight[3] = -router.weight[0]
    verdict = _routing_near_tie(model, [5, 9, 11, 7], torch.finfo(torch.bfloat16).eps, NEAR_TIE_K)
    assert "layers.1.feed_forward.router at prefix position 3" in verdict, f"no routing near-tie found: {verdict!r}"
