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


# ------------------------------------------------------------------ what a speedup is made of: τ and the step cost
def test_the_step_cost_makes_up_the_speedup_and_tau_is_no_ceiling():
    from hf_specdec.demo.speed import Pair, step_cost

    gen = torch.Generator().manual_seed(0)
    for _ in range(100):  # speedup = (tokens / steps) / step cost, whatever the timings and counts
        pairs = []
        for _q in range(3):
            n_v, n_s = (int(x) for x in torch.randint(2, 60, (2,), generator=gen))
            steps = int(torch.randint(1, n_s, (1,), generator=gen))
            t_v, t_s = (0.1 + torch.rand(2, generator=gen) * 5).tolist()
            pairs.append((Pair(t_v, n_v, t_s, steps), n_s))
        speedup = (sum(n for _p, n in pairs) / sum(p.spec_s for p, _n in pairs)) / (
            sum(p.vanilla_tokens for p, _n in pairs) / sum(p.vanilla_s for p, _n in pairs)
        )
        tokens_per_step = sum(n for _p, n in pairs) / sum(p.spec_steps for p, _n in pairs)
        assert speedup == pytest.approx(tokens_per_step / step_cost([p for p, _n in pairs]))
    # a verify step cheaper than a decode step (the few-rows GEMM on packed weights): a speedup above τ is a
    # measurement, not an error
    steps, accepted = 12, 20
    tokens = 1 + steps + accepted  # greedy, τ = 1 + 20 / 12 = 2.67
    t_van, t_spec = 0.05 + 0.1 * (tokens - 1), 0.05 + 0.072 * steps  # prefill, then decode / verify steps
    cost = step_cost([Pair(t_van, tokens, t_spec, steps)])
    assert cost < 1 and t_van / t_spec > 1 + accepted / steps
    assert step_cost([Pair(1.0, 10, 1.0, 0)]) is None  # no verification step: nothing to measure


def test_no_bound_and_no_flag_are_rendered_but_the_step_cost_is():
    from hf_specdec.demo.render import bench_chart, bench_line, bench_table, speedup_text, spread_text
    from hf_specdec.demo.speed import Spread

    assert speedup_text(1.52) == "1.52×" and speedup_text(None) == "n/a"
    assert spread_text(Spread.of([0.9, 1.0, 1.3])) == "0.90× – 1.30× (median 1.00×, 3 runs)"
    assert spread_text(Spread.of([0.9])) == ""
    row = {"method": "eagle", "questions": 2, "of": 2, "status": "done", "tokens_per_s": 12.0, "speedup": 1.52,
           "spread": Spread.of([1.40, 1.52]), "tau": 1.3, "step_cost": 0.86, "acceptance": 0.2, "identical": "2/2"}  # fmt: skip
    cells = [c.strip() for c in bench_line(row).split("|")[1:-1]]
    assert cells[3] == "**1.52×**" and cells[5] == "1.30" and cells[6] == "0.86×"
    table = bench_table([{"method": "vanilla", "questions": 2, "of": 2, "status": "done", "tokens_per_s": 8.0}, row],
                        "writing")  # fmt: skip
    assert "step cost" in table and "bound" not in table and "⚠" not in table
    ngram = {**row, "method": "ngram", "speedup": 1.35, "tau": 1.82, "spread": Spread.of([0.84, 1.94])}
    ax = bench_chart([{"method": "vanilla", "status": "done"}, ngram, row], "writing").axes[0]
    assert not ax.texts and not any(b.get_hatch() for b in ax.patches) and ax.get_xlim()[1] > 1.94
    assert "bound" not in ax.get_xlabel()


