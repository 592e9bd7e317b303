"""The tree budget's cost curve kept across processes (`generation/cost_cache.py`): a new cost model starts from the
curve saved for this machine and model, with every bucket stale (re-measured, and forgotten when the machine
disagrees); a curve of another machine or model is never used; a cache that is off or unwritable changes nothing
but where a cost model starts. Every test points ``HF_SPECDEC_COST_CACHE`` at its own folder (conftest.py turns
the cache off for the rest of the suite)."""

from __future__ import annotations

import json
import logging
import random

import pytest
import torch

import hf_specdec
from hf_specdec.generation import cost_cache
from hf_specdec.generation.budget import RowCandidates, TreeBudgeter
from hf_specdec.generation.cost_model import (
    _FILES,
    PriorCurve,
    StepCostModel,
    _save_learnt_curves,
    cost_model_for,
    save_learnt_curve,
)
from hf_specdec.generation.tree import DraftTree
from hf_specdec.kernels.cpu_linear import available as mkl_linears
from hf_specdec.testing import assert_same_tokens, tiny_causal_lm


def cpu_curve(n: float) -> float:
    """A verify cost the prior does not predict: 20 ms for one token, +15% per extra token."""
    return 0.02 * (1 + 0.15 * (n - 1))


def feed(cost: StepCostModel, curve=cpu_curve, sizes=range(1, 20), repeats=3) -> StepCostModel:
    for _ in range(repeats):
        for n in sizes:
            cost.record_verify(n, 1, curve(n))
    cost.record_other(1, 0.001)
    return cost


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "curves"
    monkeypatch.setenv(cost_cache.ENV_VAR, str(folder))
    return folder


def saved_curve(model) -> StepCostModel:
    """``model``'s cost model, fed and written to the cache (a later save needs ``model`` alive: the cache holds it
    by a weak reference)."""
    cost = feed(cost_model_for(model))
    assert save_learnt_curve(cost), "the first save of a process with new samples writes"
    return cost


# ---------------------------------------------------------------------------------------------- the state
def test_a_loaded_state_predicts_the_saved_curve_and_starts_stale():
    saved = feed(StepCostModel())
    loaded = StepCostModel()
    assert loaded.load_state(json.loads(json.dumps(saved.state())))
    assert loaded.predict_range(1, 100) == saved.predict_range(1, 100)
    assert loaded.other_seconds(3) == saved.other_seconds(3)
    assert saved.needs_sample(4, 3) is None and loaded.needs_sample(4, 3) == "stale"
    assert loaded.summary()["stale"] == sorted(loaded.summary()["curve"])
    assert loaded.summary()["loaded_samples"] == saved.num_samples == loaded.num_samples


def test_a_loaded_curve_the_machine_now_disagrees_with_is_forgotten():
    slower = StepCostModel()
    slower.load_state(feed(StepCostModel()).state())
    slower.record_verify(4, 1, 2 * cpu_curve(4))
    assert slower.forgotten == 1 and slower.samples(4) == 1 and slower.samples(8) == 0
    assert slower.predict(8) != pytest.approx(cpu_curve(8))

    agrees = StepCostModel()
    agrees.load_state(feed(StepCostModel()).state())
    agrees.record_verify(4, 1, 1.1 * cpu_curve(4))
    assert agrees.forgotten == 0 and agrees.samples(4) == 4
    assert agrees.needs_sample(4, 3) is None and agrees.needs_sample(8, 3) == "stale"


@pytest.mark.parametrize("slow", [1.8, 3.0, 6.0])
def test_a_curve_saved_while_the_machine_was_slower_does_not_lock_the_budget(slow):
    """A curve saved while drafting was slow (another process on the cores) makes every tree look expensive; on the
    machine as it is now the budget must find the paying size again, not draft nothing forever."""
    saved = feed(StepCostModel(), curve=lambda n: cpu_curve(n) * (slow if n > 1 else 1.0))
    budgeter = TreeBudgeter(StepCostModel())
    assert budgeter.cost.load_state(saved.state())
    tree, scores = DraftTree.chain(list(range(10, 22))), [0.8 ** (d + 1) for d in range(12)]
    rng, sizes = random.Random(3), []
    for _ in range(300):
        k = budgeter.cut([RowCandidates(0, tree, scores)])[0].num_nodes
        sizes.append(k)
        depth = 0
        while depth < k and rng.random() < 0.8:
            depth += 1
        budgeter.record_verdicts([list(range(depth))])
        budgeter.record_step(1 + k, 1, cpu_curve(1 + k), 0.0005 if k else 0.0, 0.0)

    def rate(j):
        return (1 + sum(scores[:j])) / (cpu_curve(1 + j) + (0.0005 if j else 0.0))

    best = max(range(13), key=rate)
    assert min(rate(k) for k in sizes[-10:]) >= 0.9 * rate(best), (sizes[-50:], best)
    assert sum(k > 0 for k in sizes[-50:]) >= 45, f"the row must draft with the machine's own curve: {sizes[-50:]}"


