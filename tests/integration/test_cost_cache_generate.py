"""The cost curve kept across processes, through `model.generate`: a call writes the curve it learnt, a second process
starts from it (not from the prior), and greedy output stays vanilla's whether the curve was learnt or loaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import hf_specdec
from hf_specdec.generation import cost_cache
from hf_specdec.generation.cost_model import PriorCurve, cost_model_for
from hf_specdec.testing import RandomTreeProposer, assert_same_tokens, left_pad, tiny_causal_lm

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 5, 6, 7], [3, 4, 5, 3, 4, 5]]
SECOND_PROCESS = """
import json, sys
import torch
import hf_specdec
from hf_specdec.generation.cost_model import cost_model_for
from hf_specdec.testing import tiny_causal_lm
torch.set_num_threads(int(sys.argv[1]))
cost = cost_model_for(tiny_causal_lm("llama"))
print(json.dumps({"predicted": cost.predict_range(1, 40), "loaded": cost.loaded, "stale": cost.summary()["stale"]}))
"""


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "curves"
    monkeypatch.setenv(cost_cache.ENV_VAR, str(folder))
    return folder


def test_a_second_process_starts_from_the_curve_the_first_wrote(cache):
    model = tiny_causal_lm("llama")
    ids = torch.tensor([PROMPTS[0]])
    model.generate(ids, max_new_tokens=24, do_sample=False, assistant=hf_specdec.NgramAssistant())
    assert len(list(cache.glob("llama-*.json"))) == 1, "the call writes the curve it learnt"
    learnt = cost_model_for(model)
    run = subprocess.run(
        [sys.executable, "-c", SECOND_PROCESS, str(torch.get_num_threads())],
        capture_output=True, text=True, timeout=600, env=os.environ.copy(),
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    second = json.loads(run.stdout.strip().splitlines()[-1])
    assert second["loaded"] == learnt.num_samples > 0
    assert second["predicted"] == learnt.predict_range(1, 40)
    assert second["predicted"] != [PriorCurve.linear()(n) for n in range(1, 40)]
    assert second["stale"] == sorted(learnt.summary()["curve"]), "loaded buckets are re-measured before trusted"


@pytest.mark.parametrize("batch", [1, 2])
def test_greedy_output_is_vanilla_with_a_learnt_and_with_a_loaded_curve(cache, batch):
    ids, mask = left_pad(PROMPTS[:batch])
    for state in ("learnt", "loaded"):
        model = tiny_causal_lm("llama", seed=2)  # a new object: a new cost model, from the file once it exists
        expected = model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
        for name, assistant in {
            "ngram": hf_specdec.NgramAssistant(),
            "random": RandomTreeProposer(model.config.vocab_size, nodes=8),
        }.items():
            out = model.generate(
                ids, attention_mask=mask, max_new_tokens=20, do_sample=False, assistant=assistant,
                return_dict_in_generate=True,
            )  # fmt: skip
            assert_same_tokens(out.sequences, expected, f"batch={batch} curve={state} assistant={name}")
        loaded = out.spec_stats.budget["cost"]["loaded_samples"]
        assert (loaded > 0) == (state == "loaded"), f"{state}: {loaded} samples loaded"
