"""Medusa-1 self-distillation: the data cache, the training loop (loss down, top-1 up), resume, and the prompt set."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from hf_specdec.heads.medusa import MedusaHeads
from hf_specdec.heads.train import (
    MedusaTrainingConfig,
    build_distillation_data,
    latest_checkpoint,
    load_distillation_data,
    make_prompts,
    prompt_recipe,
    spec_bench_overlap,
    train_medusa,
)
from hf_specdec.heads.train import data as data_mod
from hf_specdec.heads.train.medusa import head_positions, medusa_labels
from hf_specdec.testing import tiny_causal_lm

SPEC_BENCH = Path(__file__).resolve().parents[1].parent / "shared" / "bench" / "spec_bench_public.jsonl"
NUM_PROMPTS = 256  # a random tiny model needs this many answers for held-out accuracy to generalise


def toy_encode(text: str, vocab: int = 97) -> list[int]:
    """A stand-in tokenizer for the tiny model: BOS + one id per word (ids 3..vocab-1), at most 6 words."""
    return [1] + [3 + sum(map(ord, w)) % (vocab - 3) for w in text.split()[:6]]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread: these runs are tiny, and two threads on a shared, loaded CPU are ten times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny():
    return tiny_causal_lm("llama", hidden_size=64, seed=0)


@pytest.fixture(scope="module")
def data_dir(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("medusa_data")
    prompts = make_prompts(NUM_PROMPTS, seed=0)
    build_distillation_data(
        tiny,
        [toy_encode(p) for p in prompts],
        out,
        recipe=prompt_recipe(NUM_PROMPTS, 0),
        max_new_tokens=48,
        batch_size=32,
        shard_size=64,
        base_model_name="tiny-llama",
        progress=False,
    )
    return out


def small_config(**kw) -> MedusaTrainingConfig:
    base = dict(
        num_heads=3, epochs=1e4, max_steps=200, positions_per_step=128, lr=1e-2, warmup_steps=2, eval_fraction=0.2
    )
    base.update(kw)
    return MedusaTrainingConfig(**base)


def test_manifest_records_recipe_settings_and_shards(data_dir, tiny):
    manifest = json.loads((data_dir / "manifest.json").read_text())
    assert manifest["complete"] and manifest["num_sequences"] == NUM_PROMPTS
    assert [s["file"] for s in manifest["shards"]] == [f"shard-{i:05d}.safetensors" for i in range(4)]
    assert manifest["prompt_recipe"]["seed"] == 0 and manifest["prompt_recipe"]["num_prompts"] == NUM_PROMPTS
    assert manifest["prompt_recipe"]["templates"] and manifest["prompt_recipe"]["topics"]
    assert manifest["generation"]["max_new_tokens"] == 48 and manifest["generation"]["do_sample"] is False
    assert manifest["hidden_size"] == 64 and manifest["vocab_size"] == 97


def test_cached_hidden_states_are_what_the_lm_head_sees(data_dir, tiny):
    data = load_distillation_data(data_dir)
    start, _, end = data.seq_bounds[0].tolist()
    ids = data.input_ids[start:end]
    with torch.no_grad():
        logits = tiny(ids[None]).logits[0]  # [len, V]
    again = tiny.get_output_embeddings()(data.hidden[start:end].float())
    torch.testing.assert_close(again, logits, atol=2e-2, rtol=1e-2)  # fp16 storage
    # the answers are the target's greedy continuation
    assert torch.equal(
        logits[:-1].argmax(-1)[data.seq_bounds[0, 1] - start - 1 :], ids[data.seq_bounds[0, 1] - start :]
    )


def test_rebuilding_skips_finished_shards(data_dir, tiny, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a finished shard was generated again")

    monkeypatch.setattr(data_mod, "_generate_answers", refuse)
    prompts = make_prompts(NUM_PROMPTS, seed=0)
    manifest = build_distillation_data(
        tiny,
        [toy_encode(p) for p in prompts],
        data_dir,
        recipe=prompt_recipe(NUM_PROMPTS, 0),
        max_new_tokens=48,
        batch_size=32,
        shard_size=64,
        progress=False,
    )
    assert manifest["num_sequences"] == NUM_PROMPTS
    with pytest.raises(ValueError, match="other prompts or generation settings"):
        build_distillation_data(tiny, [toy_encode(p) for p in prompts], data_dir, max_new_tokens=49, progress=False)


def test_labels_are_the_token_k_plus_2_ahead_within_the_answer(data_dir):
    data = load_distillation_data(data_dir)
    pos = head_positions(data, torch.arange(data.seq_bounds.shape[0]))
    labels = medusa_labels(data, pos, 3)
    start, ans, end = data.seq_bounds[0].tolist()
    assert int(pos[0]) == max(start, ans - 2)
    for k in range(3):
        t = int(pos[0])
        expect = int(data.input_ids[t + k + 2]) if ans <= t + k + 2 < end else -100
        assert int(labels[k, 0]) == expect
    assert (labels[0] >= 0).all()  # head 0 always has a target at a training position


def test_training_lowers_loss_and_raises_top1(data_dir, tiny, tmp_path):
    heads, report = train_medusa(
        data_dir, tmp_path, tiny.get_output_embeddings(), small_config(), progress=False, cpu=True
    )
    before, after = report["held_out_before"], report["held_out"]
    # fresh heads are the identity (they guess token t + 1): training must beat that on held-out sequences
    assert after["loss"] < before["loss"] - 1.0, (before["loss"], after["loss"])
    assert sum(after["top1_per_head"]) > sum(before["top1_per_head"]) + 0.05, (before, after)
    assert after["top1_per_head"][0] > before["top1_per_head"][0] + 0.05, (before, after)
    assert after["top1_per_head"][2] > before["top1_per_head"][2], (before, after)
    # saved in our format, with the model card facts
    loaded = MedusaHeads.from_pretrained(tmp_path, base_model=tiny)
    assert loaded.num_heads == 3 and loaded.share_lm_head
    card = loaded.model_card
    assert card["held_out_top1_per_head"] == after["top1_per_head"]
    assert card["base_model"] == "tiny-llama" and card["data_size"]["sequences"] == NUM_PROMPTS
    assert card["tau"] is None and "training_data" in card
    for key, value in heads.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[key], value)
    assert "Medusa heads for tiny-llama" in (tmp_path / "README.md").read_text()


def test_soft_targets_over_a_truncated_vocabulary_also_learn(data_dir, tiny, tmp_path):
    cfg = small_config(distill="soft", loss_vocab=40, max_steps=60)
    _, report = train_medusa(data_dir, tmp_path, tiny.get_output_embeddings(), cfg, progress=False, cpu=True)
    # the soft objective falls (it is bounded below by the tiny random model's high-entropy distributions, so only a
    # little); the heads guess the target's next-next token more often than the identity did
    assert report["train_loss_last_steps"] < report["train_loss_first_steps"], report
    assert report["held_out"]["top1_per_head"][0] > report["held_out_before"]["top1_per_head"][0] + 0.02
    assert 0 < report["loss_vocab_coverage"] <= 1


def test_resume_from_a_checkpoint_matches_an_uninterrupted_run(data_dir, tiny, tmp_path):
    cfg = small_config(max_steps=12, checkpoint_every=4, keep_checkpoints=10, eval_positions=64)
    lm_head = tiny.get_output_embeddings()
    full, _ = train_medusa(data_dir, tmp_path / "full", lm_head, cfg, progress=False, cpu=True)
    assert latest_checkpoint(tmp_path / "full").name == "step-0000012.pt"
    with pytest.raises(FileExistsError, match="resume"):
        train_medusa(data_dir, tmp_path / "full", lm_head, cfg, progress=False, cpu=True)

    (tmp_path / "cut" / "checkpoints").mkdir(parents=True)
    shutil.copy(tmp_path / "full" / "checkpoints" / "step-0000008.pt", tmp_path / "cut" / "checkpoints")
    resumed, report = train_medusa(data_dir, tmp_path / "cut", lm_head, cfg, resume=True, progress=False, cpu=True)
    assert report["steps"] == 12
    for key, value in full.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[key], value, msg=f"{key} differs after resume")


def test_prompt_set_is_deterministic_distinct_and_has_no_spec_bench_question():
    prompts = make_prompts(500, seed=0)
    assert prompts == make_prompts(500, seed=0) and len(set(prompts)) == 500
    assert make_prompts(100, seed=0) == prompts[:100] and make_prompts(100, seed=1) != prompts[:100]
    if not SPEC_BENCH.is_file():
        pytest.skip(f"{SPEC_BENCH} not present")
    assert spec_bench_overlap(make_prompts(2000, seed=0), SPEC_BENCH) == []


def test_cli_has_a_train_medusa_subcommand():
    from hf_specdec.cli import build_parser

    args = build_parser().parse_args(["train", "medusa", "--out", "x", "--num-prompts", "8", "--resume"])
    assert args.out == "x" and args.num_prompts == 8 and args.resume and args.num_heads == 4
