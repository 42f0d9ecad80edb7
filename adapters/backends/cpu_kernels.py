"""Deprecated: moved to masenvs.engine.kernels (this path goes away in the next release)."""

import sys
import warnings

from masenvs.engine import kernels as _new

warnings.warn(
    "masenvs.adapters.backends.cpu_kernels moved to masenvs.engine.kernels; import it from there",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = _new
