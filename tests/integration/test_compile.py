"""torch.compile and hf-specdec in one process: after a speculative call the attention wrappers stay installed with
transformers, and a ``fullgraph=True`` compile of the model (what transformers' compiled static-cache ``generate``
does on a GPU) still traces and computes the same logits; a model compiled before a speculative call still decodes
vanilla's tokens."""

from __future__ import annotations

import pytest
import torch

from hf_specdec import NgramAssistant
from hf_specdec.attention.backend import active_plan, planned
from hf_specdec.testing import assert_same_tokens, tiny_causal_lm, torch_threads

PROMPT = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    with torch_threads(1):
        yield
    torch._dynamo.reset()


def test_a_fullgraph_compile_after_a_speculative_call_traces_and_matches():
    model = tiny_causal_lm("llama", num_layers=2)
    ids = torch.tensor(PROMPT)
    model.generate(ids, max_new_tokens=8, do_sample=False, assistant=NgramAssistant())  # installs the wrappers
    with torch.no_grad():
        want = model(ids).logits
        got = torch.compile(model, fullgraph=True, backend="eager")(ids).logits
    torch.testing.assert_close(got, want)


def test_a_compiled_model_still_decodes_vanillas_tokens_with_an_assistant():
    """A region compiled while no plan was open is retraced when a plan opens (it reads the open-plan count), so the
    speculative call's attention still serves its tree."""
    model = tiny_causal_lm("llama", num_layers=2)
    ids = torch.tensor(PROMPT)
    want = model.generate(ids, max_new_tokens=12, do_sample=False)
    model.compile(backend="eager")
    with torch.no_grad():
        model(ids)  # compiled with no plan open
    got = model.generate(ids, max_new_tokens=12, do_sample=False, assistant=NgramAssistant(),
                         return_dict_in_generate=True)  # fmt: skip
    assert_same_tokens(got.sequences, want, "compiled model, ngram assistant")
    assert got.spec_stats.tau > 1.0  # the drafts were verified through the tree, not skipped


def test_the_plan_lookup_is_guarded_by_the_open_plan_count():
    probe = torch.compile(lambda x: x + (1 if active_plan() is None else 2), backend="eager")
    x = torch.zeros(1)
    assert float(probe(x)) == 1.0
    with planned(object()):  # any plan object: only its presence is read here
        assert float(probe(x)) == 2.0
    assert float(probe(x)) == 1.0
