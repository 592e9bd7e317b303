"""Online training: the states a step reads are computed by the target at that step (`OnlineTeacherForcing`), and
they are the ones stored teacher-forced data hold, so an EAGLE head trained online equals one trained on stored data
(same steps, same labels, same held-out scores), for EAGLE-1 and for EAGLE-3's unrolled steps past a window's end."""

from __future__ import annotations

import json

import pytest
import torch

from hf_specdec.heads.eagle import eagle3_feature_layers
from hf_specdec.training.chat_template import templated_ids
from hf_specdec.training.eagle import EagleTrainingConfig, train_eagle
from hf_specdec.training.labels import token_targets, window_positions, window_starts
from hf_specdec.training.online_states import OnlineTeacherForcing
from hf_specdec.training.run import data_description
from hf_specdec.training.shards import load_distillation_data
from hf_specdec.training.teacher_forced import build_teacher_forced_data


@pytest.fixture(scope="module")
def conversations(word_chat, word_conversations):
    """The tiny target, its chat tokenizer and 24 two-turn conversations (a stand-in for ShareGPT)."""
    model, tok = word_chat
    return model, tok, word_conversations(24, ((3, 5), (6, 7), (2, 3), (5, 6)))


@pytest.fixture(scope="module")
def setup(conversations, tmp_path_factory):
    """The conversations templated, their stored teacher-forced data (float32 states) and the same online."""
    model, tok, source = conversations
    seqs = [templated_ids(tok, c) for c in source.train]
    aux = eagle3_feature_layers(model)  # EAGLE-3's layers, so that both versions train on these data
    folder = tmp_path_factory.mktemp("stored")
    build_teacher_forced_data(model, seqs, folder, shard_size=8, tokens_per_batch=128, hidden_dtype=torch.float32,
                              aux_layers=aux, progress=False)  # fmt: skip
    online = OnlineTeacherForcing.of(model, seqs, aux_layers=aux, tokens_per_batch=100)
    return model, seqs, load_distillation_data(folder), online


def test_the_ids_and_masks_are_the_stored_datas(setup):
    _, _, stored, online = setup
    tokens = online.tokens
    assert torch.equal(tokens.input_ids, stored.input_ids) and torch.equal(tokens.seq_bounds, stored.seq_bounds)
    assert torch.equal(tokens.answer_mask, stored.answer_mask) and tokens.hidden.shape == (stored.hidden.shape[0], 0)
    assert online.computed_tokens == 0  # nothing runs the target until a step asks


