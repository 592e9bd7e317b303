"""Medusa-1 self-distillation: the data cache, the training loop (loss down, top-1 up), resume, and the prompt set."""

import json
import shutil

import pytest
import torch

from hf_specdec.generation.proposers.medusa import MedusaAssistant
from hf_specdec.heads.medusa import MedusaHeads
from hf_specdec.testing import tiny_causal_lm, torch_threads, toy_encode
from hf_specdec.training import (
    MedusaTrainingConfig,
    acceptance_table,
    build_distillation_data,
    evaluate_medusa,
    find_questions_file,
    guess_matches,
    latest_checkpoint,
    load_distillation_data,
    make_context_prompts,
    make_prompts,
    measure_step_cost,
    prompt_recipe,
    spec_bench_overlap,
    target_states,
    train_medusa,
    tree_tau,
    tune_and_save_tree,
    tune_tree,
)
from hf_specdec.training.labels import draft_vocabulary, head_positions, medusa_labels
from hf_specdec.training.run import split_sequences

SPEC_BENCH = find_questions_file()  # the copy shipped in the package
NUM_PROMPTS = 256  # a random tiny model needs this many answers for held-out accuracy to generalise


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread: these runs are tiny, and two threads on a shared, loaded CPU are ten times slower."""
    with torch_threads(1):
        yield


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

    monkeypatch.setattr(target_states, "_generate_answers", refuse)
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
    assert spec_bench_overlap(make_prompts(2000, seed=0), SPEC_BENCH) == []


def test_cli_has_a_train_medusa_subcommand():
    from hf_specdec.cli import build_parser

    args = build_parser().parse_args(["train", "medusa", "--out", "x", "--num-prompts", "8", "--resume"])
    assert args.out == "x" and args.num_prompts == 8 and args.resume and args.num_heads == 4 and args.data is None
    args = build_parser().parse_args(["train", "medusa", "--out", "x", "--data", "d1", "d2"])
    assert args.data == ["d1", "d2"]  # existing folders (the six-task data, say) trained on as they are


def test_draft_vocabulary_heads_draft_only_over_it_and_are_scored_as_decoding_sees_them(data_dir, tiny, tmp_path):
    cfg = small_config(loss_vocab=24, draft_vocab=True, max_steps=40)
    heads, report = train_medusa(data_dir, tmp_path, tiny.get_output_embeddings(), cfg, progress=False, cpu=True)
    assert heads.draft_vocab_size == 24 and heads.token_map.numel() == 24
    data = load_distillation_data(data_dir)
    # the token map is the loss vocabulary: the most frequent answer tokens of the training split
    train_seqs, _ = split_sequences(data, cfg.eval_fraction, cfg.seed)
    expected, _ = draft_vocabulary(data, head_positions(data, train_seqs), 24)
    assert torch.equal(heads.token_map, expected)
    # guesses come from the map only, and the projection onto V' rows equals slicing the full logits
    hidden = data.hidden[:50].float()
    lm_head = tiny.get_output_embeddings()
    top = heads.topk_tokens(hidden, 3, lm_head=lm_head)
    assert torch.isin(top, heads.token_map).all()
    states = heads.head_states(hidden)
    torch.testing.assert_close(heads.draft_logits(states, lm_head), lm_head(states)[..., heads.token_map])
    # held-out accuracy counts labels outside the map as misses: it is at most the map's coverage of the labels
    eval_pos = head_positions(data, torch.arange(data.seq_bounds.shape[0]))[:512]
    metrics = evaluate_medusa(heads, data, eval_pos, lm_head.weight.detach())
    labels = medusa_labels(data, eval_pos, 3)
    coverage = (torch.isin(labels, heads.token_map).sum(1) / (labels >= 0).sum(1)).tolist()
    for acc, cov in zip(metrics["top1_per_head"], coverage):
        assert acc <= cov + 1e-6
    assert metrics["positions_per_head"] == (labels >= 0).sum(1).tolist()
    with pytest.raises(ValueError, match="draft_vocab needs loss_vocab"):
        MedusaTrainingConfig(draft_vocab=True)
    # round trip keeps the map
    loaded = MedusaHeads.from_pretrained(tmp_path, base_model=tiny)
    assert torch.equal(loaded.token_map, heads.token_map)


def _brute_force_tau(choices, match):
    """Tokens per step by walking every position's tree node by node (the definition)."""
    total = 0
    for p in range(match.shape[0]):
        best = 0
        for path in choices:
            if all(match[p, d, r] for d, r in enumerate(path)):
                best = max(best, len(path))
        total += 1 + best
    return total / match.shape[0]