def test_the_compare_summary_explains_a_speedup_above_tau_by_the_step_cost():
    from hf_specdec.demo.compare import summary_markdown

    spec = {"tau": 1.3, "steps": 49, "acceptance_rate": 0.2, "accepted_tokens": 15, "drafted_tokens": 75,
            "new_tokens": 64}  # fmt: skip
    details = {"speedup": 1.52, "step_cost": 0.86, "tokens_per_step": 1.31,
               "step_cost_split": {"drafting": 0.1, "verifying": 0.75, "other": 0.01},
               "speedup_per_run": [1.52], "cancelled": False, "do_sample": False, "identical_to_vanilla": True,
               "speculative": spec, "tokens_per_s_per_run": {"vanilla": [4.1], "speculative": [6.2]}}  # fmt: skip
    text = summary_markdown(details)
    assert text.splitlines()[0].startswith("### Speedup: **1.52×**") and "one run each" in text
    assert "**0.86×** vanilla's time per token (drafting 0.10×, verifying 0.75×)" in text
    assert "speedup = 1.31 output tokens per step ÷ 0.86 (about τ ÷ step cost)" in text
    assert "not a ceiling" in text and "bound" not in text and "⚠" not in text
    slow = summary_markdown({**details, "speedup": 0.67, "step_cost": 1.9, "speedup_per_run": [0.6, 0.67, 0.8],
                             "tokens_per_s_per_run": {"vanilla": [10, 9, 8], "speculative": [6.7, 6, 6]}})  # fmt: skip
    assert "0.60× – 0.80×" in slow and "noise" in slow and "Slower than vanilla" in slow and "1.90×" in slow


# ------------------------------------------------------------------ accepted draft tokens: as spec_stats counts them
def test_accepted_draft_tokens_cut_after_the_end_are_said_and_the_counts_agree_with_spec_stats():
    """The issue's off-by-one: the loop counts a draft token as accepted once verification accepts it, also when an
    end-of-text token earlier in the same accepted draft ends the answer before it. The page showed the acceptance
    rate of spec_stats (those included) next to the accepted draft tokens of the output (those excluded)."""
    from hf_specdec.demo.compare import acceptance_lines
    from hf_specdec.demo.render import origin_counts
    from hf_specdec.testing import OracleProposer

    model = tiny_causal_lm("llama")
    ids = repeating_prompt()
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    free = model.generate(**inputs, max_new_tokens=12, do_sample=False, eos_token_id=None)[0, ids.shape[1] :].tolist()
    eos = next(t for i, t in enumerate(free) if i >= 1 and t not in free[:i])  # ends the answer inside a draft
    kwargs = {"max_new_tokens": 12, "do_sample": False, "eos_token_id": eos, "return_dict_in_generate": True,
              "assistant": OracleProposer(model, depth=8)}  # fmt: skip
    spec = list(follow_generate(model, inputs, kwargs))[-1]
    assert spec.done and spec.error is None, spec.error
    stats = spec.output.spec_stats
    drafted, own = origin_counts(mark_origins(spec.steps, True, stats.accepted_tokens))
    assert spec.tokens[-1] == eos and drafted + own == len(spec.tokens)
    assert stats.accepted_tokens > drafted  # accepted draft tokens after the EOS: counted, not in the output
    side = {"new_tokens": len(spec.tokens), "drafted_tokens_emitted": drafted, **stats.to_dict()}
    tau_line, output_line = acceptance_lines(side)
    cut = stats.accepted_tokens - drafted
    # both figures of the first line are spec_stats' and say their counts: τ = 1 + accepted / steps, rate =
    # accepted / drafted
    assert f"τ = {stats.tau:.2f}** tokens per verify step (1 + {stats.accepted_tokens} accepted draft tokens / " \
           f"{stats.steps} steps)" in tau_line  # fmt: skip
    assert f"acceptance rate {stats.acceptance_rate:.2f} = {stats.accepted_tokens} of {stats.drafted_tokens} " \
           "drafted tokens accepted" in tau_line  # fmt: skip
    assert f"{drafted} of {len(spec.tokens)} tokens are accepted draft tokens; {cut} more accepted draft token" \
           in output_line and "after the answer ended" in output_line  # fmt: skip
    # nothing cut: no such remark
    assert acceptance_lines({**side, "drafted_tokens_emitted": stats.accepted_tokens})[1].endswith(
        "tokens are accepted draft tokens"
    )


# ------------------------------------------------------------------ the two sides run one after the other
def test_the_comparison_runs_vanilla_then_speculative_never_both_at_once():
    """The two calls are timed one after the other (measured: run at once on 2 cores each lost about a third of its
    tokens/s), each streaming into its pane; the page says so."""
    from hf_specdec.demo.compare import Request, compare
    from hf_specdec.testing import tiny_chat_tokenizer

    model = tiny_causal_lm("llama")
    tokenizer = tiny_chat_tokenizer("copy this text please : a b c d e f g a b c d e f g".split())
    req = Request(prompts=("copy this text please : a b c d e f g a b c d e f g",), method="ngram", max_new_tokens=24)
    views = [(v.vanilla_html, v.speculative_html, v.summary) for v in compare(model, tokenizer, req)]
    vanilla_done = [i for i, (van, _s, _m) in enumerate(views) if van and "running…" not in van]
    spec_seen = [i for i, (_v, spec, _m) in enumerate(views) if spec]
    assert vanilla_done and spec_seen and min(vanilla_done) < min(spec_seen)
    assert all("running…" not in views[i][0] for i in spec_seen)  # vanilla had finished before any spec update
    assert len([i for i, (van, _s, _m) in enumerate(views) if van]) >= 2  # vanilla streamed into its pane
    import hf_specdec.demo.compare as compare_module

    assert "one after the other" in compare_module.__doc__


