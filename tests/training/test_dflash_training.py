"""A short DFlash training run on a tiny model lowers the loss and raises acceptance (held-out chain acceptance and
the tau of a real generate call, whose output stays vanilla's), writes a loadable head, and resumes from its
checkpoint; the anchored blocks are labelled with the target's choice at each depth."""

from __future__ import annotations

import json

import pytest
import torch

import hf_specdec  # noqa: F401  (routes generate(assistant=...))
from hf_specdec.generation.proposers.dflash import DFlashAssistant
from hf_specdec.heads.dflash import DFlashHead, default_feature_layers
from hf_specdec.testing import assert_same_tokens, left_pad, tiny_causal_lm, torch_threads
from hf_specdec.training.dflash import (
    DFlashTrainingConfig,
    block_targets,
    dflash_block_hits,
    draw_anchors,
    train_dflash,
)
from hf_specdec.training.distillation_data import build_distillation_data
from hf_specdec.training.labels import spread_sample, token_targets, window_positions, window_starts
from hf_specdec.training.shards import load_distillation_data


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    """A 4-layer target's greedy answers with the states of the head's default layers (1, 2, 3)."""
    model = tiny_causal_lm("llama", vocab_size=64, hidden_size=32, num_layers=4, seed=3)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 64, (int(torch.randint(4, 10, (1,), generator=gen)),), generator=gen).tolist()
               for _ in range(48)]  # fmt: skip
    folder = tmp_path_factory.mktemp("data")
    build_distillation_data(model, prompts, folder, max_new_tokens=24, batch_size=16, shard_size=24,
                            hidden_dtype=torch.float32, aux_layers=default_feature_layers(4), progress=False)  # fmt: skip
    return model, load_distillation_data(folder), prompts


def tau_of(model, head, prompts) -> float:
    ids, mask = left_pad(prompts)
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, return_dict_in_generate=True,
                         assistant=DFlashAssistant(head, top_k=3, num_nodes=12), tree_budget=False)  # fmt: skip
    assert_same_tokens(out.sequences, expected, "trained DFlash head")
    return float(out.spec_stats.tau)


def test_block_targets_are_the_targets_choices(tiny_data):
    """Slot d of an anchor's block is labelled with the token the target chose d places after the anchor (greedy
    answers: the next answer tokens themselves)."""
    model, data, _ = tiny_data
    labels = token_targets(data, model.lm_head.weight.detach(), torch.arange(64))  # full vocabulary: index = id
    windows = window_starts(data, torch.arange(4), 32)
    t, valid = window_positions(data, windows, 32)
    anchors = draw_anchors(data, t, valid, 6, torch.Generator().manual_seed(0))
    pos, target = block_targets(data, labels, t, anchors, 3)
    known = target >= 0
    assert known.sum() > 20
    assert torch.equal(target[known], data.input_ids[pos[known]])  # greedy answers are the target's choices
    assert bool(data.answer_mask[pos[known]].all())


def test_spread_sample_shares_the_budget_over_every_sequence():
    """Each sequence gets an equal share, a short one gives what it cannot use to the others, and inside a sequence
    the picks are evenly spaced and include both ends; a budget that covers everything takes everything."""
    seqs = [torch.arange(0, 100), torch.arange(200, 203), torch.arange(300, 340), torch.arange(400, 400)]
    picked = spread_sample(seqs, 30)
    assert [int(p.numel()) for p in picked] == [14, 3, 13, 0]
    assert sum(int(p.numel()) for p in picked) == 30
    for whole, part in zip(seqs[:3], picked[:3]):
        assert bool(torch.isin(part, whole).all()) and part.unique().numel() == part.numel()
        assert int(part[0]) == int(whole[0]) and int(part[-1]) == int(whole[-1])
    assert [p.tolist() for p in spread_sample(seqs, 143)] == [p.tolist() for p in seqs]
    assert [p.tolist() for p in spread_sample(seqs, None)] == [p.tolist() for p in seqs]


