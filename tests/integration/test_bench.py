"""The benchmark's pure pieces (question sampling, pooling, metrics, report writers) and a smoke run on a tiny model."""

import json
import statistics

import pytest
import torch

from hf_specdec.bench import questions as bq
from hf_specdec.bench.methods import METHODS, NullAssistant, resolve_methods
from hf_specdec.bench.report import OVERALL, markdown_report, median_speedup, summarize, write_results
from hf_specdec.bench.spec_bench import (
    Prompt,
    count_new_tokens,
    first_difference,
    left_pad,
    run_bench,
    settings_for,
)
from hf_specdec.cli import build_parser
from hf_specdec.testing import tiny_causal_lm

try:
    import hf_specdec

    HAVE_LOOP = callable(getattr(hf_specdec, "generate", None))
except ImportError:  # the loop is not written yet
    HAVE_LOOP = False
needs_loop = pytest.mark.skipif(not HAVE_LOOP, reason="hf_specdec.generate is not importable yet")

SPEC_BENCH_CATEGORIES = {"translation", "summarization", "qa", "math_reasoning", "rag"}


def synthetic_questions(per_source: int = 6) -> list[dict]:
    qs, qid = [], 0
    for cat in [*bq.MT_BENCH_CATEGORIES, *sorted(SPEC_BENCH_CATEGORIES)]:
        for _ in range(per_source if cat in SPEC_BENCH_CATEGORIES else 2):
            qid += 1
            qs.append({"question_id": qid, "category": cat, "turns": [f"question {qid} about {cat}"]})
    return qs


@pytest.fixture
def questions_file(tmp_path):
    path = tmp_path / "questions.jsonl"
    path.write_text("\n".join(json.dumps(q) for q in synthetic_questions()) + "\n")
    return path


# ------------------------------------------------------------------------------------------------ questions
def test_mt_bench_categories_pool_into_multi_turn_conversation():
    for cat in bq.MT_BENCH_CATEGORIES:
        assert bq.pooled_category(cat) == bq.MULTI_TURN
    for cat in SPEC_BENCH_CATEGORIES:
        assert bq.pooled_category(cat) == cat


def test_load_questions_adds_pooled_category_and_rejects_malformed_lines(questions_file, tmp_path):
    qs = bq.load_questions(questions_file)
    assert len(qs) == 16 + 30
    assert {q["pooled_category"] for q in qs} == {bq.MULTI_TURN} | SPEC_BENCH_CATEGORIES
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question_id": 1, "category": "qa"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        bq.load_questions(bad)


def test_question_sample_is_deterministic_and_covers_every_category(questions_file):
    qs = bq.load_questions(questions_file)
    a = bq.sample_questions(qs, per_category=4, seed=0)
    b = bq.sample_questions(list(reversed(qs)), per_category=4, seed=0)
    assert [q["question_id"] for q in a] == [q["question_id"] for q in b], "sample depends on the file's order"
    counts = {}
    for q in a:
        counts[q["pooled_category"]] = counts.get(q["pooled_category"], 0) + 1
    assert counts == {c: 4 for c in [bq.MULTI_TURN, *SPEC_BENCH_CATEGORIES]}
    assert [q["pooled_category"] for q in a][::4] == list(bq.CATEGORY_ORDER), "not in Spec-Bench's order"
    c = bq.sample_questions(qs, per_category=4, seed=1)
    assert [q["question_id"] for q in c] != [q["question_id"] for q in a]


def test_multi_turn_sample_draws_from_different_mt_bench_categories(questions_file):
    qs = bq.sample_questions(bq.load_questions(questions_file), per_category=8, categories=[bq.MULTI_TURN])
    assert sorted(q["category"] for q in qs) == sorted(bq.MT_BENCH_CATEGORIES)


def test_small_categories_give_all_they_have(questions_file):
    qs = bq.sample_questions(bq.load_questions(questions_file), per_category=100)
    assert len(qs) == 46
    with pytest.raises(ValueError, match="unknown categories"):
        bq.sample_questions(qs, per_category=1, categories=["poetry"])


def test_interleave_categories_mixes_prompt_kinds(questions_file):
    qs = bq.sample_questions(bq.load_questions(questions_file), per_category=2)
    mixed = bq.interleave_categories(qs)
    assert sorted(q["question_id"] for q in mixed) == sorted(q["question_id"] for q in qs)
    assert [q["pooled_category"] for q in mixed[:6]] == list(bq.CATEGORY_ORDER)


