"""Draft heads computing in the dtype this CPU multiplies fastest (`generation/draft_dtype.py`, `heads/derived.py`).

- `draft_dtype`: ``HF_SPECDEC_DRAFT_DTYPE`` overrides the measurement, a bad value is refused naming the variable,
  non-fp32 or non-CPU weights keep their dtype, ``auto`` picks one of fp32 / bf16 and says what it measured.
- `drafting_copy` of every head class: the head itself in its own dtype; otherwise a bf16 copy that shares the bound
  target's modules, keeps fp32 buffers (EAGLE's rotary frequencies), leaves the user's head untouched, is made once
  and made again after a weight changes, and drafts what the fp32 head drafts up to bf16 rounding.
- greedy ``generate`` with bf16 and with fp32 drafting is token-for-token vanilla's for EAGLE, Medusa and the MLP
  speculator, batch 1 and 4, with and without the tree budget; the proposer drafted with the copy.
"""

from __future__ import annotations

import pytest
import torch

from hf_specdec.generation import draft_dtype as dd
from hf_specdec.generation.proposers.eagle import EagleAssistant
from hf_specdec.generation.proposers.medusa import MedusaAssistant
from hf_specdec.generation.proposers.mlp_speculator import MLPSpeculatorAssistant
from hf_specdec.heads.derived import DERIVED_ATTR
from hf_specdec.heads.eagle import EagleHead
from hf_specdec.heads.mlp_speculator import MLPSpeculator
from hf_specdec.testing import assert_same_tokens, left_pad, random_medusa_heads, tiny_causal_lm

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 5, 6, 7], [3, 4, 5], [9, 9, 8, 7, 6, 5, 4], [12, 13, 12, 13, 12, 13, 12, 13, 12]]


@pytest.fixture(scope="module")
def model():
    return tiny_causal_lm("llama", num_layers=4)


