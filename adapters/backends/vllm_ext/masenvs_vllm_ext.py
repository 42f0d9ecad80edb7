"""Runs inside vLLM's workers: loads new full weights from safetensors files in place.

`launch_vllm(weight_updates=True)` starts vLLM with
`--worker-extension-cls masenvs_vllm_ext.WeightUpdateExtension` and this folder on its
PYTHONPATH (vLLM's environment does not have masenvs, and this file imports nothing of
it). `VLLMBackend.update_weights` calls the method below through `/collective_rpc`: new
weights from files, where TRL's `vllm-serve` sends them over NCCL.

The weights go through vLLM's own in-place reload (`Worker.reload_weights`), which redoes
what loading does after the copy (the CPU build repacks every matrix for its GEMM
kernels, so a bare `model.load_weights` would write into emptied parameters). That reload
skips a tied LM head (the checkpoint has no `lm_head.weight`) and leaves its packed copy
on the old embeddings, so the head is tied again and repacked here (SmolLM2 and the small
Qwen3 models tie them).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any


class WeightUpdateExtension:
    """Mixed into vLLM's worker class; `self` is the worker."""

    def masenvs_load_weights(self, path: str) -> int:
        """Load every tensor of the safetensors file(s) at `path`; returns how many."""
        from safetensors import safe_open

        source = Path(path)
        files = sorted(source.glob("*.safetensors")) if source.is_dir() else [source]
        if not files:
            raise FileNotFoundError(f"no *.safetensors file at {source}")
        count = 0

        def weights() -> Iterator[tuple[str, Any]]:
            nonlocal count
            for file in files:
                with safe_open(str(file), framework="pt", device="cpu") as reader:
                    for name in reader.keys():  # noqa: SIM118 (safe_open is not a dict)
                        count += 1
                        yield name, reader.get_tensor(name)

        worker: Any = self
        worker.reload_weights(weights_iterator=weights())
        model = worker.model_runner.get_model()
        config = worker.vllm_config.model_config.hf_text_config
        lm_head = getattr(model, "lm_head", None)
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        if getattr(config, "tie_word_embeddings", False) and lm_head is not None and embed:
            lm_head.weight = embed.weight
            method = getattr(lm_head, "quant_method", None)
            if method is not None:
                method.process_weights_after_loading(lm_head)
        return count
