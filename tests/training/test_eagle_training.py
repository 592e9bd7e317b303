"""A short EAGLE training run on a tiny model lowers the loss and raises acceptance (held-out top-1 and the tau of a
real generate call), writes a loadable head, and resumes from its checkpoint."""

from __future__ import annotations

import dataclasses
import inspect
import json

import pytest
import torch

import hf_specdec  # noqa: F401  (routes generate(assistant=...))
import hf_specdec.generation.loop as loop
from hf_specdec.generation.proposers.eagle import EagleAssistant
from hf_specdec.heads.eagle import EagleHead
from hf_specdec.testing import assert_same_tokens, left_pad, tiny_causal_lm
from hf_specdec.training.distillation_data import build_distillation_data
from hf_specdec.training.eagle import EagleTrainingConfig, train_eagle, tune_eagle_tree
from hf_specdec.training.shards import load_distillation_data


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    model = tiny_causal_lm("llama", vocab_size=64, hidden_size=32, num_layers=2, seed=3)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 64, (int(torch.randint(4, 10, (1,), generator=gen)),), generator=gen).tolist()
               for _ in range(48)]  # fmt: skip
    folder = tmp_path_factory.mktemp("data")
    build_distillation_data(model, prompts, folder, max_new_tokens=24, batch_size=16, shard_size=24,
                            hidden_dtype=torch.float32, progress=False)  # fmt: skip
    return model, load_distillation_data(folder), prompts


# tau measures the head's own trees; the loop's tree budget (when it has one) sizes trees by the step cost, and on a
# tiny target, as cheap as the head, it rightly drafts nothing
FULL_TREES = {"tree_budget": False} if "tree_budget" in inspect.signature(loop.generate).parameters else {}


def tau_of(model, head, prompts) -> float:
    """tau of a greedy batch generate with ``head``, whose output must equal vanilla generate's."""
    ids, mask = left_pad(prompts)
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, return_dict_in_generate=True,
                         assistant=EagleAssistant(head, top_k=3, depth=3, num_nodes=8), **FULL_TREES)  # fmt: skip
    assert_same_tokens(out.sequences, expected, "trained EAGLE head")
    return float(out.spec_stats.tau)


@pytest.mark.parametrize("mixed_precision", ["no", "bf16"])
def test_training_lowers_the_loss_and_raises_acceptance(tiny_data, tmp_path, mixed_precision):
    model, data, prompts = tiny_data
    cfg = EagleTrainingConfig(window=32, positions_per_step=8, epochs=12, lr=3e-3, warmup_steps=5, draft_vocab=0,
                              eval_fraction=0.15, eval_every=0, checkpoint_every=40,
                              mixed_precision=mixed_precision)  # fmt: skip
    head, report = train_eagle(model, data, tmp_path / "run", cfg, progress=False)
    assert report["train_loss_last_steps"] < 0.7 * report["train_loss_first_steps"], report
    before, after = report["held_out_before"], report["held_out"]
    assert after["positions"] > 50
    assert after["top1"] > before["top1"] + 0.2, (before, after)
    saved = EagleHead.from_pretrained(tmp_path / "run" / "head", base_model=model)
    assert json.loads((tmp_path / "run" / "training_report.json").read_text())["steps"] == report["steps"]
    untrained = EagleHead.for_model(model).eval()
    held_out = [prompts[i] for i in range(0, 48, 6)]
    assert tau_of(model, saved, held_out) > tau_of(model, untrained, held_out) + 0.3


def test_resume_continues_from_the_checkpoint(tiny_data, tmp_path):
    model, data, _ = tiny_data
    cfg = EagleTrainingConfig(window=32, positions_per_step=8, max_steps=6, eval_every=0, checkpoint_every=3,
                              draft_vocab=40)  # fmt: skip
    train_eagle(model, data, tmp_path / "run", cfg, progress=False)
    with pytest.raises(FileExistsError, match="resume=True"):
        train_eagle(model, data, tmp_path / "run", cfg, progress=False)
    longer = EagleTrainingConfig(**{**cfg.__dict__, "max_steps": 9})
    head, report = train_eagle(model, data, tmp_path / "run", longer, resume=True, progress=False)
    assert report["steps"] == 9 and head.draft_vocab_size == 40


def test_tree_tuning_measures_the_step_cost_the_assistant_reads():
    model = tiny_causal_lm("llama", num_layers=2)
    head = EagleHead.for_model(model, draft_vocab=torch.arange(5, 60)).eval()
    tree = tune_eagle_tree(model, head, sizes=(4, 8), top_k=3, depth=3)
    assert tree["num_nodes"] == 8 and set(tree["step_cost"]) == {"4", "8"}
    assert all(c > 1.0 for c in tree["step_cost"].values())  # drafting and verifying cost more than a plain step
    assistant = EagleAssistant(head)
    assert (assistant.top_k, assistant.depth, assistant.num_nodes) == (3, 3, 8)
    assert assistant.step_cost == {n: float(c) for n, c in ((4, tree["step_cost"]["4"]), (8, tree["step_cost"]["8"]))}


