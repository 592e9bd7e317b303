"""``hf-specdec demo`` starts as a user runs it, in its own process, and prints its progress and nothing else: what
it loads, each warm-up call, where it listens. No progress bar of transformers, no warning of gradio or torch, no
traceback on stdout or stderr."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time

import pytest

pytest.importorskip("gradio", reason="the demo extra is not installed (pip install .[demo])")

pytestmark = pytest.mark.slow  # the default model

# the demo's own lines: "hf-specdec demo: ..." and its indented continuations, and the hint under the address
PROGRESS = re.compile(
    r"hf-specdec demo(: |, public link: ).+|  (model loaded in|warm-up) .+|\(hf-specdec demo --share .+\)"
)
LISTENING = re.compile(r"hf-specdec demo: (http://127\.0\.0\.1:\d+/?)$")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def startup_output(*args: str, timeout_s: float = 300) -> list[str]:
    """Every line ``python -m hf_specdec.demo ARGS`` writes to stdout and stderr (one stream, as a terminal shows
    them) until it says where it listens, then stops it. Fails if it exits or stays silent past ``timeout_s``."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "hf_specdec.demo", "--host", "127.0.0.1", "--port", str(free_port()), *args]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    try:
        for raw in proc.stdout:
            # a progress bar redraws itself with carriage returns: each redraw is a line the user sees
            lines += [part for part in raw.rstrip("\n").split("\r") if part]
            if LISTENING.match(lines[-1] if lines else ""):
                # the hint line follows the address at once
                lines.append(proc.stdout.readline().rstrip("\n"))
                return lines
            assert time.monotonic() < deadline, "the demo did not start in time:\n" + "\n".join(lines)
        raise AssertionError(f"the demo exited with {proc.wait()} before listening:\n" + "\n".join(lines))
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def noise(lines: list[str]) -> list[str]:
    return [line for line in lines if not PROGRESS.fullmatch(line)]


def test_the_noise_check_catches_a_progress_bar_and_a_warning():
    assert noise(["hf-specdec demo: starting (importing gradio)…", "  model loaded in 1.1 s"]) == []
    bar = "Loading weights: 100%|██████████| 272/272 [00:00<00:00, 14346.17it/s]"
    warning = "/x/gradio/utils.py:1: UserWarning: something"
    assert noise(["hf-specdec demo: http://127.0.0.1:7860/", bar, warning]) == [bar, warning]


def test_the_default_demo_prints_only_its_progress():
    lines = startup_output("--no-warmup")
    assert not noise(lines), "start-up printed more than its progress:\n" + "\n".join(lines)
    text = "\n".join(lines)
    assert "loading the default model" in text and "model loaded in" in text
    assert LISTENING.match(lines[-2]) and lines[-1].startswith("(hf-specdec demo --share")


def test_a_model_folder_with_its_warm_up_prints_only_its_progress():
    from hf_specdec.models import default_model_dir

    lines = startup_output("--model", str(default_model_dir()), "--threads", "1")
    assert not noise(lines), "start-up printed more than its progress:\n" + "\n".join(lines)
    text = "\n".join(lines)
    assert "model loaded in" in text and "warm-up 1/2: vanilla (" in text and "warm-up 2/2: ngram (" in text
    assert "warm-up done in" in text and LISTENING.match(lines[-2])
