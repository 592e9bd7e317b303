"""The keyword a transformers module takes its KV cache under.

transformers renamed the argument in 5.24: ``past_key_values`` before, ``cache`` since (the old name still
accepted, with a deprecation warning, until 5.40 in ``forward`` and 6.0 in ``generate``). The package supports
both: callers pass ``**cache_kwarg(fn, cache)``, and ``generate``'s model kwargs are read under either name
(`USER_CACHE_KEYS`).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

# the names under which generate's model kwargs may hold the user's cache (newest first)
USER_CACHE_KEYS = ("cache", "past_key_values")


@functools.lru_cache(maxsize=256)
def _cache_arg_of(func: Callable) -> str:
    try:
        params = inspect.signature(func).parameters
    except (TypeError, ValueError):  # a builtin or C callable: assume the current name
        return "cache"
    return "cache" if "cache" in params or "past_key_values" not in params else "past_key_values"


def cache_arg(forward: Callable) -> str:
    """``"cache"`` or ``"past_key_values"``: the name ``forward`` (a module's ``forward``, bound or not) takes its
    KV cache under."""
    return _cache_arg_of(getattr(forward, "__func__", forward))


def cache_kwarg(forward: Callable, cache) -> dict:
    """``{name: cache}`` for ``forward(..., **cache_kwarg(forward, cache))``."""
    return {cache_arg(forward): cache}


def user_cache(model_kwargs: dict):
    """``(name, cache)``: the cache a ``generate`` call was given (under either name), or ``(None, None)``."""
    for key in USER_CACHE_KEYS:
        if model_kwargs.get(key) is not None:
            return key, model_kwargs[key]
    return None, None


__all__ = ["USER_CACHE_KEYS", "cache_arg", "cache_kwarg", "user_cache"]
