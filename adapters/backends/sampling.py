"""Deprecated: moved to masenvs.engine.sampling (this path goes away in the next release)."""

import sys
import warnings

from masenvs.engine import sampling as _new

warnings.warn(
    "masenvs.adapters.backends.sampling moved to masenvs.engine.sampling; import it from there",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = _new
