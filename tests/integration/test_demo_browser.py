"""The demo in a real browser: headless Chromium (Debian's package) driven by Playwright at 1400x1000 loads the page
and uses it as a person would: a greedy generation (identical to vanilla's, its accepted-token counts agreeing
with τ and the acceptance rate), Stop during either run, a bad input,
a sampled run, the Benchmark tab, the dark theme. What a browser cannot see (the seed set under the lock, the
incremental detokeniser, the Space files, the command line's words) is checked here too, next to the page it serves.
Screenshots land in .cache/screenshots/ (CI artifacts)."""

from __future__ import annotations

import re
import shutil
import socket
import threading
from pathlib import Path

import pytest
import torch

pytest.importorskip("gradio", reason="the demo extra is not installed (pip install .[demo])")
playwright_sync = pytest.importorskip("playwright.sync_api", reason="the demo extra is not installed (playwright)")

from hf_specdec.assistants import available_assistants  # noqa: E402
from hf_specdec.models import DEFAULT_MODEL_NAME, chat_prompt_ids  # noqa: E402

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SCREENSHOTS = ROOT / ".cache" / "screenshots"
PROMPT = (
    "Repeat this text exactly: The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins "
    "with a single step."
)
LONG_PROMPT = "Count from 1 to 500, separated by commas."
MAX_NEW = 24
LONG = 2 * 60_000  # ms: a run on a shared 2-core CPU


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def demo_url(default_model):
    if not Path(CHROMIUM).is_file():
        pytest.skip(f"no Chromium at {CHROMIUM}: run scripts/install_browser.sh (Debian's chromium package)")
    from hf_specdec.demo import launch

    model, tokenizer = default_model
    # with the warm-up, as `hf-specdec demo` starts: the page then shows steady-state speeds
    app = launch("127.0.0.1", _free_port(), block=False, model=model, tokenizer=tokenizer, warmup=True)
    yield app.local_url
    app.close()


@pytest.fixture(scope="module")
def browser(demo_url):
    with playwright_sync.sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


DESKTOP = {"width": 1400, "height": 1000}
PHONE = {"width": 390, "height": 844}


def _open(browser, url: str, viewport: dict = DESKTOP):
    page = browser.new_page(viewport=viewport)
    page.goto(url, wait_until="domcontentloaded")
    page.locator("#generate").wait_for(timeout=60_000)
    return page


def _set_number(page, elem_id: str, value) -> None:
    box = page.locator(f"#{elem_id} input[type=number]")
    box.fill(str(value))
    box.press("Enter")


def _pane(page, which: str) -> tuple[str, str]:
    """(status line, text) of the vanilla or speculative pane."""
    pane = page.locator(f"#{which}-pane")
    return pane.locator(".hfsd-head").inner_text(), pane.locator(".hfsd-text").inner_text()


def _assert_step_cost_no_bound(summary_text: str) -> None:
    """The Compare summary shows the speedup and the step cost it is made of, and no bound or flag (τ is no
    ceiling: a verify forward can cost less than a decode step)."""
    first = summary_text.splitlines()[0]
    assert float(re.search(r"Speedup: ([0-9.]+)×", first).group(1)) > 0
    assert float(re.search(r"a speculative step took ([0-9.]+)×", summary_text).group(1)) > 0
    assert "bound" not in summary_text and "⚠" not in summary_text, summary_text


