"""The Gradio demo (``hf-specdec demo``): vanilla `generate`, then speculative decoding, in two panes side by side.

Needs the ``demo`` extra (``bash scripts/install.sh demo`` in a checkout): gradio is imported only when the app is built.
"""

from __future__ import annotations

from .cli import add_arguments, main, run


def __getattr__(name):
    if name in ("build_app", "launch"):
        try:
            import gradio  # noqa: F401
        except ModuleNotFoundError as exc:
            raise ModuleNotFoundError(
                "the hf-specdec demo needs gradio, which is not installed; run `bash scripts/install.sh demo` in an hf-specdec checkout (or pip install gradio) "
                "(or `pip install gradio`)"
            ) from exc
        from . import app

        return getattr(app, name)
    raise AttributeError(f"module 'hf_specdec.demo' has no attribute {name!r}")


__all__ = ["build_app", "launch", "main", "add_arguments", "run"]
