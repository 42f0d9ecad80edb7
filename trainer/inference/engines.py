"""The run's inference opened: `open_inference` starts or reaches every engine an
`InferencePlan` names and returns the one backend the capture endpoint calls.

- backend.kind 'embedded': one engine in this process per served model.
- 'vllm': the servers at `backend.vllm_url`, or one vLLM server per served model started
  here (each waits for its own health check; all start, or none stays up).
- `distributed.engines`: each served model gets `count` replicas (`masenvs serve --engine`
  subprocesses for 'embedded', vLLM servers for 'vllm', one GPU each when there are enough)
  behind an `EnginePool`, which routes over them and restarts the ones started here;
  `engines.urls` names running replicas of a single served model instead.

Several served models sit behind a `RouterBackend` that sends each policy to its own. The
backend's `shutdown()` (which `Stack.close` calls) stops everything started here.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from masenvs.adapters.backends.launch import (
    VLLMLaunchError,
    check_cpu_model,
    cpu_only,
    launch_engine_server,
    lora_rank_for,
    model_dir,
)
from masenvs.adapters.backends.pool import EnginePool
from masenvs.adapters.backends.router import Route, RouterBackend
from masenvs.adapters.backends.vllm import VLLMBackend
from masenvs.adapters.stack import StackError, make_backend
from masenvs.engine.loading import load_tokenizer
from masenvs.engine.protocol import Backend, BackendError
from masenvs.listeners import ENGINES_API_KEY_ENV
from masenvs.trainer.inference.plan import InferencePlan, ServedModel

Launcher = tuple[str, Callable[[], Backend]]  # a name for errors, and what starts it


def open_inference(plan: InferencePlan, run_dir: Path) -> Backend:
    """Start (or reach) every engine of `plan`; servers log to `run_dir`."""
    if plan.pooled:
        return engine_pools(plan, run_dir)
    if plan.kind == "embedded":
        engines: list[Backend] = []
        try:
            for served in plan.served:
                engines.append(make_backend(served.model, "embedded", engine=plan.engine))
        except BaseException:
            for engine in engines:
                engine.shutdown()  # type: ignore[attr-defined]
            raise
        return _front(plan, engines)
    if all(s.url for s in plan.served):
        return _front(plan, [_connect(s.url or "", plan.timeout) for s in plan.served])
    launchers = []
    for served in plan.served:
        name = "vllm" if len(plan.served) == 1 else f"vllm-{served.label}"
        what = f"vLLM for {served.model} (policies {', '.join(served.policies)})"
        launchers.append((what, _vllm_launcher(plan, served, run_dir / f"{name}.log", 0)))
    return _front(plan, _start_all(launchers))


def engine_pools(plan: InferencePlan, run_dir: Path) -> Backend:
    """One pool of `engines.count` replicas (or of `engines.urls`) per served model."""
    e = plan.engines
    pool_options: dict[str, Any] = {
        "affinity": e.affinity,
        "allow_mixed_versions": e.allow_mixed_versions,
        "max_restarts": e.max_restarts,
        "update_timeout": plan.timeout,
    }
    tokenizers = {s.model: load_tokenizer(s.model) for s in plan.served}  # once, on this thread
    if e.urls:
        backends = []
        for url in e.urls:
            try:
                tokenizer = tokenizers[plan.served[0].model]
                key = os.environ.get(ENGINES_API_KEY_ENV)
                backends.append(
                    VLLMBackend(url, api_key=key, timeout=plan.timeout, tokenizer=tokenizer)
                )
            except BackendError as exc:
                raise StackError(f"distributed.engines.urls: {exc}") from exc
        return EnginePool(
            backends, names=list(e.urls), report=run_dir / "engines.json", **pool_options
        )

    one = len(plan.served) == 1
    labels = [
        f"engine-{i}" if one else f"engine-{served.label}-{i}"
        for served in plan.served
        for i in range(e.count)
    ]
    launchers = []
    for k, served in enumerate(plan.served):
        for i in range(e.count):
            slot = k * e.count + i
            log_path = run_dir / f"{labels[slot]}.log"
            if plan.kind == "embedded":
                start = _engine_server(plan, served, log_path, tokenizers[served.model])
            else:
                start = _vllm_launcher(plan, served, log_path, slot)
            launchers.append((labels[slot], start))
    started = _start_all(launchers)
    pools = []
    for k, served in enumerate(plan.served):
        mine = range(k * e.count, (k + 1) * e.count)
        report = "engines.json" if one else f"engines-{served.label}.json"
        pools.append(
            EnginePool(
                [started[i] for i in mine],
                restart=[launchers[i][1] if e.restart else None for i in mine],
                names=[labels[i] for i in mine],
                report=run_dir / report,
                **pool_options,
            )
        )
    return _front(plan, pools)


def _front(plan: InferencePlan, backends: list[Backend]) -> Backend:
    """The one backend of the served models, or a router that sends each policy to its own:
    with full weights a policy is its backend's base model (""), with LoRA its adapter."""
    if not plan.routed:
        return backends[0]
    return RouterBackend(
        {
            policy: Route(backend, "" if plan.full else policy)
            for served, backend in zip(plan.served, backends, strict=True)
            for policy in served.policies
        }
    )


