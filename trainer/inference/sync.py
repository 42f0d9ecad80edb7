"""After each update the new weights reach the backend that samples the next batch.

LoRA (`policy.finetune: lora`): in place for the embedded engine; for vLLM each adapter is
saved and replaced under its name (`/v1/load_lora_adapter` with `load_inplace`). Full
fine-tuning (`policy.finetune: full`): the embedded engine copies the learner's weights into
its base model; vLLM reloads them from a safetensors file (`VLLMBackend.update_weights`).
`push` is awaited from the training loop, between a step's update and the next rollouts.

One vLLM server serves one base model with one set of weights; `vllm_backend` starts (or
connects to) as many as the policies need and puts a `RouterBackend` in front, and
`WeightSync` sends each policy's weights to its own server.
"""

from __future__ import annotations

import contextlib
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from masenvs.adapters.backends.launch import (
    VLLMLaunchError,
    check_cpu_model,
    cpu_only,
    lora_rank_for,
    model_dir,
)
from masenvs.adapters.backends.router import Route, RouterBackend
from masenvs.adapters.backends.vllm import VLLMBackend
from masenvs.adapters.stack import StackError
from masenvs.engine.protocol import Backend, BackendError
from masenvs.trainer.config import TrainConfig
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
        self.routed = isinstance(backend, RouterBackend)
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

    def served_as(self, policy: str) -> str:
        """The model name requests of `policy` go to: its adapter, or with full weights on one
        server, the base model itself (it is the policy); a router resolves policy names."""
        return "base" if self.full and not self.in_place and not self.routed else policy

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


@dataclass
class PolicyServer:
    """One vLLM server of a run: the model it serves and the policies routed to it."""

    model: str
    policies: list[str] = field(default_factory=list)
    url: str | None = None
    trained: bool = False  # holds one fully fine-tuned policy's weights, so serves only it


def vllm_servers(learner: Learner) -> list[PolicyServer]:
    """The servers a run needs: one per base model with LoRA (its policies are adapters on
    it); with full fine-tuning one per trained policy (the server's weights are that policy)
    and one per base model that frozen policies share."""
    servers: dict[str, PolicyServer] = {}
    for name, policy in learner.policies.items():
        own = learner.full and learner.trains(name)
        key = f"policy:{name}" if own else f"base:{policy.base_name}"
        servers.setdefault(key, PolicyServer(policy.base_name, trained=own)).policies.append(name)
    return list(servers.values())


def vllm_backend(cfg: TrainConfig, learner: Learner, run_dir: Path) -> Backend:
    """The vLLM backend of a run: the servers at `backend.vllm_url`, or ones started here.

    One server serves one base model, so the policies may need several (`vllm_servers`);
    then a `RouterBackend` sends each policy's requests to its server. A started server
    serves its model with LoRA (rank >= lora.rank, one slot per policy on it) and, for full
    fine-tuning, the endpoints that take new weights; it logs to `<run_dir>/vllm.log`
    (`vllm-<policies>.log` when there are several), and `shutdown()` (which `Stack.close`
    calls) stops every one.
    """
    b = cfg.backend
    servers = vllm_servers(learner)
    if isinstance(b.vllm_url, str) and b.vllm_url:
        if len(servers) > 1:
            raise StackError(
                f"backend.vllm_url names one vLLM server, but these policies need "
                f"{len(servers)} ({_describe(servers)}); give a mapping {{policy or base model: "
                "URL}, or leave it unset so the trainer starts them"
            )
        return _connect(b.vllm_url, b.request_timeout)
    if b.vllm_url:  # a mapping: user-run servers, found by policy name, then base model
        return _connect_servers(_assign_urls(servers, b.vllm_url), b.request_timeout, learner)
    return _launch_servers(cfg, servers, run_dir)


def _describe(servers: list[PolicyServer]) -> str:
    return "; ".join(f"{'+'.join(s.policies)} on {s.model}" for s in servers)


def _connect(url: str, timeout: float) -> VLLMBackend:
    try:
        return VLLMBackend(url, timeout=timeout)
    except BackendError as exc:
        raise StackError(f"backend.vllm_url: {exc}") from exc


