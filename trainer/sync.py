"""After each update the new weights reach the backend that samples the next batch.

LoRA (`policy.finetune: lora`): in place for the embedded engine; for vLLM each adapter is
saved and replaced under its name (`/v1/load_lora_adapter` with `load_inplace`). Full
fine-tuning (`policy.finetune: full`): the embedded engine copies the learner's weights into
its base model; vLLM reloads them from a safetensors file (`VLLMBackend.update_weights`).
`push` is awaited from the training loop, between a step's update and the next rollouts.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from masenvs.adapters.backends.base import Backend, BackendError
from masenvs.adapters.backends.vllm import (
    VLLMBackend,
    VLLMLaunchError,
    check_cpu_model,
    cpu_only,
    lora_rank_for,
    model_dir,
)
from masenvs.adapters.stack import StackError
from masenvs.trainer.config import TrainConfig
from masenvs.trainer.learner import Learner

KEEP_VERSIONS = 2  # sync files kept per policy; the server has read the older ones


class SyncError(StackError):
    """New weights cannot reach this backend; the message names the cause and the fix."""


class WeightSync:
    """Sends every policy's new weights to the backend after a training step."""

    def __init__(self, learner: Learner, backend: Backend, sync_dir: str | Path) -> None:
        self.learner = learner
        self.backend = backend
        self.sync_dir = Path(sync_dir)
        self.full = learner.cfg.policy.finetune == "full"
        if self.full:  # in place into an engine that takes whole weights, else via files
            self.in_place = hasattr(backend, "set_base_weights")
        else:
            self.in_place = hasattr(backend, "set_adapter_weights") and hasattr(
                backend, "add_adapter"
            )
        self._loaded: set[str] = set()
        if self.full and not self.in_place:
            if not hasattr(backend, "update_weights"):
                raise SyncError(
                    f"the {getattr(backend, 'name', type(backend).__name__)} backend cannot "
                    "take full weights at run time; use policy.finetune: lora, or the embedded "
                    "or vllm backend"
                )
            if len(learner.policies) != 1:
                raise SyncError(
                    f"full fine-tuning trains {len(learner.policies)} models, but one vLLM "
                    "server serves one base model; set policy.mode: shared, or train LoRA "
                    "adapters (policy.finetune: lora)"
                )

    def served_as(self, policy: str) -> str:
        """The model name requests of `policy` go to: its adapter, or with full weights on a
        server, the base model itself (it is the policy)."""
        return "base" if self.full and not self.in_place else policy

    async def push(self, version: int) -> None:
        """Send every policy's weights; `version` names the files of a server sync."""
        if self.full:
            await self._push_full(version)
            return
        lora = self.learner.cfg.lora
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
            # Same name, new weights: vLLM replaces the adapter in place (load_inplace).
            await self.backend.load_adapter(policy, str(path))
            _prune(self.sync_dir / policy)

    async def _push_full(self, version: int) -> None:
        if version == 0 and not self.in_place:
            return  # untrained: the server already serves these base weights
        for policy in self.learner.policies:
            if not self.learner.trains(policy):
                continue  # a frozen policy keeps the base's weights
            weights = self.learner.full_state_dict(policy)
            if self.in_place:
                self.backend.set_base_weights(policy, weights)  # type: ignore[attr-defined]
                continue
            from safetensors.torch import save_file

            directory = self.sync_dir / "full" / f"v{version:06d}"
            directory.mkdir(parents=True, exist_ok=True)
            tensors = {name: t.detach().contiguous().cpu() for name, t in weights.items()}
            save_file(tensors, str(directory / "model.safetensors"))
            await self.backend.update_weights(directory)  # type: ignore[attr-defined]
            _prune(self.sync_dir / "full")


def _prune(folder: Path) -> None:
    for old in sorted(folder.glob("v*"))[:-KEEP_VERSIONS]:
        shutil.rmtree(old, ignore_errors=True)


def vllm_backend(cfg: TrainConfig, policies: int, log_path: Path) -> VLLMBackend:
    """The vLLM backend of a run: the server at `backend.vllm_url`, or one started here.

    A started server serves `model.name` with LoRA (rank >= lora.rank, one slot per policy)
    and, for full fine-tuning, the endpoints that take new weights; `shutdown()` (which
    `Stack.close` calls) stops it.
    """
    b = cfg.backend
    if b.vllm_url:
        try:
            return VLLMBackend(b.vllm_url, timeout=b.request_timeout)
        except BackendError as exc:
            raise StackError(f"backend.vllm_url: {exc}") from exc
    options: dict[str, Any] = {
        "python": b.vllm_python,
        "max_loras": max(policies, 1),
        "max_lora_rank": lora_rank_for(cfg.lora.rank),
        "extra_args": b.vllm_args,
        "weight_updates": cfg.policy.finetune == "full",
        "log_path": log_path,
    }
    try:
        if cpu_only():
            check_cpu_model(model_dir(cfg.model.name))
        return VLLMBackend.launch(cfg.model.name, request_timeout=b.request_timeout, **options)
    except (VLLMLaunchError, BackendError) as exc:
        raise StackError(f"could not start vLLM for {cfg.model.name}: {exc}") from exc
