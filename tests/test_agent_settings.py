"""Per-agent settings (`agents.<name>`): sampling in rollouts, validation and workflows, the
learner scoring each agent's tokens at that agent's temperature, chat template variables."""

from __future__ import annotations

import copy
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from masenvs.adapters.frameworks.clients import ClientSettings, chat_openai
from masenvs.adapters.policy import Sampling
from masenvs.engine.loading import load_model
from masenvs.traces import TraceStore
from masenvs.trainer.config import ConfigError, TrainConfig, load_config
from masenvs.trainer.learner.learner import Learner
from masenvs.trainer.rollout.sources import agent_sampling
from masenvs.trainer.run.train import train
from masenvs.trainer.samples import Sample, tree_group


def config(*overrides: str) -> TrainConfig:
    return load_config(None, ["model.name=tiny", "lora.rank=4", "lora.alpha=8", *overrides])


def test_unset_agent_fields_fall_back_to_the_rollout_section() -> None:
    cfg = config(
        "rollout.temperature=0.9",
        "rollout.max_tokens=64",
        "agents.plan.temperature=0.6",
        "agents.plan.chat_template_kwargs={enable_thinking: false}",
    )
    plan, tool = cfg.agent("plan"), cfg.agent("tool")
    assert (plan.temperature, plan.top_p, plan.max_tokens) == (0.6, 1.0, 64)
    assert (tool.temperature, tool.top_p, tool.max_tokens) == (0.9, 1.0, 64)
    assert plan.chat_template_kwargs == {"enable_thinking": False}
    assert tool.chat_template_kwargs == {}
    sampling = agent_sampling(cfg, ["plan", "tool"])
    assert sampling["plan"] == Sampling(0.6, 1.0, 0, 64)
    # Validation keeps its own (greedy) temperature for everyone.
    assert agent_sampling(cfg, ["plan", "tool"], validation=True)["plan"].temperature == 0.0


def test_a_misspelt_agent_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="agents.planner .* not an agent"):
        agent_sampling(config("agents.planner.temperature=0.5"), ["plan", "tool"])


def test_workflow_clients_use_their_agents_sampling() -> None:
    settings = ClientSettings(Sampling(1.0, 1.0, 0, 256), agents={"solver": Sampling(0.3, 0.9)})
    solver = chat_openai("http://127.0.0.1:9/v1", "solver", settings)
    critic = chat_openai("http://127.0.0.1:9/v1", "critic", settings)
    # An agent's settings replace the run's whole: max_tokens is SamplingArgs' default.
    assert (solver.temperature, solver.top_p, solver.max_tokens) == (0.3, 0.9, 512)
    assert (critic.temperature, critic.max_tokens) == (1.0, 256)


@pytest.fixture(scope="module")
def tiny() -> Any:
    return load_model("tiny").model


def samples(agent: str, seed: int) -> list[Sample]:
    rng = random.Random(seed)
    return [
        Sample(
            [rng.randrange(49152) for _ in range(rng.randint(3, 12))],
            [rng.randrange(49152) for _ in range(rng.randint(2, 8))],
            [],
            agent,
            "shared",
            tree_group(0, 0, agent),
            0.0,
        )
        for _ in range(3)
    ]


def test_the_learner_scores_each_agents_tokens_at_its_own_temperature(tiny: Any) -> None:
    def learner(*overrides: str) -> Learner:
        cfg = config("policy.mode=shared", "optim.share_prompts=false", *overrides)
        return Learner(cfg, ["plan", "tool"], lambda *_: copy.deepcopy(tiny).float())

    plan, tool = samples("plan", 1), samples("tool", 2)
    mixed = learner("rollout.temperature=1.0", "agents.plan.temperature=0.5")
    # One micro-batch holds both agents' samples, each at its agent's temperature.
    scored = mixed.logprobs("shared", plan + tool)
    at_half = learner("rollout.temperature=0.5").logprobs("shared", plan)
    at_one = learner("rollout.temperature=1.0").logprobs("shared", tool)
    for got, want in zip(scored, at_half + at_one, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(scored[0], learner().logprobs("shared", plan[:1])[0])


def test_training_samples_each_agent_with_its_settings(tmp_path: Path) -> None:
    cfg = config(
        f"run_dir={tmp_path / 'run'}",
        "steps=1",
        "env.options={size: 4}",
        "rollout.branches=2",
        "rollout.tasks_per_step=1",
        "rollout.max_rounds=1",
        "rollout.max_tokens=6",
        "rollout.temperature=1.0",
        "agents.plan.temperature=0.7",
        "agents.plan.top_p=0.9",
        "agents.plan.max_tokens=3",
        "agents.plan.chat_template_kwargs={enable_thinking: false}",
        "validation.every=1",
        "validation.episodes=1",
        "logging.tensorboard=false",
    )
    train(cfg)
    calls = TraceStore(tmp_path / "run" / "traces").calls()
    by_agent: dict[str, set[tuple[Any, ...]]] = {}
    for c in calls:
        p = c.params
        key = (p["temperature"], p["top_p"], p["max_tokens"], str(p.get("chat_template_kwargs")))
        by_agent.setdefault(c.agent, set()).add(key)
    thinking_off = str({"enable_thinking": False})
    # Training calls at the agent's temperature, validation calls greedy.
    assert by_agent["plan"] == {(0.7, 0.9, 3, thinking_off), (0.0, 0.9, 3, thinking_off)}
    assert by_agent["tool"] == {(1.0, 1.0, 6, "None"), (0.0, 1.0, 6, "None")}
    assert all(
        len(choice.token_ids) <= 3 for c in calls if c.agent == "plan" for choice in c.choices
    )


def test_tree_samples_carry_the_sampling_their_request_asked_for(tmp_path: Path) -> None:
    """Each env-rollout sample knows how its call sampled (the learner scores it at that
    temperature): the agent's settings, as the trace recorded them."""
    import asyncio

    from framework_support import serve

    from masenvs.adapters.policy import ChatPolicy
    from masenvs.engine.engine import EmbeddedBackend
    from masenvs.registry import make
    from masenvs.sampling_args import SamplingArgs
    from masenvs.trainer.rollout.tree import collect_tree_batch

    cfg = config("agents.plan.temperature=0.5", "agents.plan.top_k=5", "rollout.max_tokens=4")
    engine = EmbeddedBackend.from_spec("tiny", max_batch_size=4, dtype="float32", quantize="none")
    try:
        with serve(engine, tmp_path / "traces") as served:

            async def rollouts() -> list[Any]:
                policy = ChatPolicy(
                    served.url, agent_sampling=agent_sampling(cfg, ["plan", "tool"])
                )
                try:
                    return await collect_tree_batch(
                        lambda: make("plan_path", size=4, max_rounds=1),
                        [0],
                        policy,
                        branches=2,
                        policy_of=cfg.policy.policy_of,
                    )
                finally:
                    await policy.aclose()

            (result,) = asyncio.run(rollouts())
            calls = {c.id: c for c in served.store.calls()}
    finally:
        engine.shutdown()
    assert result.error is None and {s.agent for s in result.samples} == {"plan", "tool"}
    for s in result.samples:
        assert s.sampling == cfg.sampling(s.agent)
        assert s.sampling == SamplingArgs.from_record(calls[s.meta["call_id"]].params)
    assert cfg.sampling("plan") == SamplingArgs(temperature=0.5, top_k=5, max_tokens=4)