def test_capped_block_hits_score_every_sequence(tiny_data):
    """A capped held-out score reads anchors of every sequence (not the first few sequences' whole answers), and
    each anchor's hits are the ones the uncapped score gives it."""
    model, data, _ = tiny_data
    head = DFlashHead.for_model(model, 1, 3, aux_layers=list(default_feature_layers(4))).eval()
    seqs = torch.arange(12)
    all_anchors, all_hits = dflash_block_hits(head, data, seqs)
    anchors, hits = dflash_block_hits(head, data, seqs, max_positions=36)
    assert anchors.numel() == 36 < all_anchors.numel()
    owner = torch.searchsorted(data.seq_bounds[seqs, 0], anchors, right=True) - 1
    assert set(owner.tolist()) == set(range(12))
    where = torch.searchsorted(all_anchors, anchors)
    assert torch.equal(all_anchors[where], anchors) and torch.equal(all_hits[where], hits)


def test_training_lowers_the_loss_and_raises_acceptance(tiny_data, tmp_path):
    model, data, prompts = tiny_data
    cfg = DFlashTrainingConfig(block_size=4, window=32, anchors_per_window=8, positions_per_step=8, epochs=12,
                               lr=3e-3, warmup_steps=5, draft_vocab=0, eval_fraction=0.15, eval_every=0,
                               checkpoint_every=40)  # fmt: skip
    head, report = train_dflash(model, data, tmp_path / "run", cfg, progress=False)
    assert report["train_loss_last_steps"] < 0.7 * report["train_loss_first_steps"], report
    before, after = report["held_out_before"], report["held_out"]
    assert after["positions"] > 50 and after["chain_tau"] > before["chain_tau"] + 0.2, (before, after)
    saved = DFlashHead.from_pretrained(tmp_path / "run" / "head", base_model=model)
    assert saved.feature_layers == (1, 2, 3) and saved.block_size == 4
    untrained = DFlashHead.for_model(model, block_size=4).eval()
    held_out = [prompts[i] for i in range(0, 48, 6)]
    assert tau_of(model, saved, held_out) > tau_of(model, untrained, held_out) + 0.3


def test_resume_continues_from_the_checkpoint(tiny_data, tmp_path):
    model, data, _ = tiny_data
    cfg = DFlashTrainingConfig(block_size=4, window=32, positions_per_step=8, max_steps=6, eval_every=0,
                               checkpoint_every=3, draft_vocab=40)  # fmt: skip
    train_dflash(model, data, tmp_path / "run", cfg, progress=False)
    with pytest.raises(FileExistsError, match="resume=True"):
        train_dflash(model, data, tmp_path / "run", cfg, progress=False)
    longer = DFlashTrainingConfig(**{**cfg.__dict__, "max_steps": 9})
    head, report = train_dflash(model, data, tmp_path / "run", longer, resume=True, progress=False)
    assert report["steps"] == 9 and head.draft_vocab_size == 40


def test_on_path_changes_nothing_on_self_distilled_data(tiny_data, tmp_path):
    """Greedy answers are the target's own path everywhere, so ``on_path`` trains the same weights; a checkpoint
    written before the setting existed resumes as ``on_path=False``, and not as True."""
    model, data, _ = tiny_data
    cfg = DFlashTrainingConfig(block_size=4, window=32, positions_per_step=8, max_steps=4, eval_every=0,
                               checkpoint_every=2, draft_vocab=40, eval_fraction=0.15)  # fmt: skip
    plain, _ = train_dflash(model, data, tmp_path / "plain", cfg, progress=False)
    on_path, report = train_dflash(model, data, tmp_path / "on", DFlashTrainingConfig(**{**cfg.__dict__, "on_path": True}),
                                   progress=False)  # fmt: skip
    assert report["config"]["on_path"] and "on the target path" in on_path.model_card["notes"]
    assert all(torch.equal(v, on_path.state_dict()[k]) for k, v in plain.state_dict().items())
    ckpt = sorted((tmp_path / "plain" / "checkpoints").glob("*.pt"))[-1]
    state = torch.load(ckpt, weights_only=True)
    del state["config"]["on_path"]  # as a run of an older version saved it
    torch.save(state, ckpt)
    longer = DFlashTrainingConfig(**{**cfg.__dict__, "max_steps": 6})
    with pytest.raises(ValueError, match="on_path=False, now on_path=True"):  # the old checkpoint, read as False
        train_dflash(model, data, tmp_path / "plain", DFlashTrainingConfig(**{**longer.__dict__, "on_path": True}),
                     resume=True, progress=False)  # fmt: skip
    assert train_dflash(model, data, tmp_path / "plain", longer, resume=True, progress=False)[1]["steps"] == 6


