"""Deprecated: moved to masenvs.engine.engine (this path goes away in the next release)."""

import sys
import warnings

from masenvs.engine import engine as _new

warnings.warn(
    "masenvs.adapters.backends.embedded moved to masenvs.engine.engine; import it from there",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = _new
