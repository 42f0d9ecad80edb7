"""Deprecated: masenvs.adapters.backends.llama was split into masenvs.engine.forward, masenvs.engine.quant, masenvs.engine.lora.

This path goes away in the next release. Every name the old module had, public or private,
resolves to the same object in its new module (a few private ones under a public name).
"""

import importlib
import warnings
from typing import Any

_MODULES = ("masenvs.engine.forward", "masenvs.engine.quant", "masenvs.engine.lora")
_RENAMED = {
    "_Projection": "Projection",
    "_project": "fused_projection",
    "_check_quantize": "check_quantize",
    "_group_rows": "group_rows",
    "_add_lora": "add_lora",
}  # old private name -> its public name now

warnings.warn(
    "masenvs.adapters.backends.llama moved to masenvs.engine.forward, masenvs.engine.quant, masenvs.engine.lora; import from there",
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
