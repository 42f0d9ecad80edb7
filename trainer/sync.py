"""After each update the new adapter weights reach the backend that samples the next batch."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

from masenvs.adapters.backends.base import Backend
from masenvs.trainer.learner import Learner


class WeightSync:
    """In place for the embedded engine; save + `load_adapter` (vLLM's /v1/load_lora_adapter)
    for a server backend. Full fine-tuning: whole weights through `set_base_weights`."""

    def __init__(self, learner: Learner, backend: Backend, sync_dir: str | Path) -> None:
        self.learner = learner
        self.backend = backend
        self.sync_dir = Path(sync_dir)
        self.in_place = hasattr(backend, "set_adapter_weights") and hasattr(backend, "add_adapter")
        self._loaded: set[str] = set()

    def push(self, version: int) -> None:
        """Send every policy's adapter weights; `version` names the files of a server sync."""
        lora = self.learner.cfg.lora
        if self.learner.full and hasattr(self.backend, "set_base_weights"):
            # Full fine-tuning, in place: whole weights; frozen policies keep the base's.
            for policy in self.learner.policies:
                if self.learner.trains(policy):
                    self.backend.set_base_weights(policy, self.learner.full_state_dict(policy))
            return
        for policy in self.learner.policies:
            if self.in_place:
                weights = self.learner.adapter_state_dict(policy)
                if policy in self._loaded:
                    self.backend.set_adapter_weights(policy, weights)
                else:
                    self.backend.add_adapter(policy, weights, rank=lora.rank, alpha=lora.alpha)
                    self._loaded.add(policy)
                continue
            path = self.sync_dir / policy / f"v{version:06d}"
            self.learner.save_adapter(policy, path)
            asyncio.run(self.backend.load_adapter(policy, str(path)))
            for old in sorted((self.sync_dir / policy).glob("v*"))[:-2]:
                shutil.rmtree(old, ignore_errors=True)  # the server has read them already
