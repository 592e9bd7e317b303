"""``hf-specdec bench`` stopped by SIGTERM (a ``timeout``, a job scheduler) keeps every prompt it finished: written to
``--out`` as each one ends and reported on stdout, with exit code 143 and no traceback."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time

import pytest

from hf_specdec.models import default_model_dir
from hf_specdec.testing import tiny_causal_lm


@pytest.mark.slow  # the default model's tokenizer (its folder is converted on first use)
def test_sigterm_keeps_the_finished_prompts(tmp_path):
    from transformers import AutoTokenizer

    model_dir, out = tmp_path / "model", tmp_path / "results"
    model_dir.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (default_model_dir() / name).exists():
            shutil.copy(default_model_dir() / name, model_dir / name)
    vocab = len(AutoTokenizer.from_pretrained(model_dir))
    tiny_causal_lm("llama", vocab_size=vocab, num_layers=1).save_pretrained(model_dir)
    argv = ["--model", str(model_dir), "--methods", "ngram", "--per-category", "4", "--max-new-tokens", "96"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "hf_specdec.cli", "bench", *argv, "--threads", "1", "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 240
    while not (out / "results.json").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "the bench ended before its first prompt was written: " + proc.stderr.read()[-2000:]
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 143, stderr[-2000:]
    assert "Traceback" not in stderr and "interrupted:" in stderr
    data = json.loads((out / "results.json").read_text())
    assert data["meta"]["complete"] is False
    finished = len(data["records"])
    assert finished >= 2 and finished % 2 == 0, "every finished prompt has its vanilla and its ngram record"
    assert finished < 2 * 24, "the run was stopped before its last prompt"
    assert "partial results" in stdout and "ngram" in stdout
    assert not list(out.glob("*.tmp"))