def test_cli_trains_on_several_data_folders():
    from hf_specdec.cli import build_parser
    from hf_specdec.training.eagle_cli import EAGLE_COMMAND

    args = build_parser().parse_args(["train", "eagle", "--out", "x", "--data", "d1", "d2", "--draft-vocab", "4096"])
    assert args.data == ["d1", "d2"] and args.extra_data == [] and args.draft_vocab == 4096
    assert args.trainer is EAGLE_COMMAND and args.init_head is None
    args = build_parser().parse_args(["train", "eagle", "--out", "x", "--data-dir", "root", "--extra-data", "d3"])
    assert args.data is None and args.data_dir == "root" and args.extra_data == ["d3"] and not args.real_text
    assert build_parser().parse_args(["train", "eagle", "--out", "x", "--real-text"]).real_text
    args = build_parser().parse_args(["train", "eagle", "--out", "x", "--real-text-file", "t.json", "--data-only",
                                      "--device", "cuda", "--windows-per-step", "16"])  # fmt: skip
    assert (args.real_text_file, args.data_only, args.device, args.windows_per_step) == ("t.json", True, "cuda", 16)
    assert build_parser().parse_args(["train", "eagle", "--out", "x"]).version == 1
    args = build_parser().parse_args(["train", "eagle", "--out", "x", "--version", "3", "--unroll", "4"])
    assert (args.version, args.unroll) == (3, 4)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "eagle", "--out", "x", "--version", "2"])
    args = build_parser().parse_args(["train", "mlp-speculator", "--out", "x", "--device", "cuda"])
    assert args.device == "cuda"


def test_init_head_shipped_names_the_packaged_head(monkeypatch):
    """``--init-head shipped`` reaches the trainer as the shipped head's folder; the trainer loads what it names."""
    from hf_specdec.assistants import EAGLE
    from hf_specdec.cli import main
    from hf_specdec.training import eagle_cli

    seen = {}
    trainer = eagle_cli.EAGLE_COMMAND
    stand_in = dataclasses.replace(trainer, main=lambda args: seen.setdefault("init", args.init_head) and 0)
    monkeypatch.setattr("hf_specdec.cli.trainer_commands", lambda: [stand_in])  # `train eagle` runs the stand-in
    assert main(["train", "eagle", "--out", "x", "--init-head", "shipped"]) == 0
    assert seen["init"] == str(EAGLE.folder)
    head = eagle_cli._init_head(seen["init"], "eagle")
    assert torch.equal(head.fc.weight, EAGLE.load().fc.weight) and head is not EAGLE.load()


def test_training_on_an_explicit_device_returns_a_cpu_head(tiny_data, tmp_path):
    """``device=`` moves the head and each batch there while the data stays on the CPU (how the shipped head was
    trained on a GPU); the head comes back on the CPU, the report names the device."""
    model, data, _ = tiny_data
    cfg = EagleTrainingConfig(window=32, positions_per_step=8, max_steps=3, eval_every=0, checkpoint_every=0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    head, report = train_eagle(model, data, tmp_path / "run", cfg, progress=False, device=device)
    assert report["device"] == device and report["steps"] == 3
    assert {p.device.type for p in head.parameters()} == {"cpu"} and data.hidden.device.type == "cpu"
    assert report["held_out"]["positions"] > 0


def test_windows_tile_each_sequence_from_its_end(tiny_data):
    from hf_specdec.training.labels import window_positions, window_starts

    _, data, _ = tiny_data
    seqs = torch.arange(data.seq_bounds.shape[0])
    windows = window_starts(data, seqs, 8)  # [Wn, 2] (start, end) pair ranges
    pairs = torch.cat([torch.arange(s, e) for s, e in windows.tolist()])
    want = torch.cat([torch.arange(s, e - 1) for s, _, e in data.seq_bounds.tolist()])
    assert torch.equal(pairs.sort().values, want)  # every pair (f_t, token t+1) exactly once
    for s, _, e in data.seq_bounds.tolist():  # the last window of a sequence is full and ends at its last pair
        mine = windows[(windows[:, 0] >= s) & (windows[:, 1] <= e)]
        last = mine[mine[:, 1].argmax()]
        assert int(last[1]) == e - 1 and int(last[1] - last[0]) == min(8, e - 1 - s)
        assert int((mine[:, 1] - mine[:, 0] < 8).sum()) <= 1  # only the first one may be short
    t, valid = window_positions(data, windows, 8)  # [Wn, 8]
    assert torch.equal(t[valid].sort().values, want) and torch.equal(valid.sum(1), windows[:, 1] - windows[:, 0])


# ---------------------------------------------------------------------------------------------------- EAGLE-3
@pytest.fixture(scope="module")
def tiny_data_eagle3(tmp_path_factory):
    """A 4-layer target's answers with the states of its EAGLE-3 feature layers (1, 2, 3)."""
    model = tiny_causal_lm("llama", vocab_size=64, hidden_size=32, num_layers=4, seed=3)
    layers = EagleHead.for_model(model, version=3).feature_layers
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 64, (int(torch.randint(4, 10, (1,), generator=gen)),), generator=gen).tolist()
               for _ in range(48)]  # fmt: skip
    folder = tmp_path_factory.mktemp("data3")
    build_distillation_data(model, prompts, folder, max_new_tokens=24, batch_size=16, shard_size=24,
                            hidden_dtype=torch.float32, aux_layers=layers, progress=False)  # fmt: skip
    return model, load_distillation_data(folder), prompts


