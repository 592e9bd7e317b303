"""The head evaluation on the target's answers to the bench's questions: the answers are the benchmark's greedy ones,
every category is scored, the figure is the one a plain computation gives, and the folder can never train a head."""

from __future__ import annotations

import json

import pytest
import torch

from hf_specdec.assistants import EAGLE, MEDUSA, MLP_SPECULATOR
from hf_specdec.bench.head_eval import (
    build_bench_answers,
    draft_vocabulary_ids,
    evaluate_heads,
    format_table,
    load_bench_answers,
    vocabulary_coverage,
)
from hf_specdec.bench.questions import load_questions, sample_questions
from hf_specdec.bench.spec_bench import build_prompts
from hf_specdec.heads.eagle import EagleHead
from hf_specdec.training.benchmark_questions import find_questions_file
from hf_specdec.training.eagle import EagleTrainingConfig, train_eagle
from hf_specdec.training.shards import load_distillation_data

pytestmark = pytest.mark.slow
NEW = 12


@pytest.fixture(scope="module")
def answers(default_model, tmp_path_factory):
    model, tok = default_model
    folder = tmp_path_factory.mktemp("bench-answers")
    build_bench_answers(model, tok, find_questions_file(), folder, per_category=1, seed=0, max_new_tokens=NEW,
                        batch_size=6, progress=False)  # fmt: skip
    return folder


def test_answers_are_the_benchmarks_greedy_answers(default_model, answers):
    model, tok = default_model
    data, categories = load_bench_answers(answers)
    questions = sample_questions(load_questions(find_questions_file()), 1, 0)
    assert categories == [q["pooled_category"] for q in questions]
    for i, prompt in enumerate(build_prompts(tok, questions[:2])):
        s, a, e = data.seq_bounds[i].tolist()
        assert data.input_ids[s:a].tolist() == prompt.ids.tolist()
        expected = model.generate(prompt.ids[None], max_new_tokens=NEW, do_sample=False)[0, a - s :]
        assert data.input_ids[a:e].tolist() == expected.tolist()[: e - a]


def test_every_head_is_scored_per_category(default_model, answers):
    model, _ = default_model
    data, categories = load_bench_answers(answers)
    heads = {"eagle": EAGLE.load(), "medusa": MEDUSA.load(), "mlp_speculator": MLP_SPECULATOR.load()}
    rows = evaluate_heads(model, data, heads, categories)
    assert {(r["head"], r["category"]) for r in rows} == {(h, c) for h in heads for c in [*categories, "overall"]}
    for r in rows:
        assert all(0.0 <= x <= 1.0 for x in r["top1"]), r
    by = {(r["head"], r["category"]): r["top1"] for r in rows}
    assert len(by[("medusa", "overall")]) == MEDUSA.load().num_heads
    assert len(by[("mlp_speculator", "overall")]) == MLP_SPECULATOR.load().n_predict
    for r in rows:  # a head cannot draft right more often than its draft vocabulary holds the token
        assert r["top1"][0] <= r["vocab_coverage"] <= 1.0, r
    table = format_table(rows)
    first, second = table.split("\n\n")
    assert first.count("\n") == 1 + len(heads) and "translation" in first
    assert second.count("\n") == 1 + len(heads) and "chain τ" in second
    assert all(f"| {h} |" in second for h in heads)


def plain_first_token_hits(head, data, features: torch.Tensor) -> tuple[int, int]:
    """``(hits, positions)``: per answer position t whose token t + 2 is an answer token, whether the head's arg-max
    (fed ``features`` `[N, F]` at t and the token t + 1) is that token, counted one position at a time."""
    hit = total = 0
    with torch.no_grad():
        for s, a, e in data.seq_bounds.tolist():
            t = torch.arange(s, e - 1)
            _, logits = head(data.input_ids[t + 1][None], features[t][None].float())
            for p in range(max(s, a - 2), e - 2):
                hit += int(head.draft_to_token(logits[0, p - s].argmax()) == data.input_ids[p + 2])
                total += 1
    return hit, total


def test_eagle_figure_is_the_plain_count(default_model, answers):
    """The EAGLE row equals counting, per answer position, the head's arg-max against the target's token t + 2."""
    model, _ = default_model
    data, categories = load_bench_answers(answers)
    head = EAGLE.load().bind(model)
    hit, total = plain_first_token_hits(head, data, data.hidden)
    rows = evaluate_heads(model, data, {"eagle": head}, categories)
    overall = next(r for r in rows if r["category"] == "overall")
    assert overall["top1"][0] == pytest.approx(hit / total, abs=1e-4)


