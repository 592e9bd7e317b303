"""MLP speculator self-distillation: teacher-forced batches, a short run on a tiny model lowers the loss and raises
held-out top-1 and tree acceptance (offline and in `generate`), resume equals an uninterrupted run, tree tuning."""

import shutil

import pytest
import torch

from hf_specdec.generation.proposers.mlp_speculator import MLPSpeculatorAssistant, budget_widths
from hf_specdec.heads.mlp_speculator import MLPSpeculator
from hf_specdec.testing import assert_same_tokens, left_pad, tiny_causal_lm, torch_threads, toy_encode
from hf_specdec.training import build_distillation_data, latest_checkpoint, load_distillation_data, make_prompts
from hf_specdec.training.labels import draft_vocabulary, head_positions, medusa_labels
from hf_specdec.training.mlp_speculator import (
    MLPSpeculatorTrainingConfig,
    stage_inputs,
    train_mlp_speculator,
    tree_accepted_depths,
    tune_speculator_tree,
)

NUM_PROMPTS = 256


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def tiny():
    return tiny_causal_lm("llama", hidden_size=64, seed=0)


@pytest.fixture(scope="module")
def data_dir(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("mlp_data")
    prompts = [toy_encode(p) for p in make_prompts(NUM_PROMPTS, seed=0)]
    build_distillation_data(tiny, prompts, out, max_new_tokens=48, batch_size=32, shard_size=64,
                            base_model_name="tiny-llama", progress=False)  # fmt: skip
    return out


def small_config(**kw) -> MLPSpeculatorTrainingConfig:
    base = dict(inner_dim=48, n_predict=3, top_k_tokens_per_head=(3, 2, 2), draft_vocab=None, epochs=1e4,
                max_steps=200, positions_per_step=128, lr=1e-2, warmup_steps=2, eval_fraction=0.2)  # fmt: skip
    base.update(kw)
    return MLPSpeculatorTrainingConfig(**base)


def test_stage_inputs_are_the_target_tokens_before_each_label(data_dir):
    data = load_distillation_data(data_dir)
    pos = head_positions(data, torch.arange(data.seq_bounds.shape[0]))
    inputs, labels = stage_inputs(data, pos, 3), medusa_labels(data, pos, 3)
    for p in (0, 17, pos.numel() - 1):
        t = int(pos[p])
        for k in range(3):
            if labels[k, p] >= 0:  # stage k reads token t + 1 + k and must guess token t + 2 + k
                assert int(inputs[p, k]) == int(data.input_ids[t + 1 + k])
                assert int(labels[k, p]) == int(data.input_ids[t + 2 + k])


def test_draft_vocabulary_takes_frequent_labels_then_low_ids(data_dir):
    data = load_distillation_data(data_dir)
    pos = head_positions(data, torch.arange(data.seq_bounds.shape[0]))
    counts = torch.bincount(data.input_ids[pos + 2], minlength=97)
    seen = int((counts > 0).sum())
    vocab, coverage = draft_vocabulary(data, pos, seen + 5)
    assert coverage == 1.0 and vocab.tolist() == sorted(vocab.tolist())
    unseen = [i for i in range(97) if counts[i] == 0][:5]
    assert set(vocab.tolist()) == set((counts > 0).nonzero().flatten().tolist()) | set(unseen)
    small, part = draft_vocabulary(data, pos, 3)
    assert set(small.tolist()) == set(counts.topk(3).indices.tolist()) and part == float(
        counts.topk(3).values.sum()
    ) / len(pos)


def test_training_lowers_loss_and_raises_acceptance(data_dir, tiny, tmp_path):
    fresh, _ = train_mlp_speculator(data_dir, tmp_path / "fresh", small_config(max_steps=0), progress=False)
    spec, report = train_mlp_speculator(data_dir, tmp_path / "run", small_config(), progress=False)
    before, after = report["held_out_before"], report["held_out"]
    assert after["loss"] < before["loss"] - 1.0, (before["loss"], after["loss"])
    assert after["top1_per_stage"][0] > before["top1_per_stage"][0] + 0.1, (before, after)
    assert after["top1_per_stage"][2] > before["top1_per_stage"][2], (before, after)
    # tree acceptance on held-out positions: the trees decoding would draft accept more
    data = load_distillation_data(data_dir)
    eval_pos = head_positions(data, torch.arange(data.seq_bounds.shape[0])[-50:])
    gain = tree_accepted_depths(spec, data, eval_pos, [3, 3, 3]).float().mean()
    base = tree_accepted_depths(fresh, data, eval_pos, [3, 3, 3]).float().mean()
    assert gain > base + 0.3, (float(base), float(gain))
    # and in generate: same tokens as vanilla, longer accepted runs than the untrained speculator
    loaded = MLPSpeculator.from_pretrained(tmp_path / "run", base_model=tiny)
    assert loaded.model_card["held_out_top1_per_stage"] == after["top1_per_stage"]
    assert "MLP speculator for tiny-llama" in (tmp_path / "run" / "README.md").read_text()
    ids, mask = left_pad([toy_encode(p) for p in make_prompts(NUM_PROMPTS + 4, seed=0)[-4:]])
    expected = tiny.generate(ids, attention_mask=mask, max_new_tokens=32, do_sample=False)
    taus = {}
    for name, s in {"trained": loaded, "fresh": fresh}.items():
        out = tiny.generate(ids, attention_mask=mask, max_new_tokens=32, do_sample=False,
                            assistant=MLPSpeculatorAssistant(s, widths=[3, 3, 3]), return_dict_in_generate=True,
                            tree_budget=False)  # fmt: skip
        assert_same_tokens(out.sequences, expected, name)
        taus[name] = out.spec_stats.tau
    assert taus["trained"] > taus["fresh"] + 0.3, taus


def test_truncated_draft_vocabulary_trains(data_dir, tmp_path):
    spec, report = train_mlp_speculator(data_dir, tmp_path, small_config(draft_vocab=40, max_steps=60),
                                        progress=False)  # fmt: skip
    assert spec.draft_vocab_size == 40 and 0 < report["draft_vocab_coverage"] <= 1
    assert report["held_out"]["top1_per_stage"][0] > report["held_out_before"]["top1_per_stage"][0] + 0.05


def test_resume_from_a_checkpoint_matches_an_uninterrupted_run(data_dir, tmp_path):
    cfg = small_config(max_steps=12, checkpoint_every=4, keep_checkpoints=10, eval_positions=64)
    full, _ = train_mlp_speculator(data_dir, tmp_path / "full", cfg, progress=False)
    assert latest_checkpoint(tmp_path / "full").name == "step-0000012.pt"
    with pytest.raises(FileExistsError, match="resume"):
        train_mlp_speculator(data_dir, tmp_path / "full", cfg, progress=False)
    (tmp_path / "cut" / "checkpoints").mkdir(parents=True)
    shutil.copy(tmp_path / "full" / "checkpoints" / "step-0000008.pt", tmp_path / "cut" / "checkpoints")
    resumed, report = train_mlp_speculator(data_dir, tmp_path / "cut", cfg, resume=True, progress=False)
    assert report["steps"] == 12
    for key, value in full.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[key], value, msg=f"{key} differs after resume")
    with pytest.raises(ValueError, match="inner_dim=48, now inner_dim=32"):
        train_mlp_speculator(data_dir, tmp_path / "cut", small_config(max_steps=12, inner_dim=32), resume=True,
                             progress=False)  # fmt: skip


