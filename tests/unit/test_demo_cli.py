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
