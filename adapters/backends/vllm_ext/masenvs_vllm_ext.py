"""Runs inside vLLM's workers: loads new full weights from safetensors files in place.

`launch_vllm(weight_updates=True)` starts vLLM with
`--worker-extension-cls masenvs_vllm_ext.WeightUpdateExtension` and this folder on its
PYTHONPATH (vLLM's environment does not have masenvs, and this file imports nothing of
it). `VLLMBackend.update_weights` calls the method below through `/collective_rpc`, the way
TRL's `vllm-serve` feeds new weights to `model.load_weights`, but from files instead of
NCCL. vLLM's own `reload_weights` cannot be used: with tied embeddings (SmolLM2, Qwen3
small models) it leaves the LM head on the old weights.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any


class WeightUpdateExtension:
    """Mixed into vLLM's worker class; `self` is the worker."""

    def masenvs_load_weights(self, path: str) -> int:
        """Copy every tensor of the safetensors file(s) at `path` into the served model."""
        from safetensors import safe_open

        source = Path(path)
        files = sorted(source.glob("*.safetensors")) if source.is_dir() else [source]
        if not files:
            raise FileNotFoundError(f"no *.safetensors file at {source}")

        def weights() -> Iterator[tuple[str, Any]]:
            for file in files:
                with safe_open(str(file), framework="pt", device="cpu") as reader:
                    for name in reader.keys():  # noqa: SIM118 (safe_open is not a dict)
                        yield name, reader.get_tensor(name)

        model: Any = self.model_runner.get_model()  # type: ignore[attr-defined]
        loaded = model.load_weights(weights())
        return len(loaded) if loaded is not None else 0
