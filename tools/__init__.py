"""Lab equipment of this repository, not installed with hf_specdec (pyproject.toml packages ``hf_specdec*`` only): the
GPU recipe's driver (gpu_recipe.py), the docs' figure renderer (render.py) and the architecture sweep that writes
docs/architectures.md (architectures.py). Run from the repository root (``python -m tools.gpu_recipe``); the tests
import it through pytest's ``pythonpath`` (pyproject.toml)."""