def _assert_accepted_tokens_agree_with_tau(spec_head: str, summary_text: str, drafted_spans: int, own_spans: int):
    """The counts the page shows after a speculative run hold together (``spec_stats``' definitions): τ = tokens
    per verify step = 1 + A / S, so the accepted draft tokens A = τ·S − S (the tokens of the verify steps less one
    own token each); the acceptance rate = A / drafted; the pane's accepted draft tokens are those of A that reached
    the output (A less the ones the summary says were cut after the answer ended), the rest of the output is the
    target's own tokens (one per verify step, and the prefill's first), and the coloured tokens are those counts
    (less empty pieces, an end-of-text token)."""
    found = re.search(r"τ = ([0-9.]+)\*{0,2} tokens per verify step \(1 \+ (\d+) accepted draft tokens / (\d+) steps\); "
                      r"acceptance rate ([0-9.]+) = (\d+) of (\d+) drafted tokens accepted", summary_text)  # fmt: skip
    assert found, summary_text
    tau, accepted, steps, rate = float(found[1]), int(found[2]), int(found[3]), float(found[4])
    assert int(found[5]) == accepted and steps > 0
    drafted_total = int(found[6])
    assert tau == round(1 + accepted / steps, 2), (tau, accepted, steps)
    assert abs(tau * steps - steps - accepted) <= 0.005 * steps, "accepted draft tokens = τ·steps − steps"
    assert rate == round(accepted / drafted_total, 2) and accepted <= drafted_total
    head = re.search(r"(\d+) tokens · .* · (\d+) drafted \+ (\d+) own", spec_head)
    assert head, spec_head
    tokens, shown, own = int(head[1]), int(head[2]), int(head[3])
    output = re.search(r"In the output: (\d+) of (\d+) tokens are accepted draft tokens", summary_text)
    assert output and (int(output[1]), int(output[2])) == (shown, tokens), (output, spec_head)
    assert shown + own == tokens
    cut = re.search(r"; (\d+) more accepted draft tokens? came after the answer ended", summary_text)
    assert accepted - shown == (int(cut[1]) if cut else 0), "every accepted draft token is shown or said to be cut"
    assert own in (steps, steps + 1), (own, steps)  # one own token per verify step, and the prefill's
    assert shown - 1 <= drafted_spans <= shown and own - 1 <= own_spans <= own, (drafted_spans, own_spans, spec_head)


def _no_error_badges(page) -> bool:
    return page.get_by_text("Error", exact=True).count() == 0


def _shot(page, name: str) -> None:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=True)


