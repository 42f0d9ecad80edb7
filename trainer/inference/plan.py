"""The run's inference, planned once from the config: which backend, which models it serves
and which policies each one answers for, how many replicas, which servers to start or reach.

`inference_plan` is pure (no model, no process, no network): a config whose servers do not
fit its policies fails here, before anything loads. `engines.open_inference` opens the plan;
`sync.WeightSync` then only pushes weights into what was opened.

One served model holds one base model. With LoRA its policies are adapters on it, so the
policies of one base share it; with full fine-tuning a served model's weights *are* a
policy, so each trained policy has its own and frozen ones share their base's:

| finetune | mode | served models |
| --- | --- | --- |
| lora | shared, per_agent | one |
| lora | separate | one per distinct base model |
| full | shared | one |
| full | per_agent, separate | one per trained policy, one per base of frozen ones |
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from masenvs.adapters.stack import StackError
from masenvs.engine.args import EngineArgs
from masenvs.trainer.config import TrainConfig
from masenvs.trainer.distributed_config import EnginesConfig


@dataclass
class ServedModel:
    """One model the run serves: the base it loads and the policies routed to it."""

    model: str
    policies: list[str] = field(default_factory=list)
    url: str | None = None  # a running vLLM server (backend.vllm_url); None: started here
    trained: bool = False  # holds one fully fine-tuned policy's weights, so serves only it

    @property
    def label(self) -> str:
        """The policies it serves, `plan+tool`, for log file names and errors."""
        return "+".join(self.policies)


@dataclass(frozen=True)
class InferencePlan:
    """Everything `open_inference` starts or reaches, decided from the config alone."""

    kind: Literal["embedded", "vllm"]  # backend.kind
    full: bool  # policy.finetune full: a policy is its served model's base weights
    served: tuple[ServedModel, ...]  # one engine (or server, or pool) each
    models: dict[str, str]  # agent -> the model name its requests ask the backend for
    engine: EngineArgs  # the embedded engine's options, on the learner's device
    engines: EnginesConfig  # distributed.engines: replicas per served model, or their URLs
    lora_rank: int  # the LoRA rank a started vLLM server must take (--max-lora-rank)
    timeout: float  # backend.request_timeout: any one request (and an engine server's start)
    vllm_python: str | None = None  # the vLLM install a started server runs from
    vllm_args: tuple[str, ...] = ()  # extra flags of every vLLM server started here

    @property
    def pooled(self) -> bool:
        """Several engines per served model (engines.count > 1, or engines.urls)."""
        return self.engines.count > 1 or bool(self.engines.urls)

    @property
    def in_place(self) -> bool:
        """Weights reach the engines in this process directly, not through files."""
        return self.kind == "embedded" and not self.pooled

    @property
    def routed(self) -> bool:
        """A router sends each policy to its served model (the engine in this process needs
        one with full weights too: it knows its policy only under the base's name)."""
        return len(self.served) > 1 or (self.in_place and self.full)

    def served_as(self, policy: str) -> str:
        """The model name requests of `policy` ask for: its own name (an adapter, or a route
        of the router), except on one server that holds full weights: its base model."""
        return "base" if self.full and not self.in_place and not self.routed else policy


def inference_plan(cfg: TrainConfig, agents: Sequence[str], device: str) -> InferencePlan:
    """The plan of the run that trains `agents` as `cfg` says, its engines on `device`."""
    b = cfg.backend
    full = cfg.policy.finetune == "full"
    served = served_models(cfg, agents)
    if b.vllm_url and (cfg.distributed.engines.count > 1 or cfg.distributed.engines.urls):
        raise StackError(
            "backend.vllm_url and distributed.engines both say where the engines are; list "
            "running servers in distributed.engines.urls and leave backend.vllm_url unset"
        )
    if cfg.distributed.engines.urls and len(served) > 1:
        raise StackError(
            f"distributed.engines.urls lists replicas of one served model, but these "
            f"policies need {len(served)}; leave urls empty so the trainer starts "
            "engines.count of each"
        )
    if b.kind == "vllm" and isinstance(b.vllm_url, str) and b.vllm_url:
        if len(served) > 1:
            raise StackError(
                f"backend.vllm_url names one vLLM server, but these policies need "
                f"{len(served)} ({_describe(served)}); give a mapping {{policy or base model: "
                "URL}, or leave it unset so the trainer starts them"
            )
        served[0].url = b.vllm_url
    elif b.kind == "vllm" and b.vllm_url:  # user-run servers, found by policy, then base
        served = _assign_urls(served, b.vllm_url)
    plan = InferencePlan(
        kind=b.kind,
        full=full,
        served=tuple(served),
        models={},
        engine=b.engine_args(device=device),
        engines=cfg.distributed.engines,
        lora_rank=cfg.lora.rank,
        timeout=b.request_timeout,
        vllm_python=b.vllm_python,
        vllm_args=tuple(b.vllm_args),
    )
    models = {agent: plan.served_as(cfg.policy.policy_of(agent)) for agent in agents}
    return dataclasses.replace(plan, models=models)


def served_models(cfg: TrainConfig, agents: Sequence[str]) -> list[ServedModel]:
    """The models the policies of `agents` need served (the table above), in policy order."""
    full = cfg.policy.finetune == "full"
    own_base = cfg.policy.mode == "separate" or (full and cfg.policy.mode == "per_agent")
    served: dict[str, ServedModel] = {}
    for policy in cfg.policy.policies(list(agents)):
        base = cfg.policy.models.get(policy, cfg.model.name) if own_base else cfg.model.name
        members = [cfg.agents.get(a) for a in agents if cfg.policy.policy_of(a) == policy]
        frozen = any(s is not None and s.freeze for s in members)
        own = full and not frozen
        key = f"policy:{policy}" if own else f"base:{base}"
        served.setdefault(key, ServedModel(base, trained=own)).policies.append(policy)
    return list(served.values())


def _describe(served: list[ServedModel]) -> str:
    return "; ".join(f"{s.label} on {s.model}" for s in served)


def _assign_urls(served: list[ServedModel], urls: dict[str, str]) -> list[ServedModel]:
    """Each policy's server: `urls[policy]`, else `urls[its base model]`; policies that
    share a URL share that server."""
    by_url: dict[str, ServedModel] = {}
    for server in served:
        for policy in server.policies:
            url = urls.get(policy) or urls.get(server.model)
            if url is None:
                raise StackError(
                    f"backend.vllm_url has no server for policy {policy!r} (base model "
                    f"{server.model}); add `{policy}: <url>` to it"
                )
            entry = by_url.setdefault(url, ServedModel(server.model, url=url))
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
