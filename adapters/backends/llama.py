"""Deprecated: moved to masenvs.engine.forward (this path goes away in the next release)."""

import sys
import warnings

from masenvs.engine import forward as _new

warnings.warn(
    "masenvs.adapters.backends.llama moved to masenvs.engine.forward; import it from there",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = _new
