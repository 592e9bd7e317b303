"""Fine-tuning a trained head on new data (``init_head`` / ``init_heads`` / ``init_speculator``): the run starts from
the head (its held-out figure before training is the head's own), keeps its draft vocabulary, trains a copy and leaves
the user's head untouched; a head of another shape than the config is refused by name."""

from __future__ import annotations

import pytest
import torch

from hf_specdec.testing import tiny_causal_lm
from hf_specdec.training.distillation_data import build_distillation_data
from hf_specdec.training.eagle import EagleTrainingConfig, train_eagle
from hf_specdec.training.medusa import MedusaTrainingConfig, train_medusa
from hf_specdec.training.mlp_speculator import MLPSpeculatorTrainingConfig, train_mlp_speculator
from hf_specdec.training.shards import load_distillation_data


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model = tiny_causal_lm("llama", vocab_size=64, hidden_size=32, num_layers=2, seed=3)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 64, (6,), generator=gen).tolist() for _ in range(24)]
    folder = tmp_path_factory.mktemp("data")
    build_distillation_data(model, prompts, folder, max_new_tokens=16, batch_size=12, shard_size=12,
                            hidden_dtype=torch.float32, progress=False)  # fmt: skip
    return model, load_distillation_data(folder)


def _state(module) -> dict:
    return {k: v.clone() for k, v in module.state_dict().items()}


def _assert_same(before: dict, module) -> None:
    for k, v in module.state_dict().items():
        assert torch.equal(before[k], v), f"{k} of the head to fine-tune changed"


def test_eagle_fine_tuning_starts_from_the_head(tiny, tmp_path):
    model, data = tiny
    cfg = dict(window=16, positions_per_step=4, max_steps=30, lr=3e-3, warmup_steps=2, draft_vocab=32,
               eval_fraction=0.2, checkpoint_every=0)  # fmt: skip
    first, rep1 = train_eagle(model, data, tmp_path / "a", EagleTrainingConfig(**cfg), progress=False)
    before = _state(first)
    tuned, rep2 = train_eagle(model, data, tmp_path / "b", EagleTrainingConfig(**cfg, seed=1), progress=False,
                              init_head=first)  # fmt: skip
    _assert_same(before, first)
    assert torch.equal(tuned.d2t, first.d2t)
    assert any(not torch.equal(a, b) for a, b in zip(tuned.state_dict().values(), before.values()))
    fresh = rep1["held_out_before"]["top1"]
    assert rep2["held_out_before"]["top1"] != fresh  # it started from the trained head, not from scratch
    with pytest.raises(ValueError, match="drafts over 32 tokens, the config asks for 16"):
        train_eagle(model, data, tmp_path / "c", EagleTrainingConfig(**{**cfg, "draft_vocab": 16}), progress=False,
                    init_head=first)  # fmt: skip


def test_medusa_and_speculator_fine_tuning_keep_the_head(tiny, tmp_path):
    model, data = tiny
    lm_head = model.get_output_embeddings()
    mcfg = dict(num_heads=2, max_steps=20, positions_per_step=32, loss_vocab=32, draft_vocab=True, checkpoint_every=0)
    heads, _ = train_medusa(data, tmp_path / "m1", lm_head, MedusaTrainingConfig(**mcfg), progress=False, cpu=True)
    before = _state(heads)
    tuned, report = train_medusa(data, tmp_path / "m2", lm_head, MedusaTrainingConfig(**mcfg), progress=False,
                                 cpu=True, init_heads=heads)  # fmt: skip
    _assert_same(before, heads)
    assert torch.equal(tuned.token_map, heads.token_map)
    with pytest.raises(ValueError, match="num_heads=2, the training config asks for 3"):
        train_medusa(data, tmp_path / "m3", lm_head, MedusaTrainingConfig(**{**mcfg, "num_heads": 3}),
                     progress=False, cpu=True, init_heads=heads)  # fmt: skip
    scfg = dict(inner_dim=32, n_predict=2, top_k_tokens_per_head=(2, 2), draft_vocab=32, max_steps=20,
                positions_per_step=32, checkpoint_every=0)  # fmt: skip
    spec, _ = train_mlp_speculator(data, tmp_path / "s1", MLPSpeculatorTrainingConfig(**scfg), progress=False)
    before = _state(spec)
    tuned, _ = train_mlp_speculator(data, tmp_path / "s2", MLPSpeculatorTrainingConfig(**scfg), progress=False,
                                    init_speculator=spec)  # fmt: skip
    _assert_same(before, spec)
    assert torch.equal(tuned.token_map, spec.token_map)
