"""Data from fixed conversations: teacher forcing stores the target's own states and arg-max next tokens (the labels
every trainer reads), re-runs keep the fingerprint, an interrupted build resumes, and the self-distilled builder over
the same conversations answers with the target."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch

import hf_specdec.training.teacher_forced as tf
from hf_specdec.training.chat_template import templated_ids
from hf_specdec.training.conversation_data import build_conversation_data
from hf_specdec.training.labels import IGNORE, head_positions, medusa_labels, token_targets
from hf_specdec.training.run import held_out_split
from hf_specdec.training.shards import load_distillation_data


@pytest.fixture(scope="module")
def setup(word_chat, word_conversations):
    model, tok = word_chat
    return model, tok, word_conversations(10, ((3, 4), (4, 5), (2, 3), (3, 6)))


def _build(model, seqs, folder, **kw):
    return tf.build_teacher_forced_data(model, seqs, folder, shard_size=4, tokens_per_batch=64,
                                        hidden_dtype=torch.float32, progress=False, **kw)  # fmt: skip


def test_labels_are_the_targets_own_argmax(setup, tmp_path):
    model, tok, source = setup
    seqs = [templated_ids(tok, c) for c in source.train]
    _build(model, seqs, tmp_path, aux_layers=(1, 2))
    data = load_distillation_data(tmp_path)
    assert data.aux_layers == (1, 2) and data.aux_hidden.shape[1] == 2 * 32
    for i, seq in enumerate(seqs):
        s, a, e = data.seq_bounds[i].tolist()
        assert data.input_ids[s:e].tolist() == seq.ids and a - s == seq.first_answer
        assert data.answer_mask[s:e].tolist() == seq.answer_mask
        with torch.no_grad():
            out = model(torch.tensor([seq.ids]), output_hidden_states=True)
        assert data.target_next[s:e].tolist() == out.logits[0].argmax(-1).tolist()
        torch.testing.assert_close(data.hidden[s:e], out.hidden_states[-1][0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(data.aux_hidden[s:e, 32:], out.hidden_states[2][0], atol=1e-4, rtol=1e-4)
    # every trainer reads those labels: EAGLE's first token, Medusa's heads / the speculator's stages
    vocab = torch.arange(64)
    labels = token_targets(data, model.lm_head.weight.detach(), vocab)
    pos = head_positions(data, torch.arange(len(seqs)))
    assert data.answer_mask[pos + 2].all()
    assert torch.equal(labels[pos], data.target_next[pos + 1])
    heads = medusa_labels(data, pos, 2)
    ok = heads[1] != IGNORE
    assert torch.equal(heads[1][ok], data.target_next[pos[ok] + 2])


def _on_path_oracle(data, t: int, k: int) -> int:
    """Head k's label at position t, one position at a time: the target's choice after t + k + 1 where every token
    between (t + 1 .. t + k + 1) is given text or the target's own choice, else IGNORE."""
    end = int(data.seq_end[t])
    if t + k + 2 >= end or not data.answer_mask[t + k + 2]:
        return IGNORE
    for j in range(t + 1, t + k + 2):
        if data.answer_mask[j] and int(data.input_ids[j]) != int(data.target_next[j - 1]):
            return IGNORE
    return int(data.target_next[t + k + 1])


def _mostly_agreeing_data(setup, folder, seed: int):
    """``(model, seqs, data)``: the conversations teacher-forced into ``folder``, with ~70% of the target's choices
    made the text's own next token (a random tiny model rarely agrees with the text), so both on- and off-path
    positions occur."""
    model, tok, source = setup
    seqs = [templated_ids(tok, c) for c in source.train]
    _build(model, seqs, folder)
    data = load_distillation_data(folder)
    agree = torch.rand(data.input_ids.numel(), generator=torch.Generator().manual_seed(seed)) < 0.7
    target_next = data.target_next.clone()
    target_next[:-1] = torch.where(agree[:-1], data.input_ids[1:], target_next[:-1])
    return model, seqs, dataclasses.replace(data, target_next=target_next)


def test_multi_token_heads_learn_only_along_the_targets_own_path(setup, tmp_path):
    """Teacher-forced answers are someone else's text: Medusa's heads and the speculator's stages guess several
    tokens past t, so a label counts only where the text between is what the target would have written."""
    model, seqs, data = _mostly_agreeing_data(setup, tmp_path, seed=1)
    pos = head_positions(data, torch.arange(len(seqs)))
    labels = medusa_labels(data, pos, 3)
    expect = torch.tensor([[_on_path_oracle(data, int(t), k) for t in pos] for k in range(3)])
    assert torch.equal(labels, expect)
    assert (labels[2] != IGNORE).any() and (labels[0] == IGNORE).any()  # both kinds of position occur
    kept = held_out_split(data, 0.0, 10**6, 0, on_path=True).train_pos
    assert torch.equal(kept, pos[data.on_target_path()[pos]])  # positions whose every label is ignored are dropped