def _vanilla_text(default_model, prompt: str, max_new: int) -> str:
    model, tokenizer = default_model
    ids = chat_prompt_ids(tokenizer, prompt)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def test_page_runs_a_generation_and_shows_text_and_stats(browser, demo_url, default_model):
    expected = _vanilla_text(default_model, PROMPT, MAX_NEW)
    page = _open(browser, demo_url)
    intro = page.locator("#intro").inner_text()
    assert DEFAULT_MODEL_NAME in intro and "cores" in intro and "docs" in intro.lower()  # model, hardware, docs
    assert f"{DEFAULT_MODEL_NAME} (fp32, dequantized from the Q4_1 GGUF)" in intro  # what runs, not the file's name
    help_text = page.locator("#assistant-help").inner_text()
    assert len([line for line in help_text.splitlines() if line.strip()]) <= 3  # the chosen one, briefly
    page.locator("#assistant-guide-box").get_by_text("Which assistant?").first.click()
    guide = page.locator("#assistant-guide")
    guide.get_by_text("How to read the figures").wait_for(timeout=10_000)
    entries = [line.split(":")[0].strip() for line in guide.locator("li").all_inner_texts()]
    assert entries == available_assistants(), "the guide has one line for every entry of the menu, in its order"
    assert "step cost" in guide.inner_text() and "τ" in guide.inner_text() and "bound" not in guide.inner_text()
    assert page.locator("#max-new-tokens input[type=number]").input_value() == "256"  # answers are not cut short
    for elem_id in ("temperature", "top-p", "seed"):  # greedy: the sampling controls are greyed out
        assert page.locator(f"#{elem_id} input").first.is_disabled(), elem_id
    page.locator("#do-sample input").check()
    page.locator("#temperature input").first.wait_for(state="visible")
    page.wait_for_function("!document.querySelector('#temperature input').disabled", timeout=10_000)
    page.locator("#do-sample input").uncheck()
    page.wait_for_function("document.querySelector('#temperature input').disabled", timeout=10_000)

    page.locator("#prompt textarea").fill(PROMPT)
    _set_number(page, "max-new-tokens", MAX_NEW)
    page.locator("#generate").click()
    summary = page.locator("#summary")
    summary.get_by_text("token-for-token identical").wait_for(timeout=LONG)
    vanilla_head, vanilla_text = _pane(page, "vanilla")
    spec_head, spec_text = _pane(page, "speculative")
    drafted = page.locator("#speculative-pane span.hfsd-drafted").count()
    own = page.locator("#speculative-pane span.hfsd-target").count()
    summary_text = summary.inner_text()
    depth = page.locator("#depth")
    depth.scroll_into_view_if_needed()
    depth.locator("img").first.wait_for(timeout=30_000)
    label_over_chart = depth.locator("[data-testid='block-label']:not(.hide)").count()
    _shot(page, "demo")
    assert vanilla_text.strip() == spec_text.strip() == expected.strip()
    assert "running" not in vanilla_head and "running" not in spec_head
    assert drafted > 0 and own > 0
    assert "Speedup" in summary_text and "τ = " in summary_text
    tau = float(summary_text.split("τ = ")[1].split()[0])
    assert tau > 1.0
    _assert_accepted_tokens_agree_with_tau(spec_head, summary_text, drafted, own)
    _assert_step_cost_no_bound(summary_text)
    assert "Noise: one run each" in summary_text
    assert label_over_chart == 0, "the per-depth chart carries its own title; no Gradio label hides its top"
    assert _no_error_badges(page)
    assert (SCREENSHOTS / "demo.png").stat().st_size > 10_000

    # a bad input after that run: its message in the summary, the old results cleared, no "Error" badges
    page.locator("#prompt textarea").fill("   ")
    page.locator("#generate").click()
    summary.get_by_text("the prompt is empty").wait_for(timeout=30_000)
    assert "ValueError" not in summary.inner_text()
    assert page.locator("#vanilla-pane .hfsd-text").count() == 0, "the previous results are cleared"
    assert _no_error_badges(page)
    page.close()


def _stop_once_written(page, pane: str, min_chars: int) -> None:
    """Press Stop once ``pane`` shows more than ``min_chars`` characters; wait for the page to say it stopped."""
    script = f"(document.querySelector('#{pane}-pane .hfsd-text')?.innerText || '').length > {min_chars}"
    page.wait_for_function(script, timeout=LONG)
    page.locator("#stop").click()
    page.locator("#summary").get_by_text("Stopped").first.wait_for(timeout=60_000)


def _stopped_page(page, shot: str) -> tuple[str, str, str, str, str]:
    """(vanilla status, vanilla text, speculative status, speculative text, summary) of a stopped run, after a
    screenshot; no "Error" badge may show."""
    _shot(page, shot)
    assert _no_error_badges(page)
    return (*_pane(page, "vanilla"), *_pane(page, "speculative"), page.locator("#summary").inner_text())


def test_stop_during_the_vanilla_run_keeps_its_text_and_says_stopped(browser, demo_url):
    page = _open(browser, demo_url)
    page.locator("#prompt textarea").fill(LONG_PROMPT)
    _set_number(page, "max-new-tokens", 512)
    page.locator("#generate").click()
    _stop_once_written(page, "vanilla", 8)
    vanilla_head, vanilla_text, spec_head, _, summary = _stopped_page(page, "demo_stopped_vanilla")
    assert "stopped" in vanilla_head and "running" not in vanilla_head and vanilla_text.strip()
    assert "not started" in spec_head and "during the vanilla run" in summary
    page.close()


