"""Several engines per served model (`distributed.engines`), each behind a pool.

The run needs one served model per base (LoRA) or per fully fine-tuned policy
(`sync.vllm_servers`); with `engines.count` N each gets N replicas: `masenvs serve --engine`
subprocesses for backend.kind 'embedded', vLLM servers for 'vllm' (one GPU each when there
are enough GPUs). `engines.urls` names running replicas of a single served model instead.
An `EnginePool` routes over the replicas and restarts the ones started here; `WeightSync`
reaches every replica through it (adapter files, or full weights by file).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from masenvs.adapters.backends.launch import (
    VLLMLaunchError,
    check_cpu_model,
    cpu_only,
    lora_rank_for,
    model_dir,
)
from masenvs.adapters.backends.pool import EnginePool
from masenvs.adapters.backends.router import Route, RouterBackend
from masenvs.adapters.backends.vllm import VLLMBackend
from masenvs.adapters.stack import StackError
from masenvs.engine.loading import load_tokenizer
from masenvs.engine.protocol import Backend, BackendError
from masenvs.trainer.config import TrainConfig
from masenvs.trainer.inference.sync import PolicyServer, vllm_servers
from masenvs.trainer.learner.learner import Learner

API_KEY_ENV = "MASENVS_ENGINES_API_KEY"  # the key engines given by URL want, if any


def several_engines(cfg: TrainConfig) -> bool:
    """Whether the run serves through pools of engines (engines.count > 1 or engines.urls)."""
    engines = cfg.distributed.engines
    return engines.count > 1 or bool(engines.urls)


def engine_pools(cfg: TrainConfig, learner: Learner, run_dir: Path) -> Backend:
    """The run's backend: one pool per served model, behind a router when there are several."""
    e = cfg.distributed.engines
    servers = vllm_servers(learner)
    pool_options: dict[str, Any] = {
        "affinity": e.affinity,
        "allow_mixed_versions": e.allow_mixed_versions,
        "max_restarts": e.max_restarts,
        "update_timeout": cfg.backend.request_timeout,
    }
    if cfg.backend.vllm_url:
        raise StackError(
            "backend.vllm_url and distributed.engines both say where the engines are; list "
            "running servers in distributed.engines.urls and leave backend.vllm_url unset"
        )
    tokenizers = {s.model: load_tokenizer(s.model) for s in servers}  # once, on this thread
    if e.urls:
        if len(servers) > 1:
            raise StackError(
                f"distributed.engines.urls lists replicas of one served model, but these "
                f"policies need {len(servers)}; leave urls empty so the trainer starts "
                "engines.count of each"
            )
        backends = []
        for url in e.urls:
            try:
                tokenizer = tokenizers[servers[0].model]
                backends.append(
                    VLLMBackend(
                        url,
                        api_key=os.environ.get(API_KEY_ENV),
                        timeout=cfg.backend.request_timeout,
                        tokenizer=tokenizer,
                    )
                )
            except BackendError as exc:
                raise StackError(f"distributed.engines.urls: {exc}") from exc
        return EnginePool(
            backends, names=list(e.urls), report=run_dir / "engines.json", **pool_options
        )

    launchers = [
        _launcher(cfg, learner, run_dir, server, i, k * e.count + i, tokenizers[server.model])
        for k, server in enumerate(servers)
        for i in range(e.count)
    ]
    started = _start_all(launchers)
    pools = []
    for k in range(len(servers)):
        mine = list(range(k * e.count, (k + 1) * e.count))
        server = servers[k]
        report = (
            "engines.json" if len(servers) == 1 else f"engines-{'+'.join(server.policies)}.json"
        )
        pools.append(
            EnginePool(
                [started[i] for i in mine],
                restart=[launchers[i][1] if e.restart else None for i in mine],
                names=[launchers[i][0] for i in mine],
                report=run_dir / report,
                **pool_options,
            )
        )
    if len(pools) == 1:
        return pools[0]
    return RouterBackend(
        {
            policy: Route(pool, "" if learner.full else policy)
            for server, pool in zip(servers, pools, strict=True)
            for policy in server.policies
        }
    )


def _launcher(
    cfg: TrainConfig,
    learner: Learner,
    run_dir: Path,
    server: PolicyServer,
    index: int,
    slot: int,
    tokenizer: Any,
) -> tuple[str, Callable[[], Backend]]:
    """A name for one replica (`index` of its model, `slot` of the run) and a callable that
    starts it (again, on a restart)."""
    b, count = cfg.backend, cfg.distributed.engines.count
    models = len(vllm_servers(learner))
    label = f"engine-{index}" if models == 1 else f"engine-{'+'.join(server.policies)}-{index}"
    log_path = run_dir / f"{label}.log"
    if b.kind == "embedded":
        from masenvs.adapters.backends.launch import launch_engine_server

        device = str(learner.device)
        # On CPU the replicas share the cores rather than each spinning up all of them.
        threads = max(1, (os.cpu_count() or 1) // (count * models)) if device == "cpu" else None

        def start() -> Backend:
            handle = launch_engine_server(
                server.model,
                engine=b.engine_args(device=device, threads=threads),
                log_path=log_path,
                timeout=b.request_timeout,
            )
            try:
                return VLLMBackend(
                    handle.url, tokenizer=tokenizer, timeout=b.request_timeout, process=handle
                )
            except BaseException:
                handle.stop()
                raise

        return label, start

    path = model_dir(server.model)
    if cpu_only():
        check_cpu_model(path)
    extra_args = list(b.vllm_args)
    env: dict[str, str] = {}
    total = count * models
    gpus = 0 if cpu_only() else _gpu_count()
    if gpus >= total:  # one GPU each
        env["CUDA_VISIBLE_DEVICES"] = str(slot)
    elif gpus and "--gpu-memory-utilization" not in extra_args:
        extra_args += ["--gpu-memory-utilization", f"{0.9 / total:.2f}"]

    def start_vllm() -> Backend:
        return VLLMBackend.launch(
            path,
            request_timeout=b.request_timeout,
            python=b.vllm_python,
            max_loras=max(len(server.policies), 1),
            max_lora_rank=lora_rank_for(cfg.lora.rank),
            extra_args=extra_args,
            env=env,
            weight_updates=learner.full,
            log_path=log_path,
        )

    return label, start_vllm


def _start_all(launchers: list[tuple[str, Callable[[], Backend]]]) -> list[Backend]:
    """Start every replica at once, or none (the ones that started stop again)."""
    pool = ThreadPoolExecutor(len(launchers), thread_name_prefix="engine-launch")
    futures = [pool.submit(start) for _, start in launchers]
    pool.shutdown(wait=True)
    failed = [(name, f.exception()) for (name, _), f in zip(launchers, futures, strict=True)]
    failed = [(name, exc) for name, exc in failed if exc is not None]
    if failed:
        for future in futures:
            if future.exception() is None:
                getattr(future.result(), "shutdown", lambda: None)()
        name, exc = failed[0]
        if isinstance(exc, (VLLMLaunchError, BackendError, OSError)):
            raise StackError(f"could not start {name}: {exc}") from exc
        raise exc  # type: ignore[misc]
    return [f.result() for f in futures]


def _gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except ImportError:
        return 0