def _block_oracle(data, base: int, d: int, on_path: bool) -> int:
    """A DFlash block's label at depth d after the anchor ``base``, one position at a time: the target's choice at
    base + d, where every token between (base + 1 .. base + d - 1) is given text or the target's own choice when
    ``on_path``, else IGNORE."""
    p = base + d
    if p >= int(data.seq_end[base]) or not data.answer_mask[p]:
        return IGNORE
    for j in range(base + 1, p):
        if on_path and data.answer_mask[j] and int(data.input_ids[j]) != int(data.target_next[j - 1]):
            return IGNORE
    return int(data.target_next[p - 1])


def test_dflash_blocks_learn_deeper_depths_only_along_the_targets_own_path(setup, tmp_path):
    """A block's depth d guesses past d - 1 tokens it never sees: with ``on_path`` its label counts only where the
    text between is what the target would have written; without, every answer position is labelled."""
    from hf_specdec.training.dflash import block_targets, draw_anchors
    from hf_specdec.training.labels import window_positions, window_starts

    model, seqs, data = _mostly_agreeing_data(setup, tmp_path, seed=2)
    labels = token_targets(data, model.lm_head.weight.detach(), torch.arange(64))  # full vocabulary: index = id
    t, valid = window_positions(data, window_starts(data, torch.arange(len(seqs)), 64), 64)
    anchors = draw_anchors(data, t, valid, 64, torch.Generator().manual_seed(0))
    base = t.gather(1, anchors.clamp(min=0))
    kept = {}
    for on_path in (False, True):
        _, target = block_targets(data, labels, t, anchors, 4, on_path=on_path)  # [B, A, 4]
        expect = torch.tensor([[[_block_oracle(data, int(b), d, on_path) if a >= 0 else IGNORE for d in (1, 2, 3, 4)]
                                for a, b in zip(row_a, row_b)] for row_a, row_b in zip(anchors, base)])  # fmt: skip
        assert torch.equal(target, expect), on_path
        kept[on_path] = target != IGNORE
    assert torch.equal(kept[True][..., 0], kept[False][..., 0])  # depth 1 has no token between
    assert bool((kept[True] <= kept[False]).all()) and kept[True][..., 3].sum() < kept[False][..., 3].sum()
    assert kept[True][..., 3].any()


def test_rerun_keeps_the_fingerprint_and_resumes(setup, tmp_path, monkeypatch):
    model, tok, source = setup
    seqs = [templated_ids(tok, c) for c in source.train]
    clean = _build(model, seqs, tmp_path / "clean")
    assert _build(model, seqs, tmp_path / "clean")["fingerprint"] == clean["fingerprint"]
    calls = {"n": 0}
    real = tf.write_shard

    def interrupted(*args, **kwargs):  # stopped while the second shard is built
        calls["n"] += 1
        if calls["n"] > 1:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(tf, "write_shard", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _build(model, seqs, tmp_path / "cut")
    partial = json.loads((tmp_path / "cut" / "manifest.json").read_text())
    assert 0 < len(partial["shards"]) < len(clean["shards"]) and not partial["complete"]
    monkeypatch.setattr(tf, "write_shard", real)
    resumed = _build(model, seqs, tmp_path / "cut")
    assert resumed["fingerprint"] == clean["fingerprint"] and resumed["complete"]
    a, b = load_distillation_data(tmp_path / "clean"), load_distillation_data(tmp_path / "cut")
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.target_next, b.target_next)
    torch.testing.assert_close(a.hidden, b.hidden)
    with pytest.raises(ValueError, match="other prompts or generation settings"):
        _build(model, seqs[:-1], tmp_path / "clean")


