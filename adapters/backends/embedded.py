"""Deprecated: masenvs.adapters.backends.embedded was split into masenvs.engine.engine, masenvs.engine.scheduler, masenvs.engine.prefix_cache, masenvs.engine.sequence, masenvs.engine.output, masenvs.engine.lora.

This path goes away in the next release. Every name the old module had, public or private,
resolves to the same object in its new module (a few private ones under a public name).
"""

import importlib
import warnings
from typing import Any

_MODULES = (
    "masenvs.engine.engine",
    "masenvs.engine.scheduler",
    "masenvs.engine.prefix_cache",
    "masenvs.engine.sequence",
    "masenvs.engine.output",
    "masenvs.engine.lora",
)
_RENAMED = {
    "_Request": "Request",
    "_Sequence": "Sequence",
    "_AdapterUpdate": "AdapterUpdate",
    "_send": "send",
    "_common_prefix": "common_prefix",
    "_read_peft_dir": "read_peft_dir",
}  # old private name -> its public name now

warnings.warn(
    "masenvs.adapters.backends.embedded moved to masenvs.engine.engine, masenvs.engine.scheduler, masenvs.engine.prefix_cache, masenvs.engine.sequence, masenvs.engine.output, masenvs.engine.lora; import from there",
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
