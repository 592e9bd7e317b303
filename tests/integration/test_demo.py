"""The Gradio demo launched in-process on 127.0.0.1 and driven through gradio_client, as a remote user would."""

from __future__ import annotations

import socket
import threading

import pytest
import torch

gradio_client = pytest.importorskip("gradio_client", reason="the demo extra is not installed (pip install .[demo])")

from hf_specdec.assistants import available_assistants  # noqa: E402
from hf_specdec.models import chat_prompt_ids  # noqa: E402

pytestmark = pytest.mark.slow

# n-gram copying finds this text in the prompt, so the speculative path accepts long drafts (tau well above 1)
COPY_PROMPT = (
    "Repeat this text exactly: The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins "
    "with a single step."
)
OTHER_PROMPT = "List three colours of the rainbow."
MAX_NEW = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def demo(default_model):
    from hf_specdec.demo import launch

    model, tokenizer = default_model
    app = launch("127.0.0.1", free_port(), block=False, model=model, tokenizer=tokenizer, warmup=False, concurrency=2)
    client = gradio_client.Client(app.local_url, verbose=False)
    yield client
    client.close()
    app.close()


def vanilla_text(default_model, prompt: str, max_new: int = MAX_NEW) -> str:
    model, tokenizer = default_model
    ids = chat_prompt_ids(tokenizer, prompt)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def compare_args(prompt: str, method: str, max_new: int = MAX_NEW, runs: int = 1) -> tuple:
    # prompt, more prompts, method, do_sample, temperature, top_p, seed, max new tokens, timed runs
    return (prompt, "", method, False, 0.7, 0.9, 0, max_new, runs)


def test_greedy_generation_equals_vanilla_and_streams(demo, default_model):
    method = "ngram" if "ngram" in available_assistants() else available_assistants()[0]
    job = demo.submit(*compare_args(COPY_PROMPT, method), api_name="/compare")
    vanilla_html, spec_html, summary, _figure, details = job.result(timeout=180)
    expected = vanilla_text(default_model, COPY_PROMPT)
    assert details["vanilla"]["text"] == expected
    assert details["speculative"]["text"] == expected
    assert details["identical_to_vanilla"] is True
    assert details["speculative"]["tau"] > 1.0
    assert details["speculative"]["drafted_tokens_emitted"] > 0
    # the counts shown agree with spec_stats: accepted draft tokens = those in the output + those cut after its end
    spec = details["speculative"]
    assert spec["accepted_tokens"] == spec["drafted_tokens_emitted"] + spec["accepted_tokens_not_emitted"]
    assert f"{spec['accepted_tokens']} of {spec['drafted_tokens']} drafted tokens accepted" in summary
    assert f"{spec['drafted_tokens_emitted']} of {spec['new_tokens']} tokens are accepted draft tokens" in summary
    assert 'class="hfsd-drafted"' in spec_html and 'class="hfsd-target"' in spec_html
    assert "token-for-token identical" in summary and "Speedup" in summary
    assert "tokens/s" in vanilla_html
    # streamed: the page was updated several times before the final result
    assert len(job.outputs()) > 3


def test_two_concurrent_requests_with_different_methods(demo, default_model):
    methods = available_assistants()
    first, second = (
        ("ngram", next((m for m in methods if m != "ngram"), "ngram")) if "ngram" in methods else methods[:2]
    )
    jobs = [
        demo.submit(*compare_args(COPY_PROMPT, first), api_name="/compare"),
        demo.submit(*compare_args(OTHER_PROMPT, second), api_name="/compare"),
    ]
    results = [job.result(timeout=240)[4] for job in jobs]
    for prompt, method, details in zip((COPY_PROMPT, OTHER_PROMPT), (first, second), results):
        assert details["method"] == method
        assert details["speculative"]["text"] == vanilla_text(default_model, prompt)
        assert details["identical_to_vanilla"] is True


def test_parallel_mode_runs_two_generations_at_once_without_mixing_them(default_model):
    """--parallel: the generate() calls of concurrent requests overlap on the one shared model (no lock)."""
    from hf_specdec.demo import launch

    model, tokenizer = default_model
    app = launch("127.0.0.1", free_port(), block=False, model=model, tokenizer=tokenizer, warmup=False, parallel=True)
    try:
        client = gradio_client.Client(app.local_url, verbose=False)
        jobs = [
            client.submit(*compare_args(COPY_PROMPT, "ngram"), api_name="/compare"),
            client.submit(*compare_args(OTHER_PROMPT, available_assistants()[0]), api_name="/compare"),
        ]
        results = [job.result(timeout=240)[4] for job in jobs]
        client.close()
    finally:
        app.close()
    for prompt, details in zip((COPY_PROMPT, OTHER_PROMPT), results):
        expected = vanilla_text(default_model, prompt)
        assert details["vanilla"]["text"] == expected
        assert details["speculative"]["text"] == expected


def test_batch_of_prompts_equals_vanilla(demo, default_model):
    details = demo.predict(COPY_PROMPT, OTHER_PROMPT, "ngram", False, 0.7, 0.9, 0, 16, 1, api_name="/compare")[4]
    assert details["identical_to_vanilla"] is True
    expected = [vanilla_text(default_model, p, 16) for p in (COPY_PROMPT, OTHER_PROMPT)]
    assert details["speculative"]["texts"] == expected


