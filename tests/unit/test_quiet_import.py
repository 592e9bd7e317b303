"""``import hf_specdec`` and every ``hf-specdec`` command start without log lines that do not concern the user: with
the ``quant`` extra installed, transformers' modeling code imports torchao, which on a machine without CUDA logs a
failed load of each CUDA kernel library (hf_specdec/quiet_imports.py)."""

import subprocess
import sys

import pytest
import torch


@pytest.mark.skipif(torch.cuda.is_available(), reason="the noise is silenced only where CUDA is absent")
def test_import_prints_nothing():
    done = subprocess.run([sys.executable, "-c", "import hf_specdec"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "" and done.stderr == "", done.stderr[:2000]


def test_the_loggers_are_restored_and_other_warnings_still_show():
    code = (
        "import logging; import hf_specdec; "
        "print(logging.getLogger('torchao').level, logging.getLogger('torch.utils._pytree').level); "
        "logging.getLogger('torchao').warning('still shown')"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.stdout.split() == ["0", "0"], done.stdout
    assert "still shown" in done.stderr