def test_cli_trains_a_dflash_head_on_a_data_folder(tiny_data, tmp_path, monkeypatch, capsys):
    """``hf-specdec train dflash`` takes the trainers' shared options and its own, and trains with them."""
    from hf_specdec.cli import build_parser, main
    from hf_specdec.training import eagle_cli

    model, data, _ = tiny_data
    args = build_parser().parse_args(["train", "dflash", "--out", "x", "--block-size", "4", "--no-soft-labels"])
    assert args.trainer is eagle_cli.DFLASH_COMMAND and (args.block_size, args.soft_labels, args.window) == (4, False, 256)
    assert build_parser().parse_args(["train", "dflash", "--out", "x"]).soft_labels
    assert not args.on_path and build_parser().parse_args(["train", "dflash", "--out", "x", "--on-path"]).on_path
    monkeypatch.setattr(eagle_cli, "_target", lambda args: (model, None))  # the tiny target, no tokenizer needed
    out = tmp_path / "run"
    assert main(["train", "dflash", "--out", str(out), "--data", str(data.folder), "--block-size", "4", "--window",
                 "32", "--max-steps", "2", "--draft-vocab", "40", "--anchors-per-window", "4", "--decay", "2",
                 "--init-layer", "-1"]) == 0  # fmt: skip
    report = json.loads((out / "training_report.json").read_text())
    assert report["steps"] == 2 and report["draft_vocab"] == 40
    cfg = report["config"]
    assert (cfg["block_size"], cfg["anchors_per_window"], cfg["decay"], cfg["soft_labels"]) == (4, 4, 2, True)
    assert cfg["init_layer"] == -1
    head = DFlashHead.from_pretrained(out / "head", base_model=model)
    assert head.block_size == 4 and head.feature_layers == (1, 2, 3)
    assert f"DFlash head saved to {out / 'head'}" in capsys.readouterr().out


def test_draft_layers_start_as_the_targets_layers(tiny_data):
    """``init_layer`` copies the target's decoder layers into the draft layers (the Llama target has no q / k norms:
    those stay ones), and a layer past the target's last, or a layer of another shape, is refused by name."""
    model, _, _ = tiny_data
    head = DFlashHead.for_model(model, num_layers=2, block_size=4)
    assert head.copy_target_layers(model, -2) == [2, 3]
    for draft, index in zip(head.layers, (2, 3)):
        target = model.model.layers[index]
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                     "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm"):  # fmt: skip
            assert torch.equal(draft.get_submodule(name).weight, target.get_submodule(name).weight), name
        assert torch.equal(draft.self_attn.q_norm.weight, torch.ones_like(draft.self_attn.q_norm.weight))
    with pytest.raises(ValueError, match="target layer 3: the target has 4 decoder layers"):
        head.copy_target_layers(model, 3)
    wider = tiny_causal_lm("llama", vocab_size=64, hidden_size=32, num_layers=4, seed=3, intermediate_size=96)
    with pytest.raises(ValueError, match="mlp.gate_proj.weight"):
        head.copy_target_layers(wider, 0)
    before = {k: v.clone() for k, v in head.state_dict().items()}
    renamed = tiny_causal_lm("llama", vocab_size=64, hidden_size=32, num_layers=4, seed=4)
    renamed.model.blocks = renamed.model.layers  # a decoder that keeps its layers under another name
    del renamed.model.layers
    with pytest.raises(ValueError, match=r"keeps no list of decoder layers at get_decoder\(\)\.layers"):
        head.copy_target_layers(renamed, 0)
    assert all(torch.equal(v, head.state_dict()[k]) for k, v in before.items())  # nothing copied