def test_stop_during_the_speculative_run_keeps_both_texts(browser, demo_url):
    page = _open(browser, demo_url)
    page.locator("#prompt textarea").fill(LONG_PROMPT)
    _set_number(page, "max-new-tokens", 256)
    method = page.locator("#method input")  # a head: it drafts less than prompt lookup on counting
    method.fill("mlp_speculator")
    method.press("Enter")
    page.locator("#assistant-help").get_by_text("`mlp_speculator`").or_(
        page.locator("#assistant-help").get_by_text("mlp_speculator:")
    ).first.wait_for(timeout=10_000)
    page.locator("#generate").click()
    page.locator("#summary").get_by_text("Running speculative decoding").wait_for(timeout=3 * LONG)
    _stop_once_written(page, "speculative", 0)
    vanilla_head, vanilla_text, spec_head, spec_text, summary = _stopped_page(page, "demo_stopped_speculative")
    assert vanilla_text.strip() and spec_text.strip()
    assert "running" not in vanilla_head and "stopped" not in vanilla_head  # vanilla had finished
    assert "stopped" in spec_head and "running" not in spec_head
    assert len(spec_text) <= len(vanilla_text) and vanilla_text.startswith(spec_text.rstrip()[:20])
    assert "during the speculative run" in summary
    page.close()


def test_a_sampled_run_says_whether_the_two_texts_match(browser, demo_url):
    page = _open(browser, demo_url)
    page.locator("#prompt textarea").fill(PROMPT)
    _set_number(page, "max-new-tokens", MAX_NEW)
    page.locator("#do-sample input").check()
    page.wait_for_function("!document.querySelector('#temperature input').disabled", timeout=10_000)
    _set_number(page, "temperature", 0.1)  # a peaked distribution: the two samples usually agree
    page.locator("#generate").click()
    summary = page.locator("#summary")
    summary.get_by_text("Sampling (seed 0)").wait_for(timeout=LONG)
    _, vanilla_text = _pane(page, "vanilla")
    _, spec_text = _pane(page, "speculative")
    text = summary.inner_text()
    if vanilla_text == spec_text:
        assert "both runs drew the same text" in text and "the texts differ" not in text
    else:
        assert "the texts differ" in text
    # what it says is true: the same seed starts the same random stream; nothing is claimed about the distribution
    assert "same seed" in text and "peaked" not in text
    page.close()


def _bench_setup(page, keep: tuple[str, ...], questions: int) -> None:
    """The Benchmark tab with only the methods ``keep`` ticked, ``questions`` questions and 16 new tokens."""
    page.get_by_role("tab", name="Benchmark").click()
    choices = page.locator("#bench-methods label:has(input[type=checkbox])")
    choices.first.wait_for()
    for i in range(choices.count()):
        box = choices.nth(i).locator("input[type=checkbox]")
        if (choices.nth(i).inner_text().strip() in keep) != box.is_checked():
            box.click()
    _set_number(page, "bench-questions", questions)
    _set_number(page, "bench-max-new-tokens", 16)
    _set_number(page, "bench-repeats", 1)  # short (the spread of several runs is checked in test_demo.py)


def _bench_rows(page) -> list[list[str]]:
    """The cells of every line of the results table."""
    table = page.locator("#bench-table table").first
    return [[c.strip() for c in r.locator("td").all_inner_texts()] for r in table.locator("tbody tr").all()]


def _assert_rows_show_the_step_cost(rows: list[list[str]]) -> None:
    """Every method's line shows its speedup (column 4) and its step cost (column 7), no flag."""
    for cells in rows:
        if cells[0] == "vanilla" or not cells[3]:
            continue
        assert float(cells[3].split("×")[0]) > 0 and float(cells[6].rstrip("×")) > 0, cells
        assert not any("⚠" in c for c in cells), cells