def test_find_questions_file(tmp_path, questions_file):
    assert bq.find_questions_file(questions_file) == questions_file
    with pytest.raises(FileNotFoundError, match="does not exist"):
        bq.find_questions_file(tmp_path / "missing.jsonl")


def test_public_question_file_has_the_spec_bench_categories():
    path = bq.find_questions_file()  # the copy shipped in the package
    packaged = bq.PACKAGED_QUESTIONS
    assert packaged.read_bytes() == path.read_bytes()
    qs = bq.load_questions(path)
    assert len(qs) == 240  # half of Spec-Bench's 480
    assert {q["pooled_category"] for q in qs} == set(bq.CATEGORY_ORDER)
    sample = bq.sample_questions(qs, per_category=4)
    assert len(sample) == 24
    assert len({q["category"] for q in sample if q["pooled_category"] == bq.MULTI_TURN}) == 4


# ------------------------------------------------------------------------------------------------ metrics
def test_speedup_is_the_median_of_per_prompt_ratios():
    vanilla = [1.0, 2.0, 10.0]
    method = [0.5, 2.0, 2.0]  # ratios 2, 1, 5
    assert median_speedup(vanilla, method) == 2.0
    assert median_speedup(vanilla, method) != pytest.approx(sum(vanilla) / sum(method))
    with pytest.raises(ValueError):
        median_speedup([1.0], [])


def test_count_new_tokens_stops_at_each_rows_first_eos():
    seqs = torch.tensor([[9, 9, 5, 6, 2, 2, 2], [0, 9, 5, 6, 7, 8, 3]])
    assert count_new_tokens(seqs, 2, {2}) == 3 + 5
    assert count_new_tokens(seqs, 2, set()) == 10


def test_first_difference():
    a = torch.tensor([[1, 2, 3, 4, 5]])
    assert first_difference(a, a.clone(), 2) is None
    assert first_difference(a, torch.tensor([[1, 2, 3, 9, 5]]), 2) == 1
    assert first_difference(a, torch.tensor([[1, 2, 3, 4]]), 2) == 2


def test_left_pad():
    ids, mask = left_pad([torch.tensor([5, 6, 7]), torch.tensor([8])], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_resolve_methods_runs_vanilla_first_and_rejects_unknown_names():
    assert [m.name for m in resolve_methods("ngram,null")] == ["vanilla", "ngram", "null"]
    assert [m.name for m in resolve_methods(None)] == list(METHODS)
    with pytest.raises(ValueError, match="unknown methods"):
        resolve_methods(["medusa-7"])


def _record(method, category, qid, t, vt, tokens=10, steps=None, drafted=None, accepted=None, match=None, error=None):
    speedup = None if error else (tokens / t) / (tokens / vt)
    return dict(
        method=method,
        setting="greedy",
        category=category,
        question_id=qid,
        batch=1,
        new_tokens=None if error else tokens,
        time_s=None if error else t,
        vanilla_time_s=vt,
        vanilla_new_tokens=tokens,
        speedup=speedup,
        steps=steps,
        drafted=drafted,
        accepted=accepted,
        match=match,
        first_diff=None if match in (None, True) else 3,
        error=error,
    )


def synthetic_records():
    recs = []
    for i, (cat, vt) in enumerate([("qa", 1.0), ("qa", 2.0), ("rag", 4.0), (bq.MULTI_TURN, 1.0)]):
        recs.append(_record("vanilla", cat, i, vt, vt))
        recs.append(_record("ngram", cat, i, vt / (i + 1), vt, steps=5, drafted=10, accepted=i + 1, match=i != 2))
        recs.append(_record("hf-prompt-lookup", cat, i, vt, vt, match=True))
        recs.append(_record("sampler", cat, i, 0, vt, error="NotImplementedError: do_sample=True\nmore"))
    return recs


def test_summary_aggregates_per_method_and_category():
    rows = {(r["method"], r["category"]): r for r in summarize(synthetic_records())}
    qa = rows[("ngram", "qa")]
    assert qa["prompts"] == 2 and qa["median_speedup"] == pytest.approx(statistics.median([1.0, 2.0]))
    assert qa["tau"] == pytest.approx(1 + 3 / 10) and qa["acceptance_rate"] == pytest.approx(3 / 20)
    assert qa["tokens_per_s"] == pytest.approx(20 / (1.0 + 1.0))
    overall = rows[("ngram", OVERALL)]
    assert overall["median_speedup"] == pytest.approx(statistics.median([1, 2, 3, 4]))
    assert overall["mismatches"] == 1 and overall["checked"] == 4
    assert rows[("hf-prompt-lookup", OVERALL)]["tau"] is None, "transformers' methods have no τ"
    assert rows[("vanilla", OVERALL)]["mismatches"] is None
    failed = rows[("sampler", OVERALL)]
    assert failed["errors"] == 4 and failed["median_speedup"] is None and failed["error"].startswith("NotImpl")
    order = [r["category"] for r in summarize(synthetic_records()) if r["method"] == "ngram"]
    assert order == [bq.MULTI_TURN, "qa", "rag", OVERALL]


def test_results_writer_produces_markdown_json_and_png(tmp_path):
    recs = synthetic_records()
    paths = write_results(tmp_path / "out", recs, {"model": "tiny", "batch": 1})
    md = paths["md"].read_text()
    assert "| ngram | **overall** | 4 |" in md
    assert "**1/4**" in md, "mismatches must be visible"
    assert "4/4 failed: NotImplementedError: do_sample=True |" in md
    data = json.loads(paths["json"].read_text())
    assert data["meta"]["model"] == "tiny" and len(data["records"]) == len(recs)
    assert {r["method"] for r in data["summary"]} == {"vanilla", "ngram", "hf-prompt-lookup", "sampler"}
    assert paths["png"].read_bytes()[:4] == b"\x89PNG"
    assert markdown_report(summarize(recs), {}).count("## greedy") == 1


def test_cli_parser_knows_the_subcommands():
    parser = build_parser()
    args = parser.parse_args(["bench", "--methods", "ngram", "--per-category", "2", "--batch", "4", "--do-sample"])
    assert args.methods == "ngram" and args.per_category == 2 and args.batch == 4 and args.do_sample
    args = parser.parse_args(["generate", "hi", "--assistant", "draft"])
    assert args.question == "hi" and args.assistant == "draft"
    assert parser.parse_args(["generate", "hi", "--assistant", "medusa"]).assistant == "medusa"
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "hi", "--assistant", "nope"])