def test_unrolled_steps_equal_drafting_one_node_at_a_time():
    """Training-time test computes, for every root of the window at once, what a chain of draft nodes computes one
    node at a time over the root's context (a plain re-implementation with the head's layer)."""
    from hf_specdec.training.eagle import unrolled_draft_logits

    model = tiny_causal_lm("llama", vocab_size=64, hidden_size=32, num_layers=4, seed=1)
    head = EagleHead.for_model(model, version=3).eval()
    gen = torch.Generator().manual_seed(2)
    w, unroll = 7, 3
    feats = torch.randn(1, w, 3 * 32, generator=gen)
    tokens = torch.randint(0, 64, (1, w, unroll), generator=gen)
    with torch.no_grad():
        batched = unrolled_draft_logits(head, feats, tokens)
        empty = feats.new_zeros(1, head.config.num_key_value_heads, 0, head.head_dim)
        causal = torch.ones(w, w, dtype=torch.bool).tril()[None]
        out0, k0, v0 = head.layer_forward(tokens[..., 0], feats, torch.arange(w)[None], causal, empty, empty)
        for r in range(w):
            keys, values = k0[:, :, : r + 1], v0[:, :, : r + 1]  # the context: step-0 pairs up to the root
            x = out0[:, r : r + 1]  # the root pair's own output (step 0)
            for j in range(unroll):
                if j > 0:  # a draft node: the previous output beside token r + j + 1, seeing the context and chain
                    seen = torch.ones(1, 1, keys.shape[2] + 1, dtype=torch.bool)
                    x, k, v = head.layer_forward(tokens[:, r : r + 1, j], x, torch.tensor([[r + j]]), seen, keys,
                                                 values)  # fmt: skip
                    keys, values = torch.cat([keys, k], dim=2), torch.cat([values, v], dim=2)
                torch.testing.assert_close(head.logits(x)[0, 0], batched[j][0, r], atol=1e-5, rtol=1e-4)


def test_eagle3_training_lowers_the_loss_and_raises_acceptance(tiny_data_eagle3, tmp_path):
    model, data, prompts = tiny_data_eagle3
    cfg = EagleTrainingConfig(version=3, unroll=3, window=32, positions_per_step=8, epochs=12, lr=3e-3,
                              warmup_steps=5, draft_vocab=0, eval_fraction=0.15, eval_every=0,
                              checkpoint_every=40)  # fmt: skip
    head, report = train_eagle(model, data, tmp_path / "run", cfg, progress=False)
    assert report["train_loss_last_steps"] < 0.7 * report["train_loss_first_steps"], report
    before, after = report["held_out_before"], report["held_out"]
    assert after["top1"] > before["top1"] + 0.2, (before, after)
    saved = EagleHead.from_pretrained(tmp_path / "run" / "head", base_model=model)
    assert saved.version == 3 and saved.feature_layers == (1, 2, 3)
    untrained = EagleHead.for_model(model, version=3).eval()
    held_out = [prompts[i] for i in range(0, 48, 6)]
    assert tau_of(model, saved, held_out) > tau_of(model, untrained, held_out) + 0.3


def test_eagle3_training_refuses_data_without_its_layers(tiny_data):
    model, data, _ = tiny_data  # built without aux layers
    cfg = EagleTrainingConfig(version=3, window=32, max_steps=2, eval_every=0, draft_vocab=0)
    with pytest.raises(ValueError, match=r"reads the target's hidden states \[1, 1, 1\].*only the final states"):
        train_eagle(model, data, "unused", cfg, progress=False)
    with pytest.raises(ValueError, match="version must be 1"):
        EagleTrainingConfig(version=2)


