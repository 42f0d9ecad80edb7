"""The `distributed` section of a training config: Ray rollout workers, engine replicas and
the learner on several ranks (docs/distributed.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from masenvs.overrides import Section


class EnginesConfig(Section):
    """Inference engines behind the capture endpoint: several copies of the served model."""

    count: int = Field(
        1,
        ge=1,
        description="Engines serving the same model(s), each its own process (an embedded "
        "engine server for backend.kind 'embedded', a vLLM server for 'vllm'); 1 keeps "
        "today's single backend. A router spreads requests over them.",
    )
    urls: list[str] = Field(
        default_factory=list,
        description="Root URLs of engine servers already running (vLLM, or `masenvs serve "
        "--engine`), used instead of starting `count` of them.",
    )
    affinity: Literal["rollout", "least_loaded"] = Field(
        "rollout",
        description="'rollout': every call of one rollout goes to the engine its first call "
        "went to (its prefix stays cached there); 'least_loaded': each call to the engine "
        "with the fewest requests in flight.",
    )
    allow_mixed_versions: bool = Field(
        False,
        description="Let a rollout that started before a weight update go on under the new "
        "weights; False: updates wait until running rollouts end (each call's policy version "
        "is recorded either way).",
    )
    restart: bool = Field(
        True,
        description="Restart an engine the trainer started when it dies; False (or an engine "
        "given by URL): the run stops with an error naming the engine.",
    )
    max_restarts: int = Field(3, ge=0, description="Restarts per engine before the run stops.")


class LearnerDistConfig(Section):
    """The learner on torch.distributed: one process per rank."""

    world_size: int = Field(
        1, ge=1, description="Learner ranks; 1 trains in the trainer process as today."
    )
    sharding: Literal["fsdp", "ddp"] = Field(
        "fsdp",
        description="'fsdp': parameters, gradients and optimizer state sharded over ranks "
        "(FSDP2); 'ddp': each rank holds a full copy, gradients are all-reduced.",
    )
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="Process-group backend; 'auto' is nccl on GPUs, gloo on CPUs."
    )
    timeout: float = Field(
        600.0, gt=0.0, description="Seconds any collective or rank call may take."
    )


class DistributedConfig(Section):
    """Scale out: rollout workers on Ray, several engines, a sharded learner."""

    ray_address: str | None = Field(
        None,
        description="Ray cluster to join ('auto', 'ray://host:10001'); None starts a local "
        "Ray instance when rollout workers are asked for.",
    )
    rollout_workers: int = Field(
        0,
        ge=0,
        description="Ray actors that run the env episodes and agent programs; 0 runs them in "
        "the trainer process.",
    )
    worker_timeout: float = Field(
        900.0, gt=0.0, description="Seconds one worker's share of a step may take."
    )
    on_worker_failure: Literal["retry", "drop"] = Field(
        "retry",
        description="A worker that dies mid-step: 'retry' re-runs its episodes on a new "
        "worker; 'drop' records them as dropped. Training goes on either way.",
    )
    max_worker_restarts: int = Field(
        3, ge=0, description="Worker restarts in one run before the run stops."
    )
    endpoint_host: str | None = Field(
        None,
        description="Address the capture endpoint binds; None: 0.0.0.0 when rollout workers "
        "join a Ray cluster (ray_address), else 127.0.0.1. Beyond loopback it needs a key: "
        "$MASENVS_API_KEY, else one generated for the run and handed to the workers via Ray.",
    )
    endpoint_no_auth: bool = Field(
        False,
        description="Serve the endpoint beyond loopback with no key (a warning is printed): "
        "anyone who reaches the port can sample the policy and write training data.",
    )
    engines: EnginesConfig = Field(default_factory=EnginesConfig)
    learner: LearnerDistConfig = Field(default_factory=LearnerDistConfig)
