"""The demo in a real browser: headless Chromium (Debian's package) driven by Playwright loads the page, runs a
greedy generation and checks what is rendered; the screenshot lands in .cache/screenshots/demo.png (a CI artifact).
"""

from __future__ import annotations

import shutil
import socket
from pathlib import Path

import pytest
import torch

pytest.importorskip("gradio", reason="the demo extra is not installed (pip install .[demo])")
playwright_sync = pytest.importorskip("playwright.sync_api", reason="the demo extra is not installed (playwright)")

from hf_specdec.models import chat_prompt_ids  # noqa: E402

pytestmark = pytest.mark.slow

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
SCREENSHOT = Path(__file__).resolve().parents[2] / ".cache" / "screenshots" / "demo.png"
PROMPT = (
    "Repeat this text exactly: The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins "
    "with a single step."
)
MAX_NEW = 24


@pytest.fixture(scope="module")
def demo_url(default_model):
    if not Path(CHROMIUM).is_file():
        pytest.skip(f"no Chromium at {CHROMIUM}: run scripts/install_browser.sh (Debian's chromium package)")
    from hf_specdec.demo import launch

    model, tokenizer = default_model
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # with the warm-up, as `hf-specdec demo` starts: the page then shows steady-state speeds
    app = launch("127.0.0.1", port, block=False, model=model, tokenizer=tokenizer, warmup=True)
    yield app.local_url
    app.close()


def test_page_runs_a_generation_and_shows_text_and_stats(demo_url, default_model):
    model, tokenizer = default_model
    ids = chat_prompt_ids(tokenizer, PROMPT)
    reference = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False)
    expected = tokenizer.decode(reference[0, ids.shape[1] :], skip_special_tokens=True)

    with playwright_sync.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(demo_url, wait_until="domcontentloaded")
            page.locator("#generate").wait_for(timeout=60_000)
            page.locator("#prompt textarea").fill(PROMPT)
            tokens = page.locator("#max-new-tokens input[type=number]")
            tokens.fill(str(MAX_NEW))
            tokens.press("Enter")
            page.locator("#generate").click()
            summary = page.locator("#summary")
            summary.get_by_text("token-for-token identical").wait_for(timeout=240_000)

            vanilla_text = page.locator("#vanilla-pane .hfsd-text").inner_text()
            spec_text = page.locator("#speculative-pane .hfsd-text").inner_text()
            drafted = page.locator("#speculative-pane span.hfsd-drafted").count()
            own = page.locator("#speculative-pane span.hfsd-target").count()
            summary_text = summary.inner_text()
            page.locator("#depth").scroll_into_view_if_needed()
            SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(SCREENSHOT), full_page=True)
        finally:
            browser.close()
    assert vanilla_text.strip() == spec_text.strip() == expected.strip()
    assert drafted > 0 and own > 0
    assert "Speedup" in summary_text and "τ = " in summary_text
    tau = float(summary_text.split("τ = ")[1].split()[0])
    assert tau > 1.0
    assert SCREENSHOT.stat().st_size > 10_000
