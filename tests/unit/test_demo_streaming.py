"""The demo's token following: per-step groups, token origins, cancellation, the per-model lock, token texts."""

from __future__ import annotations

import threading

import pytest
import torch

from hf_specdec.demo.streaming import DRAFTED, TARGET, IncrementalText, follow_generate, mark_origins
from hf_specdec.generation.proposers.ngram import NgramAssistant
from hf_specdec.testing import tiny_causal_lm


def repeating_prompt() -> torch.Tensor:
    return torch.tensor([[5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8, 9, 10, 11, 5, 6, 7]])  # [1, 17]


def run(model, kwargs, cancel=None, lock=None):
    ids = repeating_prompt()
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    progress = list(follow_generate(model, inputs, kwargs, cancel, lock))[-1]
    assert progress.done and progress.error is None, progress.error
    return progress


def test_speculative_groups_rebuild_the_output_and_give_each_tokens_origin():
    model = tiny_causal_lm("llama")
    kwargs = {"max_new_tokens": 40, "do_sample": False, "return_dict_in_generate": True}
    vanilla = run(model, kwargs)
    spec = run(model, {**kwargs, "assistant": NgramAssistant()})
    ids = repeating_prompt()
    generated = spec.output.sequences[0, ids.shape[1] :].tolist()
    assert spec.tokens == generated == vanilla.tokens
    assert all(len(g) == 1 for g in vanilla.steps)
    stats = spec.output.spec_stats
    origins = mark_origins(spec.steps, True, stats.accepted_tokens)
    assert len(origins) == len(generated)
    assert origins.count(DRAFTED) == stats.accepted_tokens > 0
    assert origins.count(TARGET) == len(generated) - stats.accepted_tokens
    assert mark_origins(vanilla.steps, False) == [TARGET] * len(vanilla.tokens)


def test_a_last_step_cut_short_is_marked_as_drafted():
    # steps: prefill token, then 3 drafted + own, then a step cut after 2 drafted tokens by the token budget
    steps = [[1], [2, 3, 4, 5], [6, 7]]
    assert mark_origins(steps, True, accepted_tokens=5) == [TARGET] + [DRAFTED] * 3 + [TARGET] + [DRAFTED] * 2
    assert mark_origins(steps, True, accepted_tokens=4) == [TARGET] + [DRAFTED] * 3 + [TARGET, DRAFTED, TARGET]


def test_cancel_stops_the_call_within_a_step():
    model = tiny_causal_lm("llama")
    cancel = threading.Event()
    cancel.set()
    progress = run(model, {"max_new_tokens": 200, "do_sample": False, "assistant": NgramAssistant()}, cancel)
    assert 1 <= len(progress.tokens) < 200


def test_a_held_lock_makes_the_call_wait_and_reports_waiting():
    model = tiny_causal_lm("llama")
    lock = threading.Lock()
    lock.acquire()
    ids = repeating_prompt()
    follow = follow_generate(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                             {"max_new_tokens": 8, "do_sample": False}, None, lock)  # fmt: skip
    first = next(follow)
    assert not first.started and not first.tokens
    lock.release()
    last = list(follow)[-1]
    assert last.done and last.started and len(last.tokens) == 8


def test_an_abandoned_follow_cancels_its_call():
    model = tiny_causal_lm("llama")
    cancel = threading.Event()
    ids = repeating_prompt()
    follow = follow_generate(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                             {"max_new_tokens": 500, "do_sample": False}, cancel)  # fmt: skip
    next(follow)
    follow.close()
    assert cancel.is_set()