def test_sampling_settings():
    names = [s.name for s in settings_for(sample=True)]
    assert names[0] == "greedy" and len(names) == 3
    assert all(s.kwargs["do_sample"] and s.kwargs["top_p"] == 0.9 for s in settings_for(True)[1:])


# ------------------------------------------------------------------------------------------------ smoke run
@needs_loop
def test_null_assistant_reproduces_vanilla_and_drafts_nothing():
    model = tiny_causal_lm("llama")
    ids = torch.randint(3, 97, (1, 12))
    ref = model.generate(ids, max_new_tokens=10, do_sample=False)
    out = model.generate(
        ids, max_new_tokens=10, do_sample=False, assistant=NullAssistant(), return_dict_in_generate=True
    )
    assert torch.equal(out.sequences, ref)
    assert out.spec_stats.drafted_tokens == 0 and out.spec_stats.tau == 1.0


@needs_loop
@pytest.mark.parametrize("batch", [1, 3])
def test_bench_smoke_run_on_a_tiny_model(batch):
    from hf_specdec.models import draft_model_from_layers

    model = tiny_causal_lm("llama", num_layers=2)
    gen = torch.Generator().manual_seed(0)
    prompts = [
        # a repetitive prompt gives the n-gram methods something to copy
        Prompt(i, cat, torch.cat([torch.randint(3, 97, (n,), generator=gen)] * 2))
        for i, (cat, n) in enumerate([("qa", 5), ("rag", 9), ("qa", 3)])
    ]
    methods = resolve_methods(list(METHODS))
    records = run_bench(
        model,
        prompts,
        methods,
        settings_for(sample=False),
        max_new_tokens=8,
        batch=batch,
        draft_factory=lambda: draft_model_from_layers(model, 1),
        draft_vocab=torch.arange(0, 97, 2) if batch > 1 else None,  # the draft method over a draft vocabulary too
    )
    groups = -(-len(prompts) // batch)
    assert len(records) == groups * len(methods)
    by_method = {}
    for r in records:
        by_method.setdefault(r["method"], []).append(r)
    for name in ("ngram", "draft", "null"):
        for r in by_method[name]:
            assert r["error"] is None, r["error"]
            assert r["match"], f"{name} differs from vanilla at generated token {r['first_diff']}"
            assert r["steps"] >= 1 and r["speedup"] > 0
            assert r["time_propose"] > 0 and r["time_verify"] > 0  # the step-time section's figures
    for r in by_method["null"]:
        assert r["drafted"] == 0
    for name in ("hf-prompt-lookup", "hf-assisted"):
        for r in by_method[name]:
            # transformers' assisted generation refuses batches; that must show up as an error, not a crash
            assert r["error"] is not None or (r["match"] is not None and r["steps"] is None)
    summary = summarize(records)
    assert {r["method"] for r in summary} == set(METHODS)
    assert "| null | **overall** |" in markdown_report(summary, {})


@needs_loop
def test_bench_records_sampling_failures_instead_of_crashing():
    from hf_specdec.bench.methods import Method

    def refusing(ctx):
        raise NotImplementedError("do_sample=True is not implemented for this assistant")

    model = tiny_causal_lm("llama")
    methods = [METHODS["vanilla"], Method("refuses", "always raises", refusing, spec_stats=True), METHODS["null"]]
    prompts = [Prompt(0, "qa", torch.randint(3, 97, (6,)))]
    records = run_bench(model, prompts, methods, settings_for(sample=True, greedy=False), max_new_tokens=4)
    assert len(records) == 2 * 3
    refused = [r for r in records if r["method"] == "refuses"]
    assert all("NotImplementedError" in r["error"] for r in refused)
    assert all(r["match"] is None for r in records), "sampled outputs are not compared token by token"


@needs_loop
def test_an_interrupted_bench_keeps_every_finished_prompt(tmp_path):
    """run_bench hands the records over after every prompt; written as they come, an interruption loses nothing."""
    model = tiny_causal_lm("llama", num_layers=1)
    prompts = [Prompt(i, "qa", torch.tensor([5, 6, 7, 8, 5, 6, 7])) for i in range(3)]
    methods = resolve_methods(["vanilla", "ngram"])
    seen: list[int] = []

    def on_prompt(records):
        seen.append(len(records))
        write_results(tmp_path, records, {"model": "tiny", "complete": False}, plot=False)
        if len(seen) == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_bench(model, prompts, methods, settings_for(sample=False), max_new_tokens=4, on_prompt=on_prompt)
    assert seen == [2, 4]
    data = json.loads((tmp_path / "results.json").read_text())
    assert len(data["records"]) == 4 and data["meta"]["complete"] is False
    assert "partial results" in (tmp_path / "results.md").read_text()
    assert not list(tmp_path.glob("*.tmp"))


@needs_loop
def test_mismatches_say_whether_the_near_tie_oracle_explains_them():
    """A greedy output that leaves vanilla's where vanilla's two best logits are equal is flagged as a near-tie; one
    that leaves it where they are far apart is not (`testing.near_tie`), and the report counts the near-ties."""
    from hf_specdec.bench.methods import Method

    model = tiny_causal_lm("llama", num_layers=2)
    prompt = Prompt(0, "qa", torch.randint(3, 97, (8,), generator=torch.Generator().manual_seed(1)))
    first = int(model.generate(prompt.ids[None], max_new_tokens=1, do_sample=False)[0, -1])
    banning = Method("bans-first", "never emits vanilla's first token", lambda ctx: {"bad_words_ids": [[first]]})
    methods = [METHODS["vanilla"], banning]

    far = run_bench(model, [prompt], methods, settings_for(sample=False), max_new_tokens=4, warmup=False)[1]
    assert far["match"] is False and far["near_tie"] is False

    twin = first + 1 if first + 1 < model.config.vocab_size else first - 1  # a token whose logit always equals it
    with torch.no_grad():
        model.get_output_embeddings().weight[twin] = model.get_output_embeddings().weight[first]
    assert int(model.generate(prompt.ids[None], max_new_tokens=1, do_sample=False)[0, -1]) == min(first, twin)
    if twin < first:  # vanilla now picks the twin (the lower index of a tie): ban that one instead
        methods[1] = Method("bans-twin", "", lambda ctx: {"bad_words_ids": [[twin]]})
    records = run_bench(model, [prompt], methods, settings_for(sample=False), max_new_tokens=4, warmup=False)
    assert records[1]["match"] is False and records[1]["near_tie"] is True
    overall = {r["method"]: r for r in summarize(records) if r["category"] == OVERALL}[methods[1].name]
    assert overall["mismatches"] == 1 and overall["near_ties"] == 1
    assert "1/1 (1 near-ties)" in markdown_report(summarize(records), {})