def test_the_sampling_message_says_what_a_shared_seed_means():
    from hf_specdec.demo.compare import summary_markdown

    spec = {"tau": 1.5, "steps": 10, "acceptance_rate": 0.5, "accepted_tokens": 5, "drafted_tokens": 10,
            "new_tokens": 16}  # fmt: skip
    details = {"speedup": 1.1, "step_cost": 1.45, "tokens_per_step": 1.6, "speedup_per_run": [1.1], "cancelled": False,
               "do_sample": True, "seed": 7, "identical_to_vanilla": True, "speculative": spec,
               "tokens_per_s_per_run": {"vanilla": [10], "speculative": [11]}}  # fmt: skip
    same = summary_markdown(details)
    assert "same seed" in same and "seed 7" in same and "peaked" not in same
    differ = summary_markdown({**details, "identical_to_vanilla": False})
    assert "the texts differ" in differ and "same seed" in differ


# ------------------------------------------------------------------ the Benchmark tab's runner: Stop keeps what finished
def _bench_runner(cancel_after: str, repeats: int = 1, on_vanilla=None):
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

    methods = resolve_methods(["vanilla", "ngram", "suffix"])
    runner = Runner(model, prompts, methods, 12, repeats, cancel, log, on_vanilla)
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
            assert row["step_cost"] > 0 and "bound" not in row


def test_stop_during_the_warm_up_says_nothing_was_measured_instead_of_empty_lines():
    from hf_specdec.demo.bench_tab import _final

    runner, lines = _bench_runner("warm-up 2/3")  # Stop as ngram's warm-up call starts
    assert runner.stopped and not runner.warmed_up and not runner.board.calls
    log, results, chart = _final(runner, "\n".join(lines), "writing")
    assert "Stopped by the user during the warm-up: nothing was measured" in results
    assert "|" not in results and "0/3" not in results and chart is None  # no lines of zeros, no empty chart
    assert log.endswith("stopped by the user during the warm-up; nothing was measured.")
    # stopped after the warm-up, before any method finished a question: said as plainly
    runner, lines = _bench_runner("q1/3 run 1/1: vanilla")
    assert runner.warmed_up and runner.board.calls
    assert "before any method finished a question: nothing was measured" in _final(runner, "", "writing")[1]


def test_the_benchmark_estimates_its_time_before_and_while_it_runs():
    from hf_specdec.demo.bench_tab import _header, duration_text, estimate_text

    assert duration_text(42.4) == "42 s" and duration_text(200) == "3 min 20 s" and duration_text(3900) == "1 h 05 min"
    # 2 questions × 2 runs × 4 calls × 64 tokens + 4 warm-up calls × 16 tokens = 1088 tokens at 10 tokens/s
    known = estimate_text(3, 2, 64, 2, 10.0)
    assert "up to about 1 min 49 s" in known and "10.0 tokens/s" in known and "2 question(s) × 2 run(s)" in known
    unknown = estimate_text(3, 2, 64, 2, None)
    assert "not known yet" in unknown and "after its first question" in unknown
    assert "after the first question" in _header(2, "writing", ["ngram"], 64, 2, None)
    assert "up to about" in _header(2, "writing", ["ngram"], 64, 2, 10.0)
    seen = []
    runner, lines = _bench_runner("never", on_vanilla=lambda tokens, seconds: seen.append((tokens, seconds)))
    done = [line for line in lines if line.startswith("question ")]
    assert [d.split(" done")[0] for d in done] == ["question 1/3", "question 2/3", "question 3/3"]
    assert all(" left" in d for d in done[:2]) and done[2] == "question 3/3 done"  # updated as questions finish
    assert len(seen) == 3 and all(n > 0 and s > 0 for n, s in seen)  # vanilla's speed, for the next estimate
