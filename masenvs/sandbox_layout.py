"""Deprecated: moved to masenvs.sandbox.layout (this path goes away in the next release)."""

import sys
import warnings

from masenvs.sandbox import layout as _new

warnings.warn(
    "masenvs.sandbox_layout moved to masenvs.sandbox.layout; import it from there",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = _new