def _assign_urls(servers: list[PolicyServer], urls: dict[str, str]) -> list[PolicyServer]:
    """Each policy's URL: `urls[policy]`, else `urls[its base model]`; policies that share
    a URL share that server."""
    by_url: dict[str, PolicyServer] = {}
    for server in servers:
        for policy in server.policies:
            url = urls.get(policy) or urls.get(server.model)
            if url is None:
                raise StackError(
                    f"backend.vllm_url has no server for policy {policy!r} (base model "
                    f"{server.model}); add `{policy}: <url>` to it"
                )
            entry = by_url.setdefault(url, PolicyServer(server.model, url=url))
            if entry.model != server.model:
                raise StackError(
                    f"backend.vllm_url sends {entry.policies} ({entry.model}) and {policy!r} "
                    f"({server.model}) to one server {url}, which serves one base model; "
                    "give each base model its own URL"
                )
            if entry.policies and (entry.trained or server.trained):
                raise StackError(
                    f"backend.vllm_url sends {entry.policies} and {policy!r} to one server "
                    f"{url}, but a fully fine-tuned policy's server holds its weights alone; "
                    "give each of them its own URL"
                )
            entry.trained = server.trained
            entry.policies.append(policy)
    return list(by_url.values())


def _connect_servers(servers: list[PolicyServer], timeout: float, learner: Learner) -> Backend:
    if len(servers) == 1:
        return _connect(servers[0].url or "", timeout)
    backends = [_connect(s.url or "", timeout) for s in servers]
    return _router(servers, backends, learner.full)


def _router(servers: list[PolicyServer], backends: list[VLLMBackend], full: bool) -> RouterBackend:
    # Full fine-tuning: a policy is its server's base model (""); LoRA: its adapter there.
    routes = {
        policy: Route(backend, "" if full else policy)
        for server, backend in zip(servers, backends, strict=True)
        for policy in server.policies
    }
    return RouterBackend(routes)


def _launch_servers(cfg: TrainConfig, servers: list[PolicyServer], run_dir: Path) -> Backend:
    """Start every server at once (each waits for its own health check), or none."""
    b = cfg.backend
    full = cfg.policy.finetune == "full"
    extra_args = list(b.vllm_args)
    if len(servers) > 1 and not cpu_only() and "--gpu-memory-utilization" not in extra_args:
        # vLLM's default (0.9 of the GPU) for each would leave the second one nothing.
        extra_args += ["--gpu-memory-utilization", f"{0.9 / len(servers):.2f}"]

    def error(server: PolicyServer, exc: Exception) -> StackError:
        policies = ", ".join(server.policies)
        return StackError(f"could not start vLLM for {server.model} (policies {policies}): {exc}")

    paths = {}  # before any server starts, in this thread: "tiny"-style names convert once
    for server in servers:
        try:
            paths[server.model] = model_dir(server.model)
            if cpu_only():
                check_cpu_model(paths[server.model])
        except VLLMLaunchError as exc:
            raise error(server, exc) from exc

    def launch(server: PolicyServer) -> VLLMBackend:
        name = "vllm" if len(servers) == 1 else f"vllm-{'+'.join(server.policies)}"
        try:
            return VLLMBackend.launch(
                paths[server.model],
                request_timeout=b.request_timeout,
                python=b.vllm_python,
                max_loras=max(len(server.policies), 1),
                max_lora_rank=lora_rank_for(cfg.lora.rank),
                extra_args=extra_args,
                weight_updates=full,
                log_path=run_dir / f"{name}.log",
            )
        except (VLLMLaunchError, BackendError) as exc:
            raise error(server, exc) from exc

    if len(servers) == 1:
        return launch(servers[0])
    pool = ThreadPoolExecutor(len(servers), thread_name_prefix="vllm-launch")
    futures = [pool.submit(launch, server) for server in servers]
    try:
        pool.shutdown(wait=True)  # every launch ends: healthy, failed or timed out
        for future in futures:
            if future.exception() is not None:
                raise future.exception()  # type: ignore[misc]
        return _router(servers, [f.result() for f in futures], full)
    except BaseException:
        # Also on Ctrl-C: let the other launches end, then stop every server that started.
        pool.shutdown(wait=True)
        for future in futures:
            if future.done() and future.exception() is None:
                future.result().shutdown()
        raise