def test_the_answers_never_train_a_head(default_model, answers, tmp_path):
    with pytest.raises(ValueError, match="evaluation only"):
        load_distillation_data(answers)
    with pytest.raises(ValueError, match="evaluation only"):
        load_distillation_data([answers])
    manifest = json.loads((answers / "manifest.json").read_text())
    assert manifest["prompt_recipe"]["evaluation_only"] is True
    model, _ = default_model
    with pytest.raises(ValueError, match="evaluation only"):  # the trainers read data through the same loader
        train_eagle(model, load_distillation_data(answers), tmp_path, EagleTrainingConfig(max_steps=1))


def test_an_eagle3_head_is_scored_on_answers_holding_its_layers(default_model, tmp_path):
    """An EAGLE-3 head reads three layers' states: `eval-heads` builds its answers with them, in a folder of their
    own, and its figure is the plain count over those states."""
    from hf_specdec.bench.head_eval import _by_feature_layers, bench_answers_folder
    from hf_specdec.heads.eagle import EagleHead

    model, tok = default_model
    head = EagleHead.for_model(model, version=3).eval()
    groups = _by_feature_layers(model, {"eagle3": head, "eagle": EAGLE.load()})
    assert set(groups) == {(), (2, 15, 27)} and set(groups[(2, 15, 27)]) == {"eagle3"}
    folder = bench_answers_folder(tmp_path, 1, 0, 8, (2, 15, 27))
    assert folder.name.endswith("-8tok-layers2-15-27")
    build_bench_answers(model, tok, find_questions_file(), folder, per_category=1, seed=0, max_new_tokens=8,
                        batch_size=6, progress=False, aux_layers=(2, 15, 27))  # fmt: skip
    data, categories = load_bench_answers(folder)
    hit, total = plain_first_token_hits(head, data, data.aux_hidden)
    overall = next(r for r in evaluate_heads(model, data, {"eagle3": head}, categories) if r["category"] == "overall")
    assert total > 20 and overall["top1"][0] == pytest.approx(hit / total, abs=1e-4)


def test_the_dflash_head_is_scored_on_its_layers_as_its_trainer_scores_it(default_model, tmp_path):
    """The shipped DFlash head reads three layers' states: `eval-heads` groups it with answers holding them, and its
    figures (depth-1 top-1, chain τ over its whole block) are the trainer's held-out computation (`evaluate_dflash`)
    on the same anchors: every answer position, the block anchored at the token before it."""
    from hf_specdec.assistants import DFLASH
    from hf_specdec.bench.head_eval import _by_feature_layers
    from hf_specdec.training.dflash import evaluate_dflash

    model, tok = default_model
    head = DFLASH.load().bind(model)
    (layers,) = _by_feature_layers(model, {"dflash": head})
    assert layers == tuple(head.feature_layers) and len(layers) > 1
    build_bench_answers(model, tok, find_questions_file(), tmp_path, per_category=1, seed=0, max_new_tokens=NEW,
                        batch_size=6, progress=False, aux_layers=layers)  # fmt: skip
    data, categories = load_bench_answers(tmp_path)
    overall = next(r for r in evaluate_heads(model, data, {"dflash": head}, categories) if r["category"] == "overall")
    plain = evaluate_dflash(head, data, torch.arange(len(categories)), max_positions=10**9)
    assert plain["positions"] > 20 and overall["chain"]["positions"] == plain["positions"]
    assert len(overall["top1"]) == head.num_depths and overall["top1"][0] == pytest.approx(plain["top1"], abs=1e-4)
    assert overall["chain"]["tau"] == pytest.approx(plain["chain_tau"], abs=1e-3)


def test_vocabulary_coverage_is_the_share_of_answer_tokens_the_draft_vocabulary_holds(default_model, answers):
    model, _ = default_model
    data, _ = load_bench_answers(answers)
    seq_ids = torch.arange(data.seq_bounds.shape[0])
    speculator = MLP_SPECULATOR.load()
    vocab = set(speculator.token_map.tolist())
    nxt = data.next_tokens()  # [N]
    held = total = 0
    for s, a, e in data.seq_bounds.tolist():  # every first guess (token t + 2) that is an answer token
        for t in range(max(s, a - 2), e - 2):
            if data.answer_mask[t + 2]:
                held += int(nxt[t + 1]) in vocab
                total += 1
    assert total > 0 and vocabulary_coverage(speculator, data, seq_ids) == round(held / total, 4)
    assert draft_vocabulary_ids(speculator).tolist() == speculator.token_map.tolist()
    eagle = EAGLE.load()
    assert set(draft_vocabulary_ids(eagle).tolist()) == set(torch.nonzero(eagle.t2d).flatten().tolist())
    assert vocabulary_coverage(EagleHead.for_model(model), data, seq_ids) == 1.0  # drafts over the whole vocabulary
