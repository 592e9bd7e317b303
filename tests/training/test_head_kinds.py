"""The trainer interface (`hf_specdec.training.head_kinds`, one `TrainerKind` per kind its descriptor names): every kind trains a head of its class through the one
`train` signature on a tiny target, starts from ``init_head``, round-trips save / load (bound
to the target exactly where the kind binds), and scores held-out data with the keys the GPU recipe records; the
recipe has its settings for every kind."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_gpu_recipe import tiny, tiny_config  # noqa: F401  (tiny is a fixture)

from hf_specdec.kinds import HEAD_KINDS as DESCRIPTORS
from hf_specdec.training.distillation_data import build_distillation_data
from hf_specdec.training.head_kinds import trainer_kinds
from hf_specdec.training.shards import load_distillation_data
from tools import gpu_recipe

HEAD_KINDS = trainer_kinds()
# what `gpu_recipe.held_out_scores` records per kind (gpu_recipe.json, test_gpu_recipe.py read them)
HELD_OUT_KEYS = {
    "eagle": {"held_out_top1", "held_out_top4", "held_out_positions"},
    "dflash": {"held_out_top1", "held_out_chain_tau", "held_out_per_depth", "held_out_positions"},
    "medusa": {"held_out_top1", "held_out_positions"},
    "mlp_speculator": {"held_out_top1", "held_out_positions"},
}


@pytest.fixture(scope="module")
def tiny_data(tiny, tmp_path_factory):  # noqa: F811  (the fixture imported above)
    """The tiny target's greedy answers to random prompts, with the states of every kind's feature layers."""
    model, _ = tiny
    layers = sorted({layer for kind in HEAD_KINDS.values() for layer in kind.feature_layers(model)})
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 64, (int(torch.randint(4, 10, (1,), generator=gen)),), generator=gen).tolist()
               for _ in range(32)]  # fmt: skip
    folder = tmp_path_factory.mktemp("data")
    build_distillation_data(model, prompts, folder, max_new_tokens=24, batch_size=16, shard_size=16,
                            hidden_dtype=torch.float32, aux_layers=layers, progress=False)  # fmt: skip
    return load_distillation_data(folder, with_aux=True)


def _same_weights(a: torch.nn.Module, b: torch.nn.Module, atol: float = 0.0) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.allclose(sa[k].float(), sb[k].float(), atol=atol, rtol=0) for k in sa)


def test_the_table_and_the_recipe_cover_the_same_kinds(tiny):  # noqa: F811
    model, _ = tiny
    assert set(HEAD_KINDS) == set(gpu_recipe.RECIPE_HEADS) == set(HELD_OUT_KEYS)
    assert set(HEAD_KINDS) == {name for name, kind in DESCRIPTORS.items() if kind.trainer is not None}
    assert all(kind.command().name.replace("-", "_") == name for name, kind in HEAD_KINDS.items())
    assert all(kind.name == name for name, kind in HEAD_KINDS.items())
    assert {name for name, kind in HEAD_KINDS.items() if kind.binds} == {"eagle", "dflash"}
    assert {name for name, kind in HEAD_KINDS.items() if kind.feature_layers(model)} == {"eagle", "dflash"}


@pytest.mark.parametrize("name", list(HEAD_KINDS))
def test_every_kind_trains_round_trips_and_scores(name, tiny, tiny_data, tmp_path, monkeypatch):  # noqa: F811
    model, _ = tiny
    kind = HEAD_KINDS[name]
    cfg = gpu_recipe._trainer_config(name, tiny_config(), 4)
    assert isinstance(cfg, kind.config_class())
    head, report = kind.train(model, tiny_data, tmp_path / "run", cfg, False, "cpu", None)
    assert isinstance(head, kind.head_class()) and report["steps"] == 4
    head.save_pretrained(tmp_path / "head")
    loaded = kind.load(tmp_path / "head", model)
    assert type(loaded) is type(head) and not loaded.training and _same_weights(loaded, head)
    scores = kind.held_out(loaded, tiny_data, model, "cpu", 64)
    assert set(scores) == HELD_OUT_KEYS[name] and 0 < scores["held_out_positions"] <= 64, scores
    assert kind.held_out(head, tiny_data, model, "cpu", 64) == scores  # the loaded head is the trained one
    assert gpu_recipe.held_out_scores(name, loaded, tiny_data, model, "cpu", 64) == scores
    bound = []
    monkeypatch.setattr(kind.head_class(), "bind", lambda self, target: bound.append(target) or self, raising=False)
    kind.load(tmp_path / "head", model)
    assert bound == ([model] if kind.binds else [])


@pytest.mark.parametrize("name", list(HEAD_KINDS))
def test_a_kind_starts_from_its_init_head(name, tiny, tiny_data, tmp_path):  # noqa: F811
    """A head trained at a learning rate too small to move it is the ``init_head`` it was given, not a fresh one."""
    model, _ = tiny
    kind = HEAD_KINDS[name]
    cfg = gpu_recipe._trainer_config(name, tiny_config(), 2)
    first, _ = kind.train(model, tiny_data, tmp_path / "first", cfg, False, "cpu", None)
    still = dataclasses.replace(gpu_recipe._trainer_config(name, tiny_config(init_from="shipped"), 2), lr=1e-12)
    again, _ = kind.train(model, tiny_data, tmp_path / "again", still, False, "cpu", first)
    fresh, _ = kind.train(model, tiny_data, tmp_path / "fresh", dataclasses.replace(cfg, lr=1e-12, seed=7), False,
                          "cpu", None)  # fmt: skip
    assert _same_weights(again, first, atol=1e-6) and not _same_weights(fresh, first, atol=1e-6)

