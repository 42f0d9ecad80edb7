"""The embedded inference engine: a transformers causal LM served in-process with PyTorch.

Read it in the order a request travels:

- `engine`: `EmbeddedBackend`, the front door (checks a request, renders its prompt);
- `sequence`: the request and its sequences while they run;
- `scheduler`: the engine thread (admit, prefill, decode steps, retire);
- `prefix_cache`: KV rows kept for prompts that extend earlier ones;
- `forward`: the Llama-family forward pass over the slot KV cache;
- `quant`, `kernels`: low-bit weights and the native CPU kernels (C sources in kernels/);
- `lora`: LoRA adapters per batch row, hot-swapped between steps;
- `sampling`, `output`: from logits to tokens, from tokens to text and results;
- `loading`: the models and tokenizers (GGUF, hub, local directories); `omp`: threads;
- `protocol`: the request and result types every backend (this engine, vLLM) shares.

`from masenvs.engine import EmbeddedBackend, load_model` works without importing the
submodules up front (the package itself imports no torch).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "EmbeddedBackend": "masenvs.engine.engine",
    "LoadedModel": "masenvs.engine.loading",
    "ModelLoadError": "masenvs.engine.loading",
    "load_model": "masenvs.engine.loading",
    "load_tokenizer": "masenvs.engine.loading",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'masenvs.engine' has no attribute {name!r}")
