"""What a peft LoRA adapter directory must hold, checked without torch.

`masenvs serve` checks every `--adapter` path with it before the model loads; `lora`'s
reader checks through it too, so both refuse a directory with the same sentence.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from masenvs.engine.protocol import BackendError

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")  # peft's, in its order


@dataclass(frozen=True)
class AdapterDir:
    """A checked peft LoRA directory: its adapter_config.json and its weights file."""

    path: Path
    config: dict[str, Any]
    weights: Path


def check_adapter_dir(path: Path) -> AdapterDir:
    """The LoRA adapter at `path`, or a BackendError naming what is missing and the fix."""
    what = f"{path} is not a peft adapter directory"
    fix = "pass the directory a run or peft's save_pretrained wrote (runs/<run>/adapters/<agent>)"
    if not path.exists():
        raise BackendError(f"{what} (it does not exist); {fix}.")
    if not path.is_dir():
        raise BackendError(f"{what} (it is a file); {fix}.")
    config_file = path / CONFIG_FILE
    if not config_file.is_file():
        raise BackendError(f"{what} (no {CONFIG_FILE}); {fix}.")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise BackendError(f"{config_file} is not readable JSON ({exc}); {fix}.") from exc
    if not isinstance(config, dict):
        raise BackendError(f"{config_file} holds no JSON object; {fix}.")
    if config.get("peft_type", "LORA") != "LORA" or config.get("use_dora"):
        kind = "DoRA" if config.get("use_dora") else config.get("peft_type")
        raise BackendError(f"{path} holds a {kind} adapter; the embedded engine runs plain LoRA.")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise BackendError(f"{config_file} has no LoRA rank r (a positive integer); {fix}.")
    for name in WEIGHT_FILES:
        if (path / name).is_file():
            return AdapterDir(path, config, path / name)
    raise BackendError(f"{path} has no adapter weights ({' or '.join(WEIGHT_FILES)}); {fix}.")