def _connect(url: str, timeout: float) -> VLLMBackend:
    try:
        return VLLMBackend(url, timeout=timeout)
    except BackendError as exc:
        raise StackError(f"backend.vllm_url: {exc}") from exc


def _engine_server(
    plan: InferencePlan, served: ServedModel, log_path: Path, tokenizer: Any
) -> Callable[[], Backend]:
    """What starts one `masenvs serve --engine` replica (again, on a restart)."""
    engine = plan.engine
    if engine.device == "cpu":  # the replicas share the cores rather than each taking all
        total = plan.engines.count * len(plan.served)
        engine = dataclasses.replace(engine, threads=max(1, (os.cpu_count() or 1) // total))

    def start() -> Backend:
        handle = launch_engine_server(
            served.model, engine=engine, log_path=log_path, timeout=plan.timeout
        )
        try:
            return VLLMBackend(
                handle.url, tokenizer=tokenizer, timeout=plan.timeout, process=handle
            )
        except BaseException:
            handle.stop()
            raise

    return start


def _vllm_launcher(
    plan: InferencePlan, served: ServedModel, log_path: Path, slot: int
) -> Callable[[], Backend]:
    """What starts one vLLM server for `served` (`slot` of the run's servers): LoRA of at
    least the run's rank, one slot per policy on it, the weight-update routes for full
    fine-tuning; on a GPU, one each when there are enough, else a share of one."""
    try:  # here, before any server starts: "tiny"-style names convert once
        path = model_dir(served.model)
        if cpu_only():
            check_cpu_model(path)
    except VLLMLaunchError as exc:
        policies = ", ".join(served.policies)
        raise StackError(
            f"could not start vLLM for {served.model} (policies {policies}): {exc}"
        ) from exc
    extra_args, env = list(plan.vllm_args), {}
    total = plan.engines.count * len(plan.served)
    if total > 1 and not cpu_only():
        if _gpu_count() >= total:
            env["CUDA_VISIBLE_DEVICES"] = str(slot)
        elif "--gpu-memory-utilization" not in extra_args:
            # vLLM's default (0.9 of the GPU) for each would leave the second one nothing.
            extra_args += ["--gpu-memory-utilization", f"{0.9 / total:.2f}"]

    def start() -> Backend:
        return VLLMBackend.launch(
            path,
            request_timeout=plan.timeout,
            python=plan.vllm_python,
            max_loras=max(len(served.policies), 1),
            max_lora_rank=lora_rank_for(plan.lora_rank),
            extra_args=extra_args,
            env=env,
            weight_updates=plan.full,
            log_path=log_path,
        )

    return start


def _start_all(launchers: list[Launcher]) -> list[Backend]:
    """Start every one at once, or none: when one fails (or on Ctrl-C) the others' launches
    end and the ones that started stop again."""
    pool = ThreadPoolExecutor(len(launchers), thread_name_prefix="engine-launch")
    futures = [pool.submit(start) for _, start in launchers]
    try:
        pool.shutdown(wait=True)  # every launch ends: healthy, failed or timed out
        for (name, _), future in zip(launchers, futures, strict=True):
            exc = future.exception()
            if isinstance(exc, (VLLMLaunchError, BackendError, OSError)):
                raise StackError(f"could not start {name}: {exc}") from exc
            if exc is not None:
                raise exc
        return [f.result() for f in futures]
    except BaseException:
        pool.shutdown(wait=True)
        for future in futures:
            if future.done() and future.exception() is None:
                getattr(future.result(), "shutdown", lambda: None)()
        raise


def _gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except ImportError:
        return 0
