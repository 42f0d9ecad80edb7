"""Deprecated: moved to masenvs.engine.loading (this path goes away in the next release)."""

import sys
import warnings

from masenvs.engine import loading as _new

warnings.warn(
    "masenvs.adapters.models moved to masenvs.engine.loading; import it from there",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = _new
