"""The package's version, in a module of its own: the lowest layer can read it, and so can pyproject.toml (setuptools
parses this file without importing the package) and code running from a source tree that pip never installed (a
lent GPU machine runs the checkout from PYTHONPATH, where `importlib.metadata` knows no hf-specdec)."""

__version__ = "0.1.0"