def test_the_benchmark_tab_streams_progress_and_lists_each_method_once(browser, demo_url):
    page = _open(browser, demo_url)
    _bench_setup(page, ("ngram",), 1)
    assert "Estimated time" in page.locator("#bench-estimate").inner_text()  # said before the run
    page.locator("#bench-run").click()
    log = page.locator("#bench-log textarea")
    # progress moves call by call: the warm-up calls show before the first question has run every method
    page.wait_for_function("document.querySelector('#bench-log textarea').value.includes('warm-up 2/')", timeout=LONG)
    early = log.input_value()
    assert "question 1/1 done" not in early
    page.locator("#bench-table").get_by_text("How to read this").wait_for(timeout=3 * LONG)
    rows = _bench_rows(page)
    page.locator("#bench-chart img").first.wait_for(timeout=30_000)
    _shot(page, "demo_benchmark")
    assert [r[0] for r in rows] == ["vanilla", "ngram"], rows  # each method once
    _assert_rows_show_the_step_cost(rows)
    assert _no_error_badges(page)
    page.close()


def test_stop_in_the_benchmark_tab_keeps_the_finished_lines(browser, demo_url):
    page = _open(browser, demo_url, PHONE)  # on a phone: the table stays legible too
    _bench_setup(page, ("ngram",), 2)
    page.locator("#bench-run").click()
    page.locator("#bench-table").get_by_text("question 1/2 done").wait_for(timeout=3 * LONG)
    page.locator("#bench-stop").click()
    page.locator("#bench-table").get_by_text("Stopped by the user").wait_for(timeout=LONG)
    rows = _bench_rows(page)
    text = page.locator("#bench-table").inner_text()
    _shot(page, "demo_benchmark_stopped")
    assert [r[0] for r in rows] == ["vanilla", "ngram"], rows
    assert rows[1][1] in ("1/2", "2/2") and rows[1][3].split("×")[0].replace(".", "").isdigit(), rows
    assert "error" not in text.lower() and "no results" not in text.lower()
    _assert_rows_show_the_step_cost(rows)
    assert page.locator("#bench-log textarea").input_value().endswith("stopped by the user.")
    method_cell = page.locator("#bench-table table th").first.bounding_box()
    assert method_cell["width"] >= 50 and method_cell["height"] < 60, "a table column squeezed to a letter a line"
    assert _no_error_badges(page)
    page.close()


def test_on_a_phone_the_panes_stack_and_the_chart_fills_the_width(browser, demo_url):
    boxes = {}
    for name, viewport in (("desktop", DESKTOP), ("phone", PHONE)):
        page = _open(browser, demo_url, viewport)
        page.locator("#prompt textarea").fill(PROMPT)
        _set_number(page, "max-new-tokens", 16)
        page.locator("#generate").click()
        page.locator("#depth img").first.wait_for(timeout=LONG)
        boxes[name] = {k: page.locator(sel).first.bounding_box() for k, sel in
                       (("vanilla", "#vanilla-pane"), ("spec", "#speculative-pane"), ("chart", "#depth img"))}  # fmt: skip
        _shot(page, f"demo_{name}")
        summary_text = page.locator("#summary").inner_text()
        _assert_step_cost_no_bound(summary_text)
        _assert_accepted_tokens_agree_with_tau(
            _pane(page, "speculative")[0],
            summary_text,
            page.locator("#speculative-pane span.hfsd-drafted").count(),
            page.locator("#speculative-pane span.hfsd-target").count(),
        )
        page.close()
    desk, phone = boxes["desktop"], boxes["phone"]
    assert desk["vanilla"]["y"] == desk["spec"]["y"] and desk["vanilla"]["x"] < desk["spec"]["x"]  # side by side
    assert phone["vanilla"]["y"] + phone["vanilla"]["height"] <= phone["spec"]["y"]  # stacked
    assert abs(phone["vanilla"]["x"] - phone["spec"]["x"]) < 2
    assert min(phone["vanilla"]["width"], phone["spec"]["width"], phone["chart"]["width"]) >= 0.8 * PHONE["width"]
    assert phone["chart"]["height"] >= 150, "the chart is drawn at a readable size, not a thumbnail"


