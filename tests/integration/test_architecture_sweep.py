"""Every stock causal LM type the installed transformers maps, new ones included, is exact against vanilla greedy
`generate` or refused by name before generating (tools/architectures.py, docs/architectures.md): no silent
difference, no unclear crash. CI sweeps every type with one assistant of each kind; HF_SPECDEC_SWEEP=full runs every
assistant, with and without the budget, batch 1 and 2 (the table's sweep).

The documented table is compared with the installed version's outcomes only when that version is the one CI pins
(.ci/constraints.txt): another transformers release may add types or change an outcome, which is news
(scripts/check_newest_transformers.sh reports it), not a failure, as long as every type stays exact or refused."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import transformers

import hf_specdec
from hf_specdec.generation.support import check_forward
from tools.architectures import causal_lm_types, read_table, sweep_type, table_version, tiny_model

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architectures.md"
FULL = os.environ.get("HF_SPECDEC_SWEEP", "quick") == "full"
FAILURES = ("silent difference", "crash", "vanilla fails")
REGENERATE = "python -m tools.architectures --write docs/architectures.md"


def pinned_version(package: str) -> str:
    """The version of ``package`` that CI installs (.ci/constraints.txt)."""
    for line in (ROOT / ".ci" / "constraints.txt").read_text().splitlines():
        name, sep, version = line.partition("==")
        if sep and name.strip().lower() == package:
            return version.strip()
    raise AssertionError(f".ci/constraints.txt pins no {package}")


PINNED = transformers.__version__ == pinned_version("transformers")
not_pinned = pytest.mark.skipif(
    not PINNED, reason=f"the table is compared on the pinned transformers only, not {transformers.__version__}"
)


@pytest.fixture(scope="module")
def documented() -> dict[str, str]:
    return read_table(DOC)


def test_the_table_was_swept_with_the_pinned_transformers(documented):
    """The pin and the table move together: moving the pin means sweeping again."""
    assert table_version(DOC) == pinned_version("transformers"), f"sweep again with the pinned version: {REGENERATE}"
    assert not any(v in FAILURES for v in documented.values()), "the documented sweep holds a failure"


@not_pinned
def test_the_table_lists_every_stock_causal_lm_type(documented):
    """The pinned transformers maps exactly the documented types."""
    types = causal_lm_types()
    assert set(types) == set(documented), (
        f"new types: {sorted(set(types) - set(documented))}, gone: {sorted(set(documented) - set(types))}: "
        f"run `{REGENERATE}`"
    )


@pytest.mark.parametrize("model_type", causal_lm_types())
def test_every_type_is_exact_or_refused_by_name(model_type, documented):
    with torch.no_grad():
        outcome = sweep_type(model_type, full=FULL)
    assert outcome.verdict not in FAILURES, f"{model_type}: {outcome.verdict}: {outcome.detail}"
    if outcome.verdict == "refused":  # the refusal names the model type and what would work
        assert repr(model_type) in outcome.detail, outcome.detail
        assert "docs/architectures.md" in outcome.detail or "vanilla generate" in outcome.detail, outcome.detail
    if PINNED:  # another release may change an outcome; on the pinned one the table says what happens
        assert outcome.verdict == documented.get(model_type), (
            f"{model_type} is now {outcome.verdict!r} ({outcome.detail}), documented as "
            f"{documented.get(model_type)!r}: regenerate its row if the change is right: "
            f"python -m tools.architectures {model_type} --write docs/architectures.md"
        )


@pytest.mark.parametrize(
    "model_type, words",
    [
        ("zamba", ["'linear_attention' layers", "recurrent state"]),  # Zamba's multi-head Mamba: no mixer we serve
        ("zaya", ["'hybrid' layers"]),  # a recurrent state beside attention in every layer, in no mixer we serve
        ("diffllama", ["more than once per layer"]),
        ("doge", ["attention mask of its own"]),
        ("phimoe", ["windows", "[8]"]),  # a sliding window its mask has and its attention call lacks
        ("recurrent_gemma", ["'linear_attention' layers", "recurrent state"]),
        ("bloom", ["ran no attention through transformers' AttentionInterface"]),  # attention in its own code
    ],
)
def test_unsupported_state_is_named_before_any_token(model_type, words):
    model = tiny_model(model_type)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7]])
    with pytest.raises(hf_specdec.UnsupportedModelError) as err:
        model.generate(ids, max_new_tokens=4, do_sample=False, assistant=hf_specdec.NgramAssistant())
    for word in words:
        assert word in str(err.value), str(err.value)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()), "the model was changed"
    # the same model still generates with vanilla generate afterwards
    assert model.generate(ids, max_new_tokens=4, do_sample=False).shape == (1, 11)


class _Mixer(torch.nn.Module):
    """A module that keeps a state between forwards (its forward takes a cache argument), beside attention."""

    def forward(self, x, cache_params=None):
        return x


def test_a_stateful_module_beside_attention_is_refused():
    """Even where every layer runs attention once (Falcon-H1's pattern), a module with a cache argument that is no
    attention call or parent of one keeps state hf_specdec would not roll back."""
    model = tiny_model("llama")
    model.model.layers[0].mixer = _Mixer()
    attention = [layer.self_attn for layer in model.model.layers]
    with pytest.raises(hf_specdec.UnsupportedModelError, match=r"model.layers.0.mixer \(_Mixer\)"):
        check_forward(model, attention, len(attention))
    del model.model.layers[0].mixer
    check_forward(model, attention, len(attention))  # the plain model passes
    # a layer whose attention never reached hf_specdec (it attended in its own code) is named too
    with pytest.raises(hf_specdec.UnsupportedModelError, match=r"model.layers.1.self_attn \(LlamaAttention\)"):
        check_forward(model, attention[:1], len(attention))