def test_tree_tuning_weighs_acceptance_against_step_cost(data_dir, tiny, tmp_path):
    spec, _ = train_mlp_speculator(data_dir, tmp_path, small_config(max_steps=100), progress=False)
    data = load_distillation_data(data_dir)
    pos = head_positions(data, torch.arange(data.seq_bounds.shape[0])[-40:])
    candidates = [[1, 1, 1], [3, 3, 3]]
    free = tune_speculator_tree(spec, data, pos, candidates=candidates, cost={n: 1.0 for n in range(10)})
    assert spec.tree["widths"] == [3, 3, 3] and len(spec.tree["best_cut"]) == 3  # free nodes: the biggest tree
    assert max(r["tau"] for r in free) == spec.tree["held_out_tau"] > 1.0
    assert len(spec.tree["depth_acceptance"]) == 3
    tune_speculator_tree(spec, data, pos, candidates=candidates, cost={n: 1.0 + 10.0 * n for n in range(10)})
    assert spec.tree["best_cut"] == []  # every node costs more than it can win: draft nothing
    rows = tune_speculator_tree(spec, data, pos, tiny, candidates=[[1, 1], [2, 2]])  # measured on this machine
    assert {r["nodes"] for r in rows} == {0, 1, 2, 4} and set(spec.tree["step_cost"]) == {"1", "2", "4"}
    assistant = MLPSpeculatorAssistant(spec)  # candidates around the tuned tree; its costs are the budget's prior
    assert assistant.widths == budget_widths(spec, spec.tree["widths"]) and assistant.prior_cost is not None


def test_cli_has_a_train_mlp_speculator_subcommand():
    from hf_specdec import cli
    from hf_specdec.training.mlp_speculator import MLP_SPECULATOR_COMMAND, RECIPE

    args = cli.build_parser().parse_args(["train", "mlp-speculator", "--out", "x", "--data", "d1", "d2", "--resume"])
    assert args.out == "x" and args.data == ["d1", "d2"] and args.resume and args.trainer is MLP_SPECULATOR_COMMAND
    assert args.num_prompts == RECIPE["num_prompts"] and args.n_predict == 4 and args.draft_vocab == 8192


def test_cli_saves_in_the_dtype_asked_and_leaves_the_trained_speculator_as_it_is(data_dir, tmp_path):
    from hf_specdec.cli import build_parser
    from hf_specdec.training.mlp_speculator import save_in_dtype

    assert build_parser().parse_args(["train", "mlp-speculator", "--out", "x"]).save_dtype == "float16"
    args = build_parser().parse_args(["train", "mlp-speculator", "--out", "x", "--save-dtype", "float32"])
    assert args.save_dtype == "float32"
    spec, _ = train_mlp_speculator(load_distillation_data(data_dir), tmp_path / "run", small_config(max_steps=2),
                                   progress=False)  # fmt: skip
    full = tmp_path / "run" / "model.safetensors"
    save_in_dtype(spec, tmp_path / "half", "float16")
    assert spec.emb[0].weight.dtype == torch.float32  # the caller's speculator is not cast
    half = MLPSpeculator.from_pretrained(tmp_path / "half")
    assert half.emb[0].weight.dtype == torch.float16
    assert (tmp_path / "half" / "model.safetensors").stat().st_size < 0.6 * full.stat().st_size
    torch.testing.assert_close(half.emb[0].weight.float(), spec.emb[0].weight, atol=1e-2, rtol=1e-3)