def _randomised(module, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return module.eval()


def eagle_head(model, seed=0):
    return _randomised(EagleHead.for_model(model, version=1, draft_vocab=torch.arange(3, 60)), seed).bind(model)


def speculator(model, seed=0):
    kwargs = {"inner_dim": 32, "n_predict": 3, "top_k_tokens_per_head": [3, 2, 2], "scale_input": True}
    return _randomised(MLPSpeculator.for_model(model, token_map=torch.arange(3, 70), **kwargs), seed)


def medusa_heads(model, seed=0):
    heads = random_medusa_heads(model, seed=seed)
    heads.token_map = torch.arange(3, 70)  # a draft vocabulary: the lm_head rows are gathered (and converted)
    return heads.bind(model)


# ---------------------------------------------------------------------------------------------- the dtype choice
def test_env_overrides_and_bad_values(monkeypatch):
    w = torch.zeros(4, 16)
    monkeypatch.setenv(dd.ENV_VAR, "bfloat16")
    assert dd.draft_dtype(w) == torch.bfloat16
    monkeypatch.setenv(dd.ENV_VAR, "float32")
    assert dd.draft_dtype(w) == torch.float32
    monkeypatch.setenv(dd.ENV_VAR, "bf16")
    assert dd.describe() == f"bfloat16 ({dd.ENV_VAR})"  # what the bench's report header says
    monkeypatch.setenv(dd.ENV_VAR, "fp8")
    with pytest.raises(ValueError, match=dd.ENV_VAR):
        dd.draft_dtype(w)
    assert dd.draft_dtype(w.half()) == torch.float16  # a head the user cast keeps its dtype, whatever is asked


def test_auto_measures_once(monkeypatch):
    monkeypatch.setenv(dd.ENV_VAR, "auto")
    choice = dd.draft_dtype(torch.zeros(4, 48))
    assert choice in (torch.float32, torch.bfloat16)
    seen = dd.measured()[48]
    assert seen["choice"] == str(choice).removeprefix("torch.") and set(seen["seconds"]) == {"float32", "bfloat16"}
    fp32, bf16 = seen["seconds"]["float32"], seen["seconds"]["bfloat16"]
    assert (choice == torch.bfloat16) == (fp32 >= dd.MIN_SPEEDUP * bf16)
    assert f"{seen['choice']} (measured for 48-wide heads" in dd.describe()
    assert dd.measure(48)[1] is dd.measure(48)[1]  # measured once per process and shape


# ---------------------------------------------------------------------------------------------- the copies
@pytest.mark.parametrize("kind", ["eagle", "medusa", "mlp_speculator"])
def test_drafting_copy(model, kind):
    head = {"eagle": eagle_head, "medusa": medusa_heads, "mlp_speculator": speculator}[kind](model)
    before = {k: v.clone() for k, v in head.state_dict().items()}
    assert head.drafting_copy(torch.float32) is head
    twin = head.drafting_copy(torch.bfloat16)
    assert twin is not head and head.drafting_copy(torch.bfloat16) is twin  # made once
    assert all(p.dtype == torch.bfloat16 for p in twin.parameters() if p.is_floating_point())
    for name, buf in head.named_buffers():  # buffers keep their dtype (rotary frequencies stay fp32)
        assert dict(twin.named_buffers())[name].dtype == buf.dtype, name
    after = head.state_dict()  # the user's head is untouched
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    assert all(p.dtype == torch.float32 for p in head.parameters())
    shared = {"eagle": ("_target_embed", "_target_lm_head"), "medusa": ("_base_lm_head",), "mlp_speculator": ()}[kind]
    for attr in shared:  # the bound target's modules are shared, not copied
        assert getattr(twin, attr) is getattr(head, attr) and getattr(head, attr) is not None
    with torch.no_grad():
        next(p for p in head.parameters() if p.dim() >= 2).mul_(1.5)  # a weight changes: a new copy
    assert head.drafting_copy(torch.bfloat16) is not twin


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal up to bf16 rounding: the largest error within 3% of the largest logit."""
    return float((got.float() - want).abs().max()) <= 0.03 * float(want.abs().max())


def test_bf16_copies_draft_what_fp32_drafts(model):
    x = torch.randn(5, model.config.hidden_size)
    tokens = torch.randint(3, 60, (1, 5))
    with torch.no_grad():
        eagle = eagle_head(model)
        _, logits = eagle(tokens, x[None])
        _, logits16 = eagle.drafting_copy(torch.bfloat16)(tokens, x[None])
        assert logits16.dtype == torch.float32 and _close(logits16, logits)
        heads = medusa_heads(model)
        want = heads.draft_logits(heads.head_states(x))
        twin = heads.drafting_copy(torch.bfloat16)
        got = twin.draft_logits(twin.head_states(x))
        assert got.dtype == torch.bfloat16 and _close(got, want)
        spec = speculator(model)
        feed = torch.randint(0, model.config.vocab_size, (5, 3))
        assert _close(spec.drafting_copy(torch.bfloat16)(x, feed), spec(x, feed))


# ---------------------------------------------------------------------------------------------- generate
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_matches_vanilla_in_either_dtype(model, monkeypatch, dtype, batch):
    monkeypatch.setenv(dd.ENV_VAR, dtype)
    ids, mask = left_pad(PROMPTS[:batch])
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
    cases = {
        "eagle": lambda: EagleAssistant(eagle_head(model)),
        "medusa": lambda: MedusaAssistant(medusa_heads(model)),
        "mlp_speculator": lambda: MLPSpeculatorAssistant(speculator(model)),
    }
    for name, make in cases.items():
        for budget in (False, True):
            assistant = make()
            out = model.generate(
                ids, attention_mask=mask, max_new_tokens=24, do_sample=False, assistant=assistant,
                return_dict_in_generate=True, tree_budget=budget,
            )  # fmt: skip
            assert_same_tokens(out.sequences, expected, f"{name} draft dtype {dtype} batch {batch} budget {budget}")
            assert budget or out.spec_stats.drafted_tokens > 0, name
            head = getattr(assistant, {"eagle": "head", "medusa": "heads", "mlp_speculator": "speculator"}[name])
            copies = [k for k in head.__dict__.get(DERIVED_ATTR, {}) if k.startswith("_drafting_copy")]
            assert copies == (["_drafting_copy_torch.bfloat16"] if dtype == "bfloat16" else []), name  # drafted with
