"""Where masenvs caches what it builds or converts: `$MASENVS_CACHE`, or ~/.cache/masenvs."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """masenvs's cache: `$MASENVS_CACHE`, or ~/.cache/masenvs (read now, not at import)."""
    root = os.environ.get("MASENVS_CACHE") or os.path.join("~", ".cache", "masenvs")
    return Path(root).expanduser()
