"""``hf-specdec demo --dtype``: the demo serves the default model in the dtype asked for (vanilla and every assistant
then run in it), with the ready-made assistants still offered."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("gradio", reason="the demo extra: bash scripts/install.sh demo")

from hf_specdec.demo import app as demo_app  # noqa: E402
from hf_specdec.demo.cli import main  # noqa: E402


def test_the_demo_loads_the_default_model_in_the_dtype_asked_for(monkeypatch):
    seen = {}
    monkeypatch.setattr(demo_app, "launch", lambda *args, **kwargs: seen.update(kwargs))
    assert main(["--dtype", "bfloat16", "--no-warmup"]) == 0
    assert seen["model"].dtype == torch.bfloat16
    assert seen["own_model"] is False  # the default model: the shipped heads are offered too


def test_the_demo_refuses_an_unknown_dtype(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--dtype", "float8"])
    assert exit_info.value.code == 2
    assert "--dtype" in capsys.readouterr().err


def test_the_page_names_what_runs_not_the_gguf_file(tmp_path):
    """The default model runs dequantized (fp32 unless --dtype casts it), not as the Q4_1 file its folder is named
    after; another model is named by its folder or Hub id, with its dtype."""
    from types import SimpleNamespace

    from hf_specdec.models import default_model_dir

    folder = str(default_model_dir(convert=False))
    assert demo_app.model_name(SimpleNamespace(name_or_path=folder, dtype=torch.float32)) == (
        "SmolLM2-135M-Instruct (fp32, dequantized from the Q4_1 GGUF)"
    )
    assert demo_app.model_name(SimpleNamespace(name_or_path=folder + "/", dtype=torch.bfloat16)) == (
        "SmolLM2-135M-Instruct (bf16, dequantized from the Q4_1 GGUF)"
    )
    mine = SimpleNamespace(name_or_path=str(tmp_path / "my-model"), dtype=torch.float16)
    assert demo_app.model_name(mine) == "my-model (fp16)"


def test_the_page_says_the_two_sides_run_one_after_the_other():
    """Measured on the 2-core CPU: run at once, each side lost about a third of its tokens/s, so the demo times them
    one after the other and says so (the intro, the Space's README)."""
    from pathlib import Path

    assert "one after the other" in demo_app.INTRO and "at the same time" in demo_app.INTRO
    readme = (Path(__file__).resolve().parents[2] / "demo" / "README.md").read_text(encoding="utf-8")
    assert "one after the other" in readme and "both streaming" not in readme
