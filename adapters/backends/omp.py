"""Deprecated: moved to masenvs.engine.omp (this path goes away in the next release)."""

import sys
import warnings

from masenvs.engine import omp as _new

warnings.warn(
    "masenvs.adapters.backends.omp moved to masenvs.engine.omp; import it from there",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = _new
