"""The embedded engines a training run samples from: one per base model (LoRA) or one per
trained model (full fine-tuning), behind a router when there is more than one name to serve.

| finetune | mode | engines | a policy's requests go to |
| --- | --- | --- | --- |
| lora | shared, per_agent | one | its adapter (no router) |
| lora | separate | one per distinct base model | its adapter on its base's engine |
| full | shared | one | that engine's base model |
| full | per_agent, separate | one per policy | its own engine's base model |
"""

from __future__ import annotations

from typing import Any

from masenvs.adapters.backends.router import Route, RouterBackend
from masenvs.adapters.stack import make_backend
from masenvs.engine.protocol import Backend
from masenvs.trainer.learner.learner import Learner


def training_backend(learner: Learner, **engine: Any) -> Backend:
    """Embedded engines serving every policy of `learner` from its own base (or weights)."""
    if not learner.full and len({p.base_name for p in learner.policies.values()}) == 1:
        return make_backend(learner.cfg.model.name, "embedded", **engine)
    engines: dict[str, Backend] = {}  # by base model (LoRA) or by policy (full)
    routes: dict[str, Route] = {}
    try:
        for name, policy in learner.policies.items():
            key = name if learner.full else policy.base_name
            if key not in engines:
                engines[key] = make_backend(policy.base_name, "embedded", **engine)
            routes[name] = Route(engines[key], "" if learner.full else name)
        return RouterBackend(routes)
    except BaseException:
        for backend in engines.values():
            backend.shutdown()  # type: ignore[attr-defined]
        raise
