"""The GEMM forms measured by `packed_linears`, kept across processes (`generation/gemm_cache.py`): a new process
starts from the choices saved on this machine and does not time those forms again; a file of another machine, or
entries that are no valid choice, are never used; an unwritable folder changes nothing but that. Every test points
``HF_SPECDEC_COST_CACHE`` at its own folder and starts from an empty process state (conftest.py turns the cache off
for the rest of the suite)."""

from __future__ import annotations

import json
import logging

import pytest
import torch

import hf_specdec
from hf_specdec.generation import gemm_cache
from hf_specdec.generation import packed_linears as cpu_linear
from hf_specdec.kernels import few_rows_gemm
from hf_specdec.testing import assert_same_tokens, tiny_causal_lm

KEY_PACKED = (1536, 576, 5, False, 1, True)
KEY_STOCK = (576, 1536, 3, False, 1, False)


def new_process(monkeypatch) -> None:
    """What a fresh process holds: no GEMM choice, no trial, the cache file not read yet; MKL's forms only (where the
    few-rows kernel is loaded MKL's packed form is not offered, and these tests save and read its choices)."""
    monkeypatch.setattr(few_rows_gemm, "_MODULE", [None])
    monkeypatch.setattr(cpu_linear, "_KERNELS_LOOKED_UP", [True])
    monkeypatch.setattr(cpu_linear, "_GEMM_CHOICE", {})
    monkeypatch.setattr(cpu_linear, "_GEMM_TRIALS", {})
    monkeypatch.setattr(gemm_cache, "_STATE", {"loaded": False, "saved_at": None, "saved": {}})


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv("HF_SPECDEC_COST_CACHE", str(folder))
    new_process(monkeypatch)
    return folder


def test_choices_saved_by_one_process_are_taken_by_the_next(cache, monkeypatch):
    assert gemm_cache.load_gemm_choices() == 0  # nothing saved yet
    cpu_linear._GEMM_CHOICE.update({KEY_PACKED: "packed", KEY_STOCK: "weight_major"})
    assert gemm_cache.save_gemm_choices()
    assert not gemm_cache.save_gemm_choices(force=True), "nothing new since the last write"
    path = gemm_cache.choices_file()
    assert path.parent == cache and path.exists()
    new_process(monkeypatch)
    assert gemm_cache.load_gemm_choices() == 2
    assert cpu_linear.measured_gemm_forms() == {KEY_PACKED: "packed", KEY_STOCK: "weight_major"}
    assert gemm_cache.load_gemm_choices() == 0, "the file is read once per process"


def test_a_process_keeps_what_it_measured_itself_and_merges_the_file(cache, monkeypatch):
    cpu_linear._GEMM_CHOICE.update({KEY_PACKED: "packed"})
    assert gemm_cache.save_gemm_choices()
    new_process(monkeypatch)
    cpu_linear._GEMM_CHOICE[KEY_PACKED] = "linear"  # measured here before the file was read: this process wins
    cpu_linear._GEMM_CHOICE[KEY_STOCK] = "linear"
    assert gemm_cache.load_gemm_choices() == 0
    assert cpu_linear.measured_gemm_forms()[KEY_PACKED] == "linear"
    assert gemm_cache.save_gemm_choices(force=True)
    saved = json.loads(gemm_cache.choices_file().read_text())["state"]["forms"]
    assert sorted(map(tuple, saved)) == sorted([(*KEY_PACKED, "linear"), (*KEY_STOCK, "linear")])