def test_a_measured_model_takes_no_state_and_a_malformed_one_is_refused():
    cost = feed(StepCostModel())
    before = cost.predict_range(1, 30)
    assert not cost.load_state(feed(StepCostModel(), curve=lambda n: 2 * cpu_curve(n)).state())
    assert cost.predict_range(1, 30) == before
    state = feed(StepCostModel()).state()
    for bad in ({"65": [0.1]}, {"4": [-1.0]}, {"4": []}, "not a mapping"):
        with pytest.raises(ValueError, match="cost curve|StepCostModel.state"):
            StepCostModel().load_state({**state, "samples": bad})
    with pytest.raises(ValueError, match="StepCostModel.state"):
        StepCostModel().load_state({"samples": state["samples"]})


# ---------------------------------------------------------------------------------------------- the cache
def test_a_new_cost_model_starts_from_the_curve_saved_for_this_machine_and_model(cache):
    saved = saved_curve(tiny_causal_lm("llama"))
    (path,) = cache.glob("*.json")
    assert path.name.startswith("llama-") and not list(cache.glob("*.tmp"))
    assert json.loads(path.read_text())["key"] == cost_cache.curve_key(tiny_causal_lm("llama"))
    again = cost_model_for(tiny_causal_lm("llama", seed=1))  # the same config, other weights: the same curve
    assert again.loaded == saved.num_samples
    assert again.predict_range(1, 80) == saved.predict_range(1, 80)


def test_saves_are_throttled_and_need_new_samples(cache):
    model = tiny_causal_lm("llama")  # alive: the cache keeps only a weak reference to it
    cost = saved_curve(model)
    file = _FILES[cost][0]
    assert not save_learnt_curve(cost), "nothing new since the last write"
    cost.record_verify(3, 1, cpu_curve(3))
    assert not save_learnt_curve(cost), "new samples, but the last write is recent"
    file.saved_at -= cost_cache.SAVE_EVERY_S
    assert save_learnt_curve(cost)
    cost.record_verify(3, 1, cpu_curve(3))
    assert save_learnt_curve(cost, force=True), "whatever the last write's age"
    cost.record_verify(5, 1, cpu_curve(5))
    _save_learnt_curves()  # what runs at exit
    assert json.loads(file.path.read_text())["state"] == cost.state()
    assert not save_learnt_curve(StepCostModel()), "a cost model cost_model_for did not make has no file"


@pytest.mark.parametrize("change", ["cpu", "cores", "threads"])
def test_a_curve_of_another_machine_is_never_used(cache, monkeypatch, change):
    threads = torch.get_num_threads()
    with monkeypatch.context() as m:
        if change == "cpu":
            m.setattr(cost_cache, "_cpu_name", lambda: "Another CPU @ 5.0GHz")
        elif change == "cores":
            m.setattr(cost_cache, "_usable_cores", lambda: 96)
        else:
            torch.set_num_threads(threads + 1)
        try:
            saved_curve(tiny_causal_lm("llama"))
        finally:
            torch.set_num_threads(threads)
    assert len(list(cache.glob("*.json"))) == 1
    fresh = cost_model_for(tiny_causal_lm("llama"))
    assert fresh.num_samples == 0 and fresh.predict(8) == PriorCurve.linear()(8)


def test_a_file_holding_another_key_is_never_used(cache):
    saved_curve(tiny_causal_lm("llama"))
    (path,) = cache.glob("*.json")
    payload = json.loads(path.read_text())
    payload["key"]["machine"]["cpu"] = "Another CPU @ 5.0GHz"
    path.write_text(json.dumps(payload))
    assert cost_model_for(tiny_causal_lm("llama")).num_samples == 0
    path.write_text("{ half a file")
    model = tiny_causal_lm("llama")
    cost = cost_model_for(model)
    assert cost.num_samples == 0
    assert save_learnt_curve(feed(cost)), "a malformed file is replaced by the next save"
    assert json.loads(path.read_text())["state"] == cost.state()