def test_both_builders_over_conversations(setup, tmp_path):
    model, tok, source = setup
    fixed = build_conversation_data(model, tok, tmp_path, mode="fixed", num_conversations=6, source=source,
                                    progress=False, shard_size=4)  # fmt: skip
    own = build_conversation_data(model, tok, tmp_path, mode="self", num_conversations=6, source=source, turns=2,
                                  max_new_tokens=6, batch_size=4, progress=False)  # fmt: skip
    assert [f.name for f in fixed] == ["fixed"] and [f.name for f in own] == ["self", "self-turn2"]
    data = load_distillation_data(own)
    assert data.target_next is None and data.manifest["num_sequences"] == 12
    # the second turn's prompt holds the target's own first answer
    first = load_distillation_data(own[0])
    s, a, e = first.seq_bounds[0].tolist()
    answer = tok.decode(first.input_ids[a:e].tolist(), skip_special_tokens=True).strip()
    second = load_distillation_data(own[1])
    prompts = [tok.decode(second.input_ids[s:a].tolist()) for s, a, _ in second.seq_bounds.tolist()]
    assert answer and any(answer in p for p in prompts)
    mixed = load_distillation_data(fixed + own)  # teacher-forced and self-distilled data train together
    assert mixed.target_next is not None and (mixed.next_tokens()[: fixed_len(fixed)] >= 0).all()


def fixed_len(folders) -> int:
    return load_distillation_data(folders).input_ids.numel() - 1


def test_a_bf16_build_is_other_data_and_an_fp32_one_keeps_its_fingerprint(setup, tmp_path):
    """A build by a bfloat16 target records its dtype and gets a fingerprint of its own, so the float32 target does
    not resume it as its own; float32 builds keep the fingerprint they always had (no dtype in their settings)."""
    model, tok, source = setup
    seqs = [templated_ids(tok, c) for c in source.train]
    fp32 = _build(model, seqs, tmp_path / "fp32")
    assert "target_dtype" not in fp32
    bf16 = _build(copy.deepcopy(model).to(torch.bfloat16), seqs, tmp_path / "bf16")
    assert bf16["target_dtype"] == "bfloat16" and bf16["fingerprint"] != fp32["fingerprint"]
    with pytest.raises(ValueError, match="other prompts or generation settings"):
        _build(model, seqs, tmp_path / "bf16")
    data = load_distillation_data(tmp_path / "bf16")
    assert torch.equal(data.input_ids, load_distillation_data(tmp_path / "fp32").input_ids)


def test_a_larger_build_keeps_the_smaller_builds_full_shards(setup, tmp_path, monkeypatch):
    """More conversations over a folder holding a build of their first ones (``--conversations`` raised) keep that
    build's full shards and teacher-force only the rest (its last, partial shard is rebuilt full); the result is
    the larger build made from scratch. A build of other conversations or settings is still refused."""
    model, tok, source = setup
    seqs = [templated_ids(tok, c) for c in source.train]
    assert len(seqs) > 6
    fresh = _build(model, seqs, tmp_path / "fresh")
    small = _build(model, seqs[:6], tmp_path / "grown")  # shards of 4 and 2
    first_shard = tmp_path / "grown" / small["shards"][0]["file"]
    written = first_shard.stat().st_mtime_ns
    forced = []
    real = tf.teacher_forced_states

    def counting(model, batch, aux_layers=()):
        forced.extend(batch)
        return real(model, batch, aux_layers)

    monkeypatch.setattr(tf, "teacher_forced_states", counting)
    grown = _build(model, seqs, tmp_path / "grown")
    assert sorted(map(tuple, forced)) == sorted(tuple(s.ids) for s in seqs[4:])  # the kept shard's 4 are not redone
    assert first_shard.stat().st_mtime_ns == written
    assert grown["fingerprint"] == fresh["fingerprint"] and grown["complete"]
    assert grown["grown_from"] == {"fingerprint": small["fingerprint"], "num_prompts": 6, "shards_kept": 1}
    a, b = load_distillation_data(tmp_path / "fresh"), load_distillation_data(tmp_path / "grown")
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.target_next, b.target_next)
    assert torch.equal(a.answer_mask, b.answer_mask) and torch.equal(a.seq_bounds, b.seq_bounds)
    torch.testing.assert_close(a.hidden, b.hidden)
    refused = [
        (model, seqs[1:7], {}),  # other conversations first
        (model, seqs, {"hidden_dtype": torch.float16}),  # other settings
        (copy.deepcopy(model).to(torch.bfloat16), seqs, {}),  # another target dtype
    ]
    for i, (target, more, kw) in enumerate(refused):
        folder = tmp_path / f"refused{i}"
        _build(model, seqs[:6] if i else seqs[:5], folder)
        with pytest.raises(ValueError, match="other prompts or generation settings"):
            tf.build_teacher_forced_data(target, more, folder, shard_size=4, tokens_per_batch=64, progress=False,
                                         **{"hidden_dtype": torch.float32, **kw})  # fmt: skip