def test_charts_are_drawn_on_a_transparent_background_for_the_dark_theme(browser, demo_url):
    page = _open(browser, demo_url + "?__theme=dark")
    page.locator("#prompt textarea").fill(PROMPT)
    _set_number(page, "max-new-tokens", 16)
    page.locator("#generate").click()
    img = page.locator("#depth img").first
    img.wait_for(timeout=LONG)
    page.wait_for_function("document.querySelector('#depth img').complete", timeout=30_000)
    alpha = page.evaluate(
        """() => { const img = document.querySelector('#depth img');
                   const c = document.createElement('canvas'); c.width = img.naturalWidth; c.height = img.naturalHeight;
                   const ctx = c.getContext('2d'); ctx.drawImage(img, 0, 0);
                   return ctx.getImageData(2, 2, 1, 1).data[3]; }"""
    )
    _shot(page, "demo_dark")
    assert alpha == 0, "the chart's corner is opaque: a white box in the dark theme"
    page.close()


# ------------------------------------------------------------------ what the page relies on but a browser cannot see
def test_a_seeded_request_is_reproducible_while_another_draws_random_numbers(default_model):
    """The seed is set once the call holds the model's lock: a concurrent request drawing random numbers while this
    one waits cannot change its sample."""
    from hf_specdec.demo.streaming import follow_generate

    model, tokenizer = default_model
    ids = chat_prompt_ids(tokenizer, "Write one sentence about the sea.")
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    kwargs = {"max_new_tokens": 12, "do_sample": True, "temperature": 1.0}

    def sample(lock, while_waiting=None):
        follow = follow_generate(model, inputs, kwargs, lock=lock, seed=1234)
        first = next(follow)
        if while_waiting is not None:
            while_waiting()
        return [p for p in [first, *follow]][-1].tokens

    reference = sample(threading.Lock())
    lock = threading.Lock()
    lock.acquire()

    def another_request():  # draws from torch's generator, then lets the seeded call run
        torch.rand(1000)
        lock.release()

    assert sample(lock, another_request) == reference


def test_the_incremental_detokeniser_matches_a_full_decode_in_constant_work(default_model):
    from hf_specdec.demo.streaming import IncrementalText

    _, tokenizer = default_model
    text = "Grüße aus Köln: 東京 → Zürich, naïve café. " * 40 + "Ünïcödé ends here."
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    widths = []

    class Counting:
        def decode(self, ids, **kwargs):
            widths.append(len(ids))
            return tokenizer.decode(ids, **kwargs)

    inc = IncrementalText(Counting())
    for i in range(0, len(ids), 3):
        inc.extend(ids[i : i + 3])
    assert "".join(inc.pieces) == inc.text == tokenizer.decode(ids, skip_special_tokens=True)
    assert len(ids) > 300 and max(widths) <= 8, "each token decodes a short window, not the whole text"


def test_demo_folder_is_a_space():
    readme = (ROOT / "demo" / "README.md").read_text(encoding="utf-8")
    front = dict(re.findall(r"^(\w+): *(.+)$", readme.split("---")[1], flags=re.MULTILINE))
    assert front["sdk"] == "gradio" and front["app_file"] == "app.py" and front["license"] == "apache-2.0"
    import gradio

    assert front["sdk_version"].split(".")[0] == gradio.__version__.split(".")[0]
    from packaging.requirements import Requirement

    lines = [ln for ln in (ROOT / "demo" / "requirements.txt").read_text().splitlines() if ln and ln[0] != "#"]
    requirement = Requirement(lines[0])
    assert requirement.name == "hf-specdec" and "demo" in requirement.extras
    assert (ROOT / "demo" / "app.py").is_file()


def test_the_command_line_names_its_own_options(default_model, capfd):
    from hf_specdec.demo import launch

    model, tokenizer = default_model
    app = launch("127.0.0.1", _free_port(), block=False, model=model, tokenizer=tokenizer, warmup=False)
    app.close()
    out = capfd.readouterr().out
    assert f"hf-specdec demo: {app.local_url}" in out and "--share" in out
    assert "share=True" not in out and "launch()" not in out