def test_errors_are_reported_and_the_app_keeps_working(demo):
    # a bad input is answered in the page (summary and details), not raised: no "Error" badges, no traceback
    _vanilla, _spec, summary, _figure, details = demo.predict(*compare_args("   ", "ngram"), api_name="/compare")
    assert "prompt is empty" in details["error"] and "prompt is empty" in summary and "ValueError" not in summary
    with pytest.raises(Exception, match="nope is not in the list of choices"):
        demo.predict(*compare_args(COPY_PROMPT, "nope"), api_name="/compare")
    with pytest.raises(Exception, match="less than minimum value"):
        demo.predict(COPY_PROMPT, "", "ngram", True, 0.0, 0.9, 0, 8, 1, api_name="/compare")
    details = demo.predict(*compare_args(COPY_PROMPT, "ngram", 8), api_name="/compare")[4]
    assert details["speculative"]["new_tokens"] == 8


def test_stop_cancels_a_running_generation(demo):
    job = demo.submit(*compare_args(COPY_PROMPT, "ngram", 512), api_name="/compare")
    done = threading.Event()
    job.add_done_callback(lambda _job: done.set())
    while len(job.outputs()) < 2 and not done.is_set():
        done.wait(0.05)
    job.cancel()
    assert done.wait(60), "the cancelled generation did not end"
    outputs = job.outputs()
    assert outputs and outputs[-1][4] is None  # the run never reached its final page (details come last)
    # the app still serves requests
    details = demo.predict(*compare_args(COPY_PROMPT, "ngram", 8), api_name="/compare")[4]
    assert details["identical_to_vanilla"] is True


def test_benchmark_tab_runs_one_category(demo):
    from hf_specdec.demo.bench_tab import bench_categories

    category = bench_categories()[0]
    log, table, _figure = demo.predict(category, ["ngram"], 1, 16, 2, api_name="/bench")
    assert log.endswith("done.") and "warm-up 1/2: vanilla (untimed" in log
    timed = [line.split(": ")[1].split()[0] for line in log.splitlines() if " run " in line]
    assert timed == ["vanilla", "ngram", "ngram", "vanilla"]  # interleaved, the order turning
    assert log.index("warm-up 2/2") < log.index("q1/1 run 1/2")
    assert table.count("| ngram | 1/1 |") == 1 and table.count("| vanilla | 1/1 |") == 1  # one line per method
    assert "noise" in table and "step cost" in table and " (median " in table  # the spread of 2 runs
    assert "bound" not in table and "⚠" not in table


def test_the_benchmark_estimate_uses_vanilla_speed_once_measured(default_model):
    from hf_specdec.demo import launch

    model, tokenizer = default_model
    app = launch("127.0.0.1", free_port(), block=False, model=model, tokenizer=tokenizer, warmup=False)
    try:
        client = gradio_client.Client(app.local_url, verbose=False)
        before = client.predict(["ngram"], 2, 64, 2, api_name="/bench_estimate")
        assert "not known yet" in before and "after its first question" in before
        client.predict(*compare_args(OTHER_PROMPT, "ngram"), api_name="/compare")
        after = client.predict(["ngram"], 2, 64, 2, api_name="/bench_estimate")
        assert "up to about" in after and "tokens/s measured on this server" in after
        client.close()
    finally:
        app.close()


def test_timed_runs_give_the_spread_and_the_step_cost(demo):
    _v, _s, summary, _figure, details = demo.predict(*compare_args(COPY_PROMPT, "ngram", runs=2), api_name="/compare")
    assert len(details["speedup_per_run"]) == 2 and len(details["tokens_per_s_per_run"]["vanilla"]) == 2
    spec = details["speculative"]
    assert details["speedup"] == pytest.approx(
        max(details["tokens_per_s_per_run"]["speculative"]) / max(details["tokens_per_s_per_run"]["vanilla"])
    )
    # speedup = (tokens / steps) / step cost; no bound, no flag (a speedup above τ is possible)
    assert details["tokens_per_step"] == pytest.approx(spec["new_tokens"] / spec["steps"])
    assert details["speedup"] == pytest.approx(details["tokens_per_step"] / details["step_cost"])
    assert "fastest of 2 runs each" in summary and "per-run speedups" in summary
    assert f"**{details['step_cost']:.2f}×** vanilla's time per token" in summary
    assert "bound" not in summary and "⚠" not in summary


def test_startup_says_what_it_loads_and_how_long_it_takes(default_model, capfd):
    from hf_specdec.demo import build_app

    model, tokenizer = default_model
    build_app(model, tokenizer, own_model=True, warmup=True)
    out = capfd.readouterr().out
    assert "warming up vanilla and 1 assistant(s)" in out
    assert "warm-up 1/2: vanilla (" in out and "warm-up 2/2: ngram (" in out and "warm-up done in" in out
    build_app(warmup=False)  # the default model, loaded by the app
    out = capfd.readouterr().out
    assert "loading the default model" in out and "model loaded in" in out


def test_command_line_refuses_bad_numbers_before_loading_anything(capsys):
    from hf_specdec.demo import main

    for argv, words in (
        (["--concurrency", "0"], "--concurrency: must be at least 1, got 0"),
        (["--threads", "0"], "--threads: must be at least 1, got 0"),
    ):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2, argv  # argparse's usage error, as every hf-specdec subcommand
        assert words in capsys.readouterr().err
