"""Defaults shared by the demo's command line (`cli`) and the app (`app`), importable without gradio."""

DEFAULT_CONCURRENCY = 4  # requests the Gradio queue serves at once