def _eager(model):
    model.set_attn_implementation("eager")
    return model


def _quantized(model):
    model.config.quantization_config = {"quant_method": "torchao", "quant_type": "int8_weight_only"}
    return model


OTHER_MODELS = {
    "hidden size": lambda: tiny_causal_lm("llama", hidden_size=32),
    "vocabulary": lambda: tiny_causal_lm("llama", vocab_size=101),
    "layers": lambda: tiny_causal_lm("llama", num_layers=3),
    "architecture": lambda: tiny_causal_lm("qwen3"),
    "dtype": lambda: tiny_causal_lm("llama", dtype=torch.bfloat16),
    "attention": lambda: _eager(tiny_causal_lm("llama")),
    "quantization": lambda: _quantized(tiny_causal_lm("llama")),
}


@pytest.mark.parametrize("other", OTHER_MODELS)
def test_a_curve_of_another_model_is_never_used(cache, other):
    saved_curve(tiny_causal_lm("llama"))
    assert cost_model_for(OTHER_MODELS[other]()).num_samples == 0


@pytest.mark.skipif(not mkl_linears(), reason="this torch build has no MKL packed linears")
def test_a_curve_measured_with_packed_linears_is_not_used_without_them(cache, monkeypatch):
    saved_curve(tiny_causal_lm("llama"))
    monkeypatch.setenv("HF_SPECDEC_PACKED_LINEAR", "0")
    assert cost_model_for(tiny_causal_lm("llama")).num_samples == 0


def test_the_cache_switched_off_reads_and_writes_nothing(cache, monkeypatch):
    saved_curve(tiny_causal_lm("llama"))
    (path,) = cache.glob("*.json")
    text = path.read_text()
    monkeypatch.setenv(cost_cache.ENV_VAR, "0")
    cost = feed(cost_model_for(tiny_causal_lm("llama")), curve=lambda n: 2 * cpu_curve(n))
    assert cost.loaded == 0 and not save_learnt_curve(cost, force=True)
    assert path.read_text() == text and list(cache.iterdir()) == [path]


def test_the_folder_follows_the_hf_specdec_and_hugging_face_cache_variables(tmp_path, monkeypatch):
    for name in (cost_cache.ENV_VAR, "HF_SPECDEC_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert cost_cache.cache_folder() == tmp_path / "hf" / "hf_specdec" / "cost_curves"
    monkeypatch.setenv("HF_SPECDEC_CACHE", str(tmp_path / "own"))
    assert cost_cache.cache_folder() == tmp_path / "own" / "cost_curves"
    monkeypatch.setenv(cost_cache.ENV_VAR, "1")
    assert cost_cache.cache_folder() == tmp_path / "own" / "cost_curves"
    monkeypatch.setenv(cost_cache.ENV_VAR, str(tmp_path / "curves"))
    assert cost_cache.cache_folder() == tmp_path / "curves"
    monkeypatch.setenv(cost_cache.ENV_VAR, "off")
    assert cost_cache.cache_folder() is None


def test_an_unwritable_folder_does_not_fail_generate_and_warns_once(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "a file"
    blocker.write_text("not a folder")
    monkeypatch.setenv(cost_cache.ENV_VAR, str(blocker / "curves"))  # mkdir fails, also for root
    monkeypatch.setattr(cost_cache, "_WARNED", set())
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])
    caplog.set_level(logging.WARNING, logger=cost_cache.__name__)
    for seed in (0, 1):  # two models: two cost models that each try their first save
        model = tiny_causal_lm("llama", seed=seed)
        expected = model.generate(ids, max_new_tokens=12, do_sample=False)
        out = model.generate(ids, max_new_tokens=12, do_sample=False, assistant=hf_specdec.NgramAssistant())
        assert_same_tokens(out, expected, f"seed={seed}")
    warnings = [r for r in caplog.records if "cannot write what the tree budget learnt" in r.getMessage()]
    assert len(warnings) == 1 and cost_cache.ENV_VAR in warnings[0].getMessage()
