"""The bench report's tree-budget section: the machine's verify cost curve and the tree sizes chosen per method."""

from hf_specdec.bench.report import budgets_by_method, cost_curve_section, markdown_report, summarize


def _record(method: str, nodes_per_row: dict | None) -> dict:
    return {
        "method": method,
        "setting": "greedy",
        "category": "qa",
        "question_id": 1,
        "batch": 1,
        "new_tokens": 10,
        "time_s": 1.0,
        "vanilla_time_s": 1.2,
        "vanilla_new_tokens": 10,
        "speedup": 1.2,
        "steps": 5,
        "drafted": 4,
        "accepted": 3,
        "match": True,
        "first_diff": None,
        "error": None,
        "nodes_per_row": nodes_per_row,
    }


def test_budgets_are_summed_over_prompts_per_method():
    records = [_record("ngram", {0: 3, 2: 1}), _record("ngram", {"0": 1, "5": 2}), _record("vanilla", None)]
    assert budgets_by_method(records) == {"ngram / greedy": {0: 4, 2: 1, 5: 2}}


def test_report_prints_the_cost_curve_and_the_budgets():
    verify_cost = {"curve": {1: 0.020, 4: 0.026}, "samples": {1: 16, 4: 3}, "one_token_s": 0.020}
    budgets = {"ngram / greedy": {0: 6, 3: 2}}
    section = cost_curve_section(verify_cost, budgets)
    assert "| 4 | 26.0 | 1.30 | 3 |" in section
    assert "| ngram / greedy | 0.8 | 75% | 0 (75%), 3 (25%) |" in section
    records = [_record("ngram", {0: 6, 3: 2})]
    report = markdown_report(summarize(records), {"verify_cost": verify_cost, "budgets": budgets_by_method(records)})
    assert "Verify cost on this machine" in report and "| 1 | 20.0 | 1.00 | 16 |" in report


def test_per_depth_acceptance_is_pooled_over_prompts_and_sums_to_tau_minus_one():
    from hf_specdec.bench.report import depth_acceptance_by_method, depth_acceptance_section

    a = {**_record("eagle", None), "steps": 10, "accepted": 7, "accepted_per_depth": [5, 2]}
    b = {**_record("eagle", None), "steps": 30, "accepted": 12, "accepted_per_depth": [9, 2, 1]}
    plain = {**_record("vanilla", None), "steps": None, "accepted_per_depth": None}
    shares = depth_acceptance_by_method([a, b, plain])
    assert list(shares) == ["eagle / greedy"]
    assert shares["eagle / greedy"] == [14 / 40, 4 / 40, 1 / 40]
    assert abs(sum(shares["eagle / greedy"]) - (7 + 12) / 40) < 1e-12  # tau - 1 = accepted / steps
    section = depth_acceptance_section(shares)
    assert "| eagle / greedy | 0.350 | 0.100 | 0.025 |" in section
    report = markdown_report(summarize([a, b]), {"depth_acceptance": shares})
    assert "## Per-depth acceptance" in report


def test_step_times_are_pooled_per_verify_step_and_rendered():
    from hf_specdec.bench.report import step_times_by_method

    a = {**_record("dflash", None), "steps": 10, "time_propose": 0.05, "time_verify": 0.9, "time_other": 0.05}
    b = {**_record("dflash", None), "steps": 30, "time_propose": 0.15, "time_verify": 2.7, "time_other": 0.15}
    old = _record("eagle", None)  # a record written before the times were recorded
    plain = {**_record("vanilla", None), "steps": None, "time_propose": None}
    times = step_times_by_method([a, b, old, plain])
    assert list(times) == ["dflash / greedy"]
    t = times["dflash / greedy"]
    assert t["steps"] == 40 and abs(t["draft_ms"] - 5.0) < 1e-9 and abs(t["verify_ms"] - 90.0) < 1e-9
    assert abs(t["draft_share"] - 0.05) < 1e-9
    report = markdown_report(summarize([a, b]), {"step_times": times})
    assert "## Time per step" in report and "| dflash / greedy | 40 | 5.00 | 90.00 | 5.00 | 5% |" in report