def test_a_file_of_another_machine_or_invalid_entries_are_not_used(cache, monkeypatch):
    cpu_linear._GEMM_CHOICE.update({KEY_PACKED: "packed"})
    assert gemm_cache.save_gemm_choices()
    path = gemm_cache.choices_file()
    payload = json.loads(path.read_text())
    payload["state"]["forms"] += [
        [576, 1536, 3, False, 1, False, "packed"],  # packed where packing was not allowed
        [576, 1536, 4, False, 1, False, "fastest"],  # no such form
        [576, "1536", 5, False, 1, False, "linear"],  # not a shape
        [576, 1536, 6, 0, 1, False, "linear"],  # bias is a flag
        "garbage",
    ]
    path.write_text(json.dumps(payload))
    new_process(monkeypatch)
    assert gemm_cache.load_gemm_choices() == 1
    assert cpu_linear.measured_gemm_forms() == {KEY_PACKED: "packed"}
    cpu_linear._GEMM_CHOICE[KEY_STOCK] = "linear"
    assert gemm_cache.save_gemm_choices(force=True), "a file with invalid entries is rewritten with the valid ones"
    assert sorted(map(tuple, json.loads(path.read_text())["state"]["forms"])) == [
        (*KEY_STOCK, "linear"),
        (*KEY_PACKED, "packed"),
    ]

    payload["key"]["machine"]["cpu"] = "another CPU"
    path.write_text(json.dumps(payload))
    new_process(monkeypatch)
    assert gemm_cache.load_gemm_choices() == 0 and cpu_linear.measured_gemm_forms() == {}

    path.write_text("{not json")
    new_process(monkeypatch)
    assert gemm_cache.load_gemm_choices() == 0


def test_the_cache_switched_off_reads_and_writes_nothing(cache, monkeypatch):
    monkeypatch.setenv("HF_SPECDEC_COST_CACHE", "0")
    cpu_linear._GEMM_CHOICE.update({KEY_PACKED: "packed"})
    assert gemm_cache.choices_file() is None
    assert not gemm_cache.save_gemm_choices(force=True)
    assert gemm_cache.load_gemm_choices() == 0
    assert not cache.exists()


def test_an_unwritable_folder_warns_once_and_never_raises(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("HF_SPECDEC_COST_CACHE", str(blocker / "cache"))  # a folder under a file: cannot be made
    new_process(monkeypatch)
    cpu_linear._GEMM_CHOICE.update({KEY_PACKED: "packed"})
    with caplog.at_level(logging.WARNING):
        assert not gemm_cache.save_gemm_choices(force=True)
        cpu_linear._GEMM_CHOICE[KEY_STOCK] = "linear"
        assert not gemm_cache.save_gemm_choices(force=True)
    warnings = [r for r in caplog.records if "cannot write what the tree budget learnt" in r.getMessage()]
    assert len(warnings) == 1


@pytest.mark.skipif(not cpu_linear.available(), reason="this torch build has no MKL packed linear")
def test_a_new_process_decodes_without_timing_the_forms_again(cache, monkeypatch):
    """The same call in a second process (same trees: ``tree_budget=False``) runs no GEMM trial the first process
    completed; a second process without the cache times them all again. Tokens stay vanilla's."""
    monkeypatch.setattr(cpu_linear, "PACK_AFTER", 1)
    model = tiny_causal_lm("llama", hidden_size=64, num_layers=2)
    ids = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]])
    want = model.generate(ids, max_new_tokens=40, do_sample=False)

    def call() -> int:
        before = cpu_linear.tuning_calls()
        for _ in range(4):  # enough forwards of each row count for its choice to be made
            got = model.generate(
                ids, max_new_tokens=40, do_sample=False, assistant=hf_specdec.NgramAssistant(), tree_budget=False
            )
            assert_same_tokens(got, want)
        return cpu_linear.tuning_calls() - before

    first = call()
    assert first > 0 and cpu_linear.measured_gemm_forms(), "the call timed the GEMM forms of its row counts"
    assert gemm_cache.save_gemm_choices(force=True) or gemm_cache.choices_file().exists()
    new_process(monkeypatch)
    assert call() < first / 2, "a new process starts from the saved choices"
    monkeypatch.setenv("HF_SPECDEC_COST_CACHE", "0")
    new_process(monkeypatch)
    assert call() == first, "without the cache a new process times every form again"
