"""Deprecated: masenvs.adapters.models was split into masenvs.engine.loading, masenvs.engine.kernels, masenvs.cache.

This path goes away in the next release. Every name the old module had, public or private,
resolves to the same object in its new module (a few private ones under a public name).
"""

import importlib
import warnings
from typing import Any

_MODULES = ("masenvs.engine.loading", "masenvs.engine.kernels", "masenvs.cache")
_RENAMED = {}  # old private name -> its public name now

warnings.warn(
    "masenvs.adapters.models moved to masenvs.engine.loading, masenvs.engine.kernels, masenvs.cache; import from there",
    DeprecationWarning,
    stacklevel=2,
)


def __getattr__(name: str) -> Any:
    wanted = _RENAMED.get(name, name)
    for module in _MODULES:
        value = getattr(importlib.import_module(module), wanted, _MISSING)
        if value is not _MISSING:
            return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_MISSING = object()