@pytest.mark.parametrize("lookahead", [1, 3])
def test_a_windows_states_and_labels_are_the_stored_ones(setup, lookahead):
    """Every pair a window reads (states, aux states, tokens, the next state) and its label equal the stored data's,
    also the last pairs of a window that ends inside its sequence, whose labels lie ``lookahead`` tokens on."""
    model, _, stored, online = setup
    windows = window_starts(stored, torch.arange(stored.seq_bounds.shape[0]), 8)  # [Wn, 2]
    assert (windows[:, 1] < stored.seq_end[windows[:, 0]] - 1).any()  # some windows end inside their sequence
    lm_weight = model.lm_head.weight.detach()
    vocab = torch.arange(64)
    labels = token_targets(stored, lm_weight, vocab)
    before = online.computed_tokens
    part, moved = online.window_data(windows, lookahead)
    assert online.computed_tokens - before == part.input_ids.numel() <= sum(
        int(e) + 1 + lookahead - int(stored.seq_start[s]) for s, e in windows.tolist()
    )
    part_labels = token_targets(part, lm_weight, vocab)
    t, valid = window_positions(stored, windows, 8)
    u, valid_u = window_positions(part, moved, 8)
    assert torch.equal(valid, valid_u)
    for a, b in ((t, u), (t + 1, u + 1)):
        torch.testing.assert_close(part.hidden[b][valid_u], stored.hidden[a][valid], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(part.aux_hidden[b][valid_u], stored.aux_hidden[a][valid], atol=1e-5, rtol=1e-5)
        assert torch.equal(part.input_ids[b][valid_u], stored.input_ids[a][valid])
    for j in range(lookahead):  # the labels of the pairs and of the unrolled steps past them, and which exist
        here = valid & (t + j + 1 < stored.seq_end[t])
        assert torch.equal(here, valid_u & (u + j + 1 < part.seq_end[u]))
        at_t, at_u = (t + j).clamp(max=labels.numel() - 1), (u + j).clamp(max=part_labels.numel() - 1)
        assert torch.equal(part_labels[at_u][here], labels[at_t][here])


@pytest.mark.parametrize("version", [1, 3])
def test_training_online_equals_training_on_stored_data(setup, tmp_path, version):
    model, _, stored, online = setup
    cfg = dict(window=8, positions_per_step=4, max_steps=6, epochs=1.0, lr=3e-3, warmup_steps=2, draft_vocab=0,
               eval_fraction=0.2, eval_every=3, checkpoint_every=0, version=version, noise=0.0)  # fmt: skip
    head_a, report_a = train_eagle(model, stored, tmp_path / "stored", EagleTrainingConfig(**cfg), progress=False)
    head_b, report_b = train_eagle(model, online, tmp_path / "online", EagleTrainingConfig(**cfg), progress=False)
    for (name, a), b in zip(head_a.state_dict().items(), head_b.state_dict().values()):
        torch.testing.assert_close(b, a, atol=2e-5, rtol=1e-4, msg=name)
    assert [h["top1"] for h in report_b["history"]] == [h["top1"] for h in report_a["history"]]
    assert report_b["train_loss_last_steps"] == pytest.approx(report_a["train_loss_last_steps"], rel=1e-4)
    assert report_b["online"] is True and report_b["target_forward_tokens"] > 0
    assert "teacher-forced through the target while the head trained (online)" in report_b["training_data"]
    assert report_b["num_tokens"] == report_a["num_tokens"] == stored.input_ids.numel()


def test_the_draft_vocabulary_counts_the_texts_answer_tokens(setup, tmp_path):
    """Online, no pass over all the data gives the target's choices up front: the draft vocabulary is the text's most
    frequent answer tokens (the head still trains on the target's labels, outside it ignored)."""
    model, _, stored, online = setup
    cfg = EagleTrainingConfig(window=8, positions_per_step=4, max_steps=1, draft_vocab=12, eval_fraction=0.2,
                              checkpoint_every=0)  # fmt: skip
    head, report = train_eagle(model, online, tmp_path / "online", cfg, progress=False)
    from hf_specdec.training.labels import draft_vocabulary, head_positions
    from hf_specdec.training.run import split_sequences

    train_seqs, _ = split_sequences(online.tokens, 0.2, 0)
    expected, coverage = draft_vocabulary(online.tokens, head_positions(online.tokens, train_seqs), 12)
    assert torch.equal(head.draft_to_token(torch.arange(12)), expected)
    assert report["draft_vocab_answer_coverage"] == round(coverage, 4)
    nxt = online.tokens.next_tokens()
    answer = online.tokens.answer_mask[1:]
    assert torch.equal(nxt[:-1][answer & (nxt[:-1] >= 0)], online.tokens.input_ids[1:][answer & (nxt[:-1] >= 0)])


def test_a_target_in_training_mode_is_refused_and_left_as_it_is(conversations):
    model, tok, source = conversations
    seqs = [templated_ids(tok, c) for c in source.train[:2]]
    model.train()
    try:
        with pytest.raises(ValueError, match="eval mode"):
            OnlineTeacherForcing.of(model, seqs)
        assert model.training
    finally:
        model.eval()
    with pytest.raises(ValueError, match="no sequences"):
        OnlineTeacherForcing.of(model, [])


def test_first_tokens_and_the_description(setup):
    _, seqs, _, online = setup
    budget = sum(len(s.ids) for s in seqs[:5])
    first = online.first_tokens(budget)
    assert first.tokens.seq_bounds.shape[0] == 5 and first.tokens.input_ids.numel() == budget
    text = data_description(first.tokens.manifest)
    assert "24 of 24 planned conversations" in text  # the manifest of the whole source: first_tokens records its cut
    assert first.tokens.manifest["first_sequences"] == 5


def test_cli_trains_online_on_sharegpt(conversations, tmp_path, monkeypatch):
    """``train eagle --data sharegpt --online`` trains on the conversations ``--data sharegpt`` would build, with
    nothing written but the head and its report; ``--data-tokens`` cuts them."""
    from hf_specdec.cli import main
    from hf_specdec.training import conversation_data, eagle_cli

    model, tok, source = conversations
    seqs = [templated_ids(tok, c) for c in conversation_data.pick_conversations(source, 24, seed=0)]  # CLI's order
    monkeypatch.setattr(conversation_data, "load_sharegpt", lambda: source)
    monkeypatch.setattr(eagle_cli, "_target", lambda args: (model, tok))
    out = tmp_path / "run"
    budget = sum(len(s.ids) for s in seqs[:12])
    assert main(["train", "eagle", "--out", str(out), "--data", "sharegpt", "--online", "--conversations", "24",
                 "--data-tokens", str(budget), "--window", "8", "--max-steps", "3", "--draft-vocab", "0",
                 "--no-tune-tree"]) == 0  # fmt: skip
    report = json.loads((out / "training_report.json").read_text())
    assert report["online"] is True and (report["num_tokens"], report["num_sequences"]) == (budget, 12)
    assert sorted(p.name for p in out.iterdir()) == ["checkpoints", "head", "training_report.json"]  # no data folder


# ---------------------------------------------------------------------------------------------------- DFlash
@pytest.fixture(scope="module")
def dflash_setup(conversations, tmp_path_factory):
    """The conversations' stored teacher-forced data with the DFlash head's layers, and the same online."""
    from hf_specdec.heads.dflash import default_feature_layers

    model, tok, source = conversations
    seqs = [templated_ids(tok, c) for c in source.train]
    layers = default_feature_layers(model.config.num_hidden_layers)
    folder = tmp_path_factory.mktemp("stored_dflash")
    build_teacher_forced_data(model, seqs, folder, shard_size=8, tokens_per_batch=128, hidden_dtype=torch.float32,
                              aux_layers=layers, progress=False)  # fmt: skip
    online = OnlineTeacherForcing.of(model, seqs, aux_layers=layers, tokens_per_batch=100)
    return model, seqs, load_distillation_data(folder), online


@pytest.mark.parametrize("soft_labels", [True, False])
def test_dflash_trained_online_equals_dflash_trained_on_stored_data(dflash_setup, tmp_path, soft_labels):
    """A block reads the labels and (soft targets) the target's states up to D tokens past its window's end: online
    the step's prefixes hold them, so the same anchors get the same targets and the head the same weights."""
    from hf_specdec.training.dflash import DFlashTrainingConfig, train_dflash

    model, _, stored, online = dflash_setup
    cfg = dict(window=8, anchors_per_window=3, block_size=4, positions_per_step=4, max_steps=6, epochs=1.0, lr=3e-3,
               warmup_steps=2, draft_vocab=0, eval_fraction=0.2, eval_every=3, checkpoint_every=0,
               soft_labels=soft_labels)  # fmt: skip
    head_a, report_a = train_dflash(model, stored, tmp_path / "stored", DFlashTrainingConfig(**cfg), progress=False)
    head_b, report_b = train_dflash(model, online, tmp_path / "online", DFlashTrainingConfig(**cfg), progress=False)
    assert head_b.feature_layers == head_a.feature_layers == tuple(stored.aux_layers)
    for (name, a), b in zip(head_a.state_dict().items(), head_b.state_dict().values()):
        torch.testing.assert_close(b, a, atol=2e-5, rtol=1e-4, msg=name)
    assert [h["per_depth"] for h in report_b["history"]] == [h["per_depth"] for h in report_a["history"]]
    assert report_a["held_out"]["positions"] > 0
    assert report_b["train_loss_last_steps"] == pytest.approx(report_a["train_loss_last_steps"], rel=1e-4)
    assert report_b["online"] is True and report_b["target_forward_tokens"] > 0 and "online" not in report_a


def test_dflash_online_without_the_heads_layers_is_refused(conversations, tmp_path):
    """Online data computing only the final states cannot train a DFlash head: refused before any step, naming the
    layers to compute."""
    from hf_specdec.training.dflash import DFlashTrainingConfig, train_dflash

    model, tok, source = conversations
    online = OnlineTeacherForcing.of(model, [templated_ids(tok, c) for c in source.train[:6]])
    with pytest.raises(ValueError, match="aux_layers="):
        train_dflash(model, online, tmp_path / "x", DFlashTrainingConfig(window=8, block_size=4, max_steps=1,
                                                                         draft_vocab=0), progress=False)  # fmt: skip


def test_cli_trains_dflash_online_on_sharegpt(conversations, tmp_path, monkeypatch):
    """``train dflash --data sharegpt --online``: the same conversations, nothing written but the head and its
    report, the head reading the layers the online data computed."""
    from hf_specdec.cli import main
    from hf_specdec.heads.dflash import DFlashHead, default_feature_layers
    from hf_specdec.training import conversation_data, eagle_cli

    model, tok, source = conversations
    monkeypatch.setattr(conversation_data, "load_sharegpt", lambda: source)
    monkeypatch.setattr(eagle_cli, "_target", lambda args: (model, tok))
    out = tmp_path / "run"
    assert main(["train", "dflash", "--out", str(out), "--data", "sharegpt", "--online", "--conversations", "24",
                 "--window", "8", "--block-size", "4", "--anchors-per-window", "2", "--max-steps", "3",
                 "--draft-vocab", "0"]) == 0  # fmt: skip
    report = json.loads((out / "training_report.json").read_text())
    assert report["online"] is True and report["num_sequences"] == 24
    assert sorted(p.name for p in out.iterdir()) == ["checkpoints", "head", "training_report.json"]  # no data folder
    head = DFlashHead.from_pretrained(out / "head")
    assert list(head.feature_layers) == default_feature_layers(model.config.num_hidden_layers)