class ByteTokenizer:
    """Tokens are UTF-8 bytes: a multi-byte character spans several tokens, as in byte-level BPE."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def test_incremental_text_keeps_multibyte_characters_whole():
    text = IncrementalText(ByteTokenizer())
    ids = list("añb€".encode())
    pieces = text.extend(ids[:2]) + text.extend(ids[2:])
    assert pieces == ["a", "", "ñ", "b", "", "", "€"]
    assert "".join(pieces) == text.text == "añb€"


# ------------------------------------------------------------------ the bound on a speedup and how the page shows it
def _timed(prefill_s: float, step_s: float, steps: int) -> float:
    return prefill_s + steps * step_s


def test_the_bound_is_tau_for_greedy_output_and_holds_whatever_the_costs():
    from hf_specdec.demo.bounds import Pair, speedup_bound

    # greedy: 1 + steps + accepted tokens on both sides, vanilla one decode forward per token after the first
    steps, accepted = 12, 20
    tokens = 1 + steps + accepted
    bound = speedup_bound([Pair(2.0, tokens, tokens - 1, tokens, steps)])
    assert bound == pytest.approx(1 + accepted / steps)  # τ
    gen = torch.Generator().manual_seed(0)
    for _ in range(300):  # any prefill, decode and verify cost with verify >= decode stays under the bound
        prefill, decode = (torch.rand(2, generator=gen) * torch.tensor([5.0, 0.2])).tolist()
        verify = decode * (1 + 3 * torch.rand(1, generator=gen).item())
        pairs, t_van, t_spec, n_van, n_spec = [], 0.0, 0.0, 0, 0
        for _q in range(3):
            n_v = int(torch.randint(2, 60, (1,), generator=gen))
            n_s = int(torch.randint(2, 60, (1,), generator=gen))  # sampling: the lengths may differ
            s = int(torch.randint(1, n_s, (1,), generator=gen))
            tv, ts = _timed(prefill, decode, n_v - 1), _timed(prefill, verify, s)
            pairs.append(Pair(tv, n_v, n_v - 1, n_s, s))
            t_van, t_spec, n_van, n_spec = t_van + tv, t_spec + ts, n_van + n_v, n_spec + n_s
        assert (n_spec / t_spec) / (n_van / t_van) <= speedup_bound(pairs) * (1 + 1e-9)
    # a verify step measured cheaper than a decode step (a disturbed timing) goes above it
    tv, ts = _timed(0.5, 0.1, tokens - 1), _timed(0.5, 0.05, steps)
    assert tv / ts > speedup_bound([Pair(tv, tokens, tokens - 1, tokens, steps)])


def test_a_speedup_above_its_bound_is_rendered_with_the_flag():
    from hf_specdec.demo.bounds import Pair, Spread, speedup_bound
    from hf_specdec.demo.render import FLAG, bench_line, speedup_text, spread_text

    # the case: eagle 1.52x with τ 1.00 and nothing accepted
    bound = speedup_bound([Pair(10.0, 64, 63, 64, 63)])
    assert bound == 1.0
    assert speedup_text(1.52, bound) == f"1.52× {FLAG} 1.00×"
    assert speedup_text(0.97, bound) == "0.97×" and speedup_text(1.004, bound) == "1.00×"
    assert FLAG in spread_text(Spread.of([0.9, 1.0, 1.3]), bound) and spread_text(Spread.of([0.9]), bound) == ""
    row = {"method": "eagle", "questions": 2, "of": 2, "status": "done", "tokens_per_s": 12.0, "speedup": 1.52,
           "spread": Spread.of([1.40, 1.52]), "tau": 1.0, "bound": bound, "acceptance": 0.0, "identical": "2/2"}  # fmt: skip
    line = bench_line(row)
    speedup_cell = line.split("|")[4]
    assert "1.52×" in speedup_cell and FLAG in speedup_cell
    assert FLAG not in bench_line({**row, "speedup": 0.95, "spread": Spread.of([0.9, 0.95])})

    from hf_specdec.demo.render import bench_chart

    ngram = {**row, "method": "ngram", "speedup": 1.35, "bound": 1.69, "tau": 1.82, "spread": Spread.of([0.84, 1.94])}
    ax = bench_chart([{"method": "vanilla", "status": "done"}, ngram, row], "writing").axes[0]
    bars = {t.get_text(): b for t, b in zip(ax.get_yticklabels(), ax.patches)}
    assert bars["eagle"].get_hatch() == "//" and not bars["ngram"].get_hatch()  # only the bar above its bound
    assert [t.get_text().strip() for t in ax.texts] == ["⚠ above bound"] and ax.get_xlim()[1] > 1.94


def test_the_compare_summary_flags_an_impossible_speedup_and_speaks_of_noise():
    from hf_specdec.demo.compare import summary_markdown
    from hf_specdec.demo.render import FLAG

    spec = {"tau": 1.0, "steps": 63, "acceptance_rate": 0.0, "drafted_tokens": 40, "new_tokens": 64}
    details = {"speedup": 1.52, "bound": 1.0, "speedup_per_run": [1.52], "cancelled": False, "do_sample": False,
               "identical_to_vanilla": True, "speculative": spec,
               "tokens_per_s_per_run": {"vanilla": [4.1], "speculative": [6.2]}}  # fmt: skip
    text = summary_markdown(details)
    assert FLAG in text.splitlines()[0] and "not a gain from drafting" in text and "one run each" in text
    slow = summary_markdown({**details, "speedup": 0.67, "speedup_per_run": [0.6, 0.67, 0.8],
                             "tokens_per_s_per_run": {"vanilla": [10, 9, 8], "speculative": [6.7, 6, 6]}})  # fmt: skip
    assert FLAG not in slow and "0.60× – 0.80×" in slow and "noise" in slow and "Slower than vanilla" in slow


def test_the_sampling_message_says_what_a_shared_seed_means():
    from hf_specdec.demo.compare import summary_markdown

    spec = {"tau": 1.5, "steps": 10, "acceptance_rate": 0.5, "drafted_tokens": 10, "new_tokens": 16}
    details = {"speedup": 1.1, "bound": 1.5, "speedup_per_run": [1.1], "cancelled": False, "do_sample": True,
               "seed": 7, "identical_to_vanilla": True, "speculative": spec,
               "tokens_per_s_per_run": {"vanilla": [10], "speculative": [11]}}  # fmt: skip
    same = summary_markdown(details)
    assert "same seed" in same and "seed 7" in same and "peaked" not in same
    differ = summary_markdown({**details, "identical_to_vanilla": False})
    assert "the texts differ" in differ and "same seed" in differ


# ------------------------------------------------------------------ the Benchmark tab's runner: Stop keeps what finished
def _bench_runner(cancel_after: str, repeats: int = 1):
    from hf_specdec.bench.methods import resolve_methods
    from hf_specdec.bench.spec_bench import Prompt
    from hf_specdec.demo.bench_tab import Runner

    model = tiny_causal_lm("llama")
    prompts = [Prompt(q, "writing", repeating_prompt()[0] + q) for q in range(3)]
    cancel, lines = threading.Event(), []

    def log(line: str) -> None:
        lines.append(line)
        if cancel_after in line:
            cancel.set()

    runner = Runner(model, prompts, resolve_methods(["vanilla", "ngram", "suffix"]), 12, repeats, cancel, log)
    runner.warm_up()
    runner.run()
    return runner, lines


def test_stop_in_the_benchmark_keeps_the_finished_lines_and_marks_only_the_rest_stopped():
    from hf_specdec.demo.render import bench_table

    # question 1 runs vanilla, ngram, suffix in turn: Stop right after ngram's call
    runner, lines = _bench_runner("q1/3 run 1/1: ngram")
    assert runner.stopped and "question 1/3 done" not in lines
    rows = {r["method"]: r for r in runner.board.rows(stopped=True)}
    assert rows["vanilla"]["status"] == rows["ngram"]["status"] == "done"
    assert rows["ngram"]["questions"] == 1 and rows["ngram"]["speedup"] > 0 and rows["ngram"]["identical"] == "1/1"
    assert rows["suffix"]["status"] == "stopped" and rows["suffix"]["error"] is None
    table = bench_table(list(rows.values()), "writing")
    assert "error" not in table and "| suffix | 0/3 | stopped |" in table and "| ngram | 1/3 |" in table


def test_the_benchmark_warms_up_then_interleaves_the_methods_on_each_question():
    runner, lines = _bench_runner("never", repeats=2)
    assert not runner.stopped
    warm = [i for i, line in enumerate(lines) if "warm-up" in line]
    timed = [line.split(": ")[1].split()[0] for line in lines if " run " in line]
    assert len(warm) == 3 and max(warm) < min(i for i, line in enumerate(lines) if " run " in line)
    assert timed[:6] == ["vanilla", "ngram", "suffix", "ngram", "suffix", "vanilla"]  # turns rotate
    for row in runner.board.rows():
        assert row["status"] == "done" and row["questions"] == 3
        if row["method"] != "vanilla":
            assert row["spread"].n == 2
            # greedy: each question's bound is its τ, or less where the budget cut an accepted draft short; over
            # the questions the bound weighs them by vanilla's time
            calls = [c for (m, _q), cs in runner.board.calls.items() if m == row["method"] for c in cs]
            assert 1.0 <= row["bound"] <= max(1 + c.accepted / c.steps for c in calls) + 1e-9