def test_tree_tau_and_acceptance_table_match_their_definitions():
    gen = torch.Generator().manual_seed(0)
    p, d, k = 400, 3, 4
    # at most one right guess per depth (the label is one token); more likely at low ranks
    rank = torch.multinomial(torch.tensor([0.4, 0.2, 0.1, 0.05, 0.25]), p * d, replacement=True, generator=gen)
    match = torch.nn.functional.one_hot(rank, 5)[:, :k].bool().view(p, d, k)
    choices = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [2]]
    assert tree_tau(choices, match) == pytest.approx(_brute_force_tau(choices, match))
    assert tree_tau([], match) == 1.0
    table = acceptance_table(match)
    assert table[0] == pytest.approx(match[:, 0].float().mean(0).tolist())
    alive = match[:, 0].any(-1)
    assert table[1] == pytest.approx(match[alive, 1].float().mean(0).tolist())
    with pytest.raises(ValueError, match="no parent"):
        tree_tau([[0, 1]], match)


def test_tune_tree_picks_the_size_with_the_best_predicted_speedup(data_dir, tiny, tmp_path):
    heads, _ = train_medusa(
        data_dir, tmp_path, tiny.get_output_embeddings(), small_config(max_steps=60), progress=False, cpu=True
    )
    data = load_distillation_data(data_dir)
    positions = head_positions(data, torch.arange(0, data.seq_bounds.shape[0], 5))
    sizes = (1, 2, 4, 8)
    # a made-up cost curve: one where only tiny trees pay, one where verification is free
    steep = tune_tree(heads, data, positions, tiny, sizes=sizes, cost={1: 1.0, 2: 1.5, 4: 3.0, 8: 6.0})
    free = tune_tree(heads, data, positions, tiny, sizes=sizes, cost=dict.fromkeys(sizes, 1.0))
    taus = [r["tau"] for r in free.rows]
    assert taus == sorted(taus) and taus[-1] > taus[0]  # bigger optimal trees never accept less
    assert len(free.choices) == 8 and len(steep.choices) <= 2
    assert free.rows[0] == {"nodes": 0, "tau": 1.0, "cost": 1.0, "predicted_speedup": 1.0, "choices": []}
    assert len({r["nodes"] for r in free.rows}) == len(free.rows)  # no tree listed twice
    # when no tree pays for itself, the heads draft nothing
    never = tune_tree(heads, data, positions, tiny, sizes=sizes, cost=dict.fromkeys(sizes, 100.0))
    assert never.choices == [] and MedusaAssistant(heads, tree_choices=never.choices).template.num_nodes == 0
    for tuning in (steep, free):
        best = max(tuning.rows, key=lambda r: r["predicted_speedup"])
        assert tuning.choices == best["choices"] and "(chosen)" in tuning.markdown()
        match = guess_matches(heads, data, positions, tiny.get_output_embeddings(), 8)
        assert best["tau"] == pytest.approx(tree_tau(best["choices"], match))


def test_measured_step_cost_grows_with_the_tree():
    # wide enough that 65 rows cost clearly more than 1: at hidden size 64 per-op overhead dominates, the margin was
    # ~1.5x and one CI run measured 0.99x (timing noise on two shared cores); at 512 it is ~2.5x
    model = tiny_causal_lm("llama", hidden_size=512, num_layers=2, seed=0)
    heads = MedusaHeads.for_model(model, num_heads=2)
    cost = measure_step_cost(model, heads, (0, 16, 64), context=64, repeats=3)
    assert cost[0] == pytest.approx(1.0) and cost[64] > cost[0] and all(c > 0 for c in cost.values())


