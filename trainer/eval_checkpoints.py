"""The checkpoints `masenvs eval` plays and the embedded engines that serve them: a run's
LoRA adapters (one per policy, side by side on its base model) or, from full fine-tuning, its
whole models (models/<policy>/, one engine each), and which of them answers each seat, role
swaps included (`EvalCheckpoint.weights_of`, `check_swap`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from masenvs.engine.protocol import BackendError
from masenvs.trainer.evaluate import check_swap
from masenvs.trainer.run.checkpoint import ADAPTERS, MODELS

_WEIGHTS = {
    "adapter": "the adapter {}",
    "model": "the model {}",
    "base": "the base model {}, untrained",
}


@dataclass
class EvalCheckpoint:
    """A checkpoint under evaluation: its name in the table (`run@step`), its directory and
    the run's TrainConfig."""

    label: str
    path: Path
    config: Any  # TrainConfig

    def weights_of(self, agent: str) -> tuple[str, str]:
        """What answers `agent`'s calls: ("adapter", its peft dir), ("model", its model dir,
        full fine-tuning) or ("base", a base model: a frozen policy, which is not saved)."""
        p = self.config.policy
        policy = p.policy_of(agent)
        if p.finetune == "lora":
            return "adapter", str(self.path / ADAPTERS / policy)
        if (self.path / MODELS / policy).is_dir():
            return "model", str(self.path / MODELS / policy)
        if p.mode == "shared":  # one model for every agent
            return "base", self.config.model.name
        return "base", p.models.get(policy, self.config.model.name)

    def check_swap(self, swap: dict[str, str]) -> None:
        """Refuse swapping two agents that play with the same weights here (`check_swap`)."""
        why = ""
        if self.config.policy.mode == "shared":
            why = ", as policy.mode shared trains one policy for every agent"
        weights = {}
        for agent in swap:
            kind, where = self.weights_of(agent)
            name = where if kind == "base" else f"{Path(where).parent.name}/{Path(where).name}"
            weights[agent] = _WEIGHTS[kind].format(name) + why
        fix = (
            "A swap needs one trained policy per role: evaluate a run trained with "
            "--set policy.mode=per_agent (LoRA adapters, or whole models with "
            "policy.finetune=full), or drop --swap."
        )
        check_swap(swap, weights, self.label, fix)


def open_checkpoint(path: str) -> EvalCheckpoint:
    """The checkpoint at `path`: a step directory, or a run directory's latest."""
    from masenvs.trainer.config import load_config
    from masenvs.trainer.run.checkpoint import load_latest

    where = Path(path)
    if not ((where / ADAPTERS).is_dir() or (where / MODELS).is_dir()):
        latest = load_latest(where) if where.is_dir() else None
        if latest is None:
            raise ValueError(
                f"{path} is neither a checkpoint (a step_* directory with adapters/ or "
                "models/) nor a run directory with checkpoints; pass "
                "runs/NAME/checkpoints/step_N or runs/NAME"
            )
        where = latest.path
    step = where.name.removeprefix("step_").lstrip("0") or "0"
    return EvalCheckpoint(
        f"{where.parent.parent.name}@{step}", where, load_config(where / "config.yaml")
    )


@dataclass
class Engines:
    """The embedded engines of an evaluation, each loaded once: the base model with every
    checkpoint's adapters, and an engine per fully fine-tuned model (a run that trained one
    whole model per role holds one per role: two engines, each its model's weights)."""

    model: str  # the base model
    options: dict[str, Any]
    engines: dict[str, Any] = field(default_factory=dict)  # model name or dir -> engine
    routes: dict[str, Any] = field(default_factory=dict)  # served name -> Route

    def serve(self, name: str, kind: str, where: str) -> str:
        """Serve the weights `EvalCheckpoint.weights_of` names (kind, where) as `name`,
        once; returns the name requests ask for."""
        from masenvs.adapters.backends.router import Route
        from masenvs.adapters.policy_map import BASE
        from masenvs.adapters.stack import StackError

        if kind == "base" and where == self.model:
            name = BASE
        if name in self.routes:
            return name
        if kind != "adapter":  # a whole model: a fully fine-tuned policy, a frozen one's base
            self.routes[name] = Route(self._engine(where), "")
            return name
        base = self._engine(self.model)
        try:
            asyncio.run(base.load_adapter(name, where))
        except (OSError, ValueError, KeyError, BackendError) as exc:
            raise StackError(f"could not load {where}: {exc}") from exc
        self.routes[name] = Route(base, name)
        return name

    def front(self) -> Any:
        """The backend the endpoints call: the one engine, or a router when a name must
        reach another engine, or an engine's base under a checkpoint's name."""
        from masenvs.adapters.backends.router import RouterBackend
        from masenvs.adapters.policy_map import BASE
        from masenvs.adapters.stack import StackError

        first = next(iter(self.engines.values()))
        if len(self.engines) == 1 and all(n in (BASE, r.model) for n, r in self.routes.items()):
            return first
        routes = dict(sorted(self.routes.items(), key=lambda r: r[0] != BASE))  # BASE first
        try:
            return RouterBackend(routes)
        except BackendError as exc:
            raise StackError(str(exc)) from exc

    def _engine(self, spec: str) -> Any:
        if spec not in self.engines:
            from masenvs.adapters.stack import make_backend

            self.engines[spec] = make_backend(spec, "embedded", **self.options)
        return self.engines[spec]

    def shutdown(self) -> None:
        for engine in self.engines.values():
            engine.shutdown()
