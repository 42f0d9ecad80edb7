"""Deprecated: moved to masenvs.engine.protocol (this path goes away in the next release)."""

import sys
import warnings

from masenvs.engine import protocol as _new

warnings.warn(
    "masenvs.adapters.backends.base moved to masenvs.engine.protocol; import it from there",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = _new