def test_fine_tuning_starts_from_the_given_head_and_leaves_it_as_it_is(tiny_data, tmp_path):
    """``init_head``: the run starts from the head's weights (held-out scores before training are the head's own),
    keeps its draft vocabulary, and the passed head is left untouched; a head of another shape is refused."""
    from hf_specdec.training.dflash import evaluate_dflash

    model, data, _ = tiny_data
    cfg = DFlashTrainingConfig(block_size=4, window=32, anchors_per_window=8, positions_per_step=8, max_steps=30,
                               lr=3e-3, warmup_steps=3, draft_vocab=40, eval_fraction=0.15, eval_every=0,
                               checkpoint_every=0)  # fmt: skip
    first, report = train_dflash(model, data, tmp_path / "first", cfg, progress=False)
    first = first.bind(model)
    kept = {k: v.clone() for k, v in first.state_dict().items()}
    tuned, again = train_dflash(model, data, tmp_path / "again", DFlashTrainingConfig(**{**cfg.__dict__, "lr": 1e-3}),
                                progress=False, init_head=first)  # fmt: skip
    assert again["held_out_before"] == report["held_out"]  # it started where the first run ended
    assert all(torch.equal(v, first.state_dict()[k]) for k, v in kept.items())  # the passed head untouched
    assert torch.equal(tuned.d2t, first.d2t) and again["draft_vocab"] == 40
    assert not torch.equal(tuned.fc.weight, first.fc.weight)  # and it trained
    held = evaluate_dflash(tuned.bind(model), data, torch.arange(data.seq_bounds.shape[0]), 256)
    assert held["positions"] > 0
    assert "fine-tuned" in tuned.model_card["notes"]
    for bad, match in ((dict(num_layers=2), "draft layer"), (dict(draft_vocab=32), "drafts over 40"),
                       (dict(block_size=3), "block_size=4"), (dict(init_layer=-1), "one or the other")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            train_dflash(model, data, tmp_path / f"bad{len(match)}", DFlashTrainingConfig(**{**cfg.__dict__, **bad}),
                         progress=False, init_head=first)  # fmt: skip


def test_cli_fine_tunes_the_shipped_or_a_saved_head(tiny_data, tmp_path, monkeypatch):
    """``train dflash --init-head FOLDER`` fine-tunes that head; ``shipped`` names the package's DFlash head; a folder
    without a head is refused before any model loads."""
    from hf_specdec.cli import build_parser, main
    from hf_specdec.models import SHIPPED_HEAD_DIRS
    from hf_specdec.training import eagle_cli

    model, data, _ = tiny_data
    args = build_parser().parse_args(["train", "dflash", "--out", "x", "--init-head", "shipped"])
    eagle_cli.check_train_dflash_arguments(args)
    assert args.init_head == str(SHIPPED_HEAD_DIRS["dflash"])
    monkeypatch.setattr(eagle_cli, "_target", lambda args: (model, None))
    common = ["--data", str(data.folder), "--block-size", "4", "--window", "32", "--max-steps", "2",
              "--draft-vocab", "40", "--anchors-per-window", "4"]  # fmt: skip
    assert main(["train", "dflash", "--out", str(tmp_path / "a"), *common]) == 0
    assert main(["train", "dflash", "--out", str(tmp_path / "b"), *common, "--init-head", str(tmp_path / "a" / "head")]) == 0
    report = json.loads((tmp_path / "b" / "training_report.json").read_text())
    first = json.loads((tmp_path / "a" / "training_report.json").read_text())
    assert report["held_out_before"] == first["held_out"]
    with pytest.raises(SystemExit) as exit_:
        main(["train", "dflash", "--out", str(tmp_path / "c"), "--init-head", str(tmp_path)])
    assert exit_.value.code == 2 and not (tmp_path / "c").exists()
