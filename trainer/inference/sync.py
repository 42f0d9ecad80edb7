"""After each update the new weights reach the backend that samples the next batch.

LoRA (`policy.finetune: lora`): in place for the embedded engine; for vLLM each adapter is
saved and replaced under its name (`/v1/load_lora_adapter` with `load_inplace`). Full
fine-tuning (`policy.finetune: full`): the embedded engine copies the learner's weights into
its base model; vLLM reloads them from a safetensors file (`VLLMBackend.update_weights`).
`push` is awaited from the training loop, between a step's update and the next rollouts.

Sync only syncs: `engines.open_inference` started the backend from the run's plan, with a
`RouterBackend` in front when the policies need several served models; `WeightSync` sends
each policy's weights to its own.
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

from masenvs.adapters.backends.router import RouterBackend
from masenvs.adapters.stack import StackError
from masenvs.engine.protocol import Backend
from masenvs.trainer.learner.learner import Learner

KEEP_VERSIONS = 2  # sync files kept per policy; the server has read the older ones


class SyncError(StackError):
    """New weights cannot reach this backend; the message names the cause and the fix."""


class WeightSync:
    """Sends every policy's new weights to the backend after a training step.

    Behind a `RouterBackend` (several vLLM servers or engines) each policy's weights go to
    the backend that serves it, under the name it has there.
    """

    def __init__(self, learner: Learner, backend: Backend, sync_dir: str | Path) -> None:
        self.learner = learner
        self.backend = backend
        self.sync_dir = Path(sync_dir)
        self.full = learner.cfg.policy.finetune == "full"
        targets = backend.backends if isinstance(backend, RouterBackend) else [backend]
        self._targets = targets
        if self.full:  # in place into an engine that takes whole weights, else via files
            self.in_place = all(hasattr(b, "set_base_weights") for b in targets)
        else:
            self.in_place = all(
                hasattr(b, "set_adapter_weights") and hasattr(b, "add_adapter") for b in targets
            )
        self._loaded: set[str] = set()
        if self.full and not self.in_place:
            if not all(hasattr(b, "update_weights") for b in targets):
                raise SyncError(
                    f"the {getattr(backend, 'name', type(backend).__name__)} backend cannot "
                    "take full weights at run time; use policy.finetune: lora, or the embedded "
                    "or vllm backend"
                )
            self._check_one_trained_policy_per_server()

    async def push(self, version: int) -> None:
        """Send every policy's weights; `version` names the files of a server sync.

        Behind pools of engines (distributed.engines) the push is one update per pool: it
        runs between steps, once the step's rollouts have returned, so it ends them there;
        calls wait while it is applied and then record `version`."""
        pools = [b for b in self._targets if hasattr(b, "updating")]
        async with contextlib.AsyncExitStack() as updates:
            for pool in pools:
                pool.end_rollouts()  # type: ignore[attr-defined]
                await updates.enter_async_context(pool.updating(version))  # type: ignore[attr-defined]
            await self._push(version)

    async def _push(self, version: int) -> None:
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
            return  # untrained: each server already serves its policy's base weights
        for policy in self.learner.policies:
            if not self.learner.trains(policy):
                continue  # a frozen policy keeps the base's weights
            weights = self.learner.full_state_dict(policy)
            if self.in_place:
                self.backend.set_base_weights(policy, weights)  # type: ignore[attr-defined]
                continue
            from safetensors.torch import save_file

            directory = self.sync_dir / "full" / policy / f"v{version:06d}"
            directory.mkdir(parents=True, exist_ok=True)
            tensors = {name: t.detach().contiguous().cpu() for name, t in weights.items()}
            save_file(tensors, str(directory / "model.safetensors"))
            await self._server_of(policy).update_weights(directory)  # type: ignore[attr-defined]
            _prune(self.sync_dir / "full" / policy)

    def _server_of(self, policy: str) -> Backend:
        if isinstance(self.backend, RouterBackend):
            return self.backend.route(policy).backend
        return self.backend

    def _check_one_trained_policy_per_server(self) -> None:
        """A server holds one set of base weights: two trained policies cannot share it."""
        trained = [p for p in self.learner.policies if self.learner.trains(p)]
        owner: dict[int, str] = {}
        for policy in trained:
            server = self._server_of(policy)
            if id(server) in owner:
                raise SyncError(
                    f"policies {owner[id(server)]!r} and {policy!r} are fully fine-tuned but "
                    "served by one vLLM server, which holds one set of weights; give each its "
                    "own server in backend.vllm_url (or leave it unset so the trainer starts them)"
                )
            owner[id(server)] = policy


def _prune(folder: Path) -> None:
    for old in sorted(folder.glob("v*"))[:-KEEP_VERSIONS]:
        shutil.rmtree(old, ignore_errors=True)