class ToyTokenizer:
    """Decodes the tiny model's ids as words (id 1 is BOS, a special token)."""

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(f"w{i}" for i in ids if not (skip_special_tokens and i == 1))


def test_context_prompts_are_tasks_over_the_targets_own_answers(data_dir):
    data = load_distillation_data(data_dir)
    prompts = make_context_prompts(data, ToyTokenizer(), 120, seed=0)
    assert prompts == make_context_prompts(data, ToyTokenizer(), 120, seed=0) and len(set(prompts)) == 120
    assert make_context_prompts(data, ToyTokenizer(), 120, seed=1) != prompts
    answers = {
        ToyTokenizer().decode(data.input_ids[a:e].tolist(), skip_special_tokens=True)
        for _, a, e in data.seq_bounds.tolist()
    }
    with_context = [p for p in prompts if any(a in p for a in answers)]
    word_problems = [p for p in prompts if "step" in p or "Show" in p or "reasoning" in p]
    assert len(with_context) >= 0.6 * len(prompts)  # every task but the word problems quotes a stage-1 answer
    assert set(with_context) | set(word_problems) == set(prompts)
    assert spec_bench_overlap(prompts, SPEC_BENCH) == []


def test_several_data_folders_load_as_one_dataset(data_dir, tiny, tmp_path):
    second = tmp_path / "second"
    build_distillation_data(
        tiny,
        [toy_encode(p) for p in make_prompts(40, seed=5)],
        second,
        max_new_tokens=16,
        batch_size=16,
        shard_size=32,
        base_model_name="tiny-llama",
        progress=False,
    )
    a, b = load_distillation_data(data_dir), load_distillation_data(second)
    both = load_distillation_data([data_dir, second])
    assert both.manifest["num_sequences"] == a.seq_bounds.shape[0] + b.seq_bounds.shape[0]
    assert torch.equal(both.input_ids, torch.cat([a.input_ids, b.input_ids]))
    # positions and labels of the second part are those of b, shifted
    pos_b = head_positions(b, torch.arange(b.seq_bounds.shape[0]))
    seqs = torch.arange(a.seq_bounds.shape[0], both.seq_bounds.shape[0])
    pos_both = head_positions(both, seqs)
    assert torch.equal(pos_both, pos_b + a.input_ids.numel())
    assert torch.equal(medusa_labels(both, pos_both, 3), medusa_labels(b, pos_b, 3))
    (tmp_path / "other").mkdir()
    manifest = json.loads((second / "manifest.json").read_text())
    manifest["base_model"] = "another-model"
    shutil.copytree(second, tmp_path / "other", dirs_exist_ok=True)
    (tmp_path / "other" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="different base models"):
        load_distillation_data([data_dir, tmp_path / "other"])


def test_tuned_tree_is_saved_with_the_heads_and_drives_the_run_time_depth(data_dir, tiny, tmp_path):
    cfg = small_config(max_steps=20)
    heads, report = train_medusa(data_dir, tmp_path, tiny.get_output_embeddings(), cfg, progress=False, cpu=True)
    tuning = tune_and_save_tree(heads, load_distillation_data(data_dir), tmp_path, tiny, cfg, report)
    saved = json.loads((tmp_path / "training_report.json").read_text())
    assert saved["tree_tuning"]["chosen"] == tuning.choices and saved["held_out"] == report["held_out"]
    loaded = MedusaHeads.from_pretrained(tmp_path, base_model=tiny)
    assert loaded.tree_choices == tuning.choices
    tree = loaded.model_card["tree"]
    assert tree["nodes"] == len(tuning.choices) and len(tree["depth_acceptance"]) == max(
        map(len, tuning.choices), default=0
    )
    assert {int(n) for n in tree["step_cost"]} == {r["nodes"] for r in tuning.rows}
    assistant = MedusaAssistant(loaded, tree_choices=loaded.tree_choices)
    assert assistant.tree_choices == tuning.choices
    assert MedusaAssistant(loaded).prior_cost is not None  # the tuned costs: the tree budget's prior