@pytest.mark.parametrize("mixed_precision", ["no", "bf16"])
def test_bf16_mixed_precision_computes_the_loss_under_autocast_and_keeps_float32_weights(
    tiny_data, tmp_path, monkeypatch, mixed_precision
):
    import hf_specdec.training.eagle as eagle_training

    model, data, _ = tiny_data
    under_bf16 = []
    real = eagle_training.eagle_loss

    def spy(*args, **kwargs):
        under_bf16.append(torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16)
        return real(*args, **kwargs)

    monkeypatch.setattr(eagle_training, "eagle_loss", spy)
    cfg = EagleTrainingConfig(window=32, positions_per_step=8, max_steps=3, eval_every=0, checkpoint_every=0,
                              draft_vocab=40, mixed_precision=mixed_precision)  # fmt: skip
    head, report = train_eagle(model, data, tmp_path / "run", cfg, progress=False)
    assert under_bf16 == [mixed_precision == "bf16"] * 3
    assert all(p.dtype == torch.float32 for p in head.parameters())
    assert report["config"]["mixed_precision"] == mixed_precision and report["train_loss_last_steps"] > 0
    assert not torch.is_autocast_enabled("cpu")  # the held-out scores and the caller run without it


def test_trainers_refuse_a_precision_they_cannot_honour():
    from hf_specdec.training.dflash import DFlashTrainingConfig
    from hf_specdec.training.mlp_speculator import MLPSpeculatorTrainingConfig

    for config in (EagleTrainingConfig, DFlashTrainingConfig, MLPSpeculatorTrainingConfig):
        with pytest.raises(ValueError, match="mixed_precision must be 'no' or 'bf16'.*'fp16'"):
            config(mixed_precision="fp16")


def test_cli_trains_on_the_first_tokens_in_bf16(tiny_data, tmp_path, monkeypatch):
    """``--data-tokens`` trains on the data's leading sequences (a point of a scaling curve), ``--mixed-precision
    bf16`` under autocast; ``--build-dtype bfloat16`` hands the builders a bfloat16 copy and trains the float32
    target."""
    from hf_specdec.cli import build_parser, main
    from hf_specdec.training import eagle_cli

    model, data, _ = tiny_data
    args = build_parser().parse_args(["train", "eagle", "--out", "x"])
    assert (args.data_tokens, args.mixed_precision, args.build_dtype) == (None, "no", "float32")
    monkeypatch.setattr(eagle_cli, "_target", lambda args: (model, None))
    budget = int(data.seq_bounds[9, 2])  # the first ten sequences
    out = tmp_path / "run"
    assert main(["train", "eagle", "--out", str(out), "--data", str(data.folder), "--data-tokens", str(budget),
                 "--mixed-precision", "bf16", "--window", "32", "--max-steps", "2", "--draft-vocab", "40",
                 "--no-tune-tree"]) == 0  # fmt: skip
    report = json.loads((out / "training_report.json").read_text())
    assert (report["num_tokens"], report["num_sequences"]) == (budget, 10)
    assert report["config"]["mixed_precision"] == "bf16"
    built = []
    monkeypatch.setattr(eagle_cli, "resolve_data", lambda values, a, m, *rest: built.append(m.dtype) or [data.folder])
    for build_dtype, expected in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        args = build_parser().parse_args(["train", "eagle", "--out", str(out), "--data", "sharegpt", "--build-dtype",
                                          build_dtype])  # fmt: skip
        assert eagle_cli.training_data(args, model, None, ()) == [data.folder]
        assert built[-1] == expected and model.dtype == torch.float32


def test_init_layer_starts_the_eagle1_layer_as_the_targets(tiny_data, tmp_path):
    """``init_layer`` starts a fresh EAGLE-1 head's layer as the target's decoder layer (the target's input norm,
    which the EAGLE-1 layer lacks, left out) and trains from there; EAGLE-3's wider layer is refused."""
    model, data, _ = tiny_data
    head = EagleHead.for_model(model)
    assert head.copy_target_layers(model, -1) == [1]
    target = model.model.layers[1]
    for name, param in head.layers[0].named_parameters():
        assert torch.equal(param, target.get_parameter(name)), name
    cfg = EagleTrainingConfig(window=32, positions_per_step=8, max_steps=2, eval_every=0, draft_vocab=0, init_layer=0)
    trained, report = train_eagle(model, data, tmp_path / "run", cfg, progress=False)
    assert report["config"]["init_layer"] == 0 and report["steps"] == 2
    with pytest.raises(ValueError, match="EAGLE-3"):
        EagleTrainingConfig(version=3, init_layer=-1)
    with pytest.raises(ValueError, match="init_layer .* init_head"):
        train_eagle(model, data, tmp_path / "both", cfg, progress=False, init_head=trained)
    assert not (tmp_path / "both").exists()
    with pytest.raises(ValueError, match="only an EAGLE-1 layer"):
        EagleHead.for_model(model, version=3).copy_target_layers(model, -1)
