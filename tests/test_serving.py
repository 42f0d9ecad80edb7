"""Serving what the learner trains: whole weights into the embedded engine in place, and
agents on different base models served each from its own engine behind one router."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_runs import plan_path_run

from masenvs.adapters.backends.router import Route, RouterBackend
from masenvs.engine.engine import EmbeddedBackend
from masenvs.engine.loading import TINY_CONFIG, load_model, load_tokenizer
from masenvs.engine.protocol import BackendError, GenerateRequest, SamplingParams
from masenvs.trainer.atgrpo import group_advantages
from masenvs.trainer.config import TrainConfig, load_config
from masenvs.trainer.inference.engines import open_inference
from masenvs.trainer.inference.plan import inference_plan
from masenvs.trainer.inference.sync import WeightSync
from masenvs.trainer.learner.learner import Learner
from masenvs.trainer.samples import Sample, tree_group

CHAT = [{"role": "user", "content": "Which way to the goal?"}]
ENGINE = {"max_batch_size": 4, "dtype": "float32", "quantize": "none"}


@pytest.fixture(scope="module")
def other_base(tmp_path_factory: Any) -> Path:
    """A second tiny base model: same shape and tokenizer, other random weights (seed 1)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = load_tokenizer("tiny")
    tiny = load_model("tiny").model.config
    config = LlamaConfig(
        vocab_size=tiny.vocab_size,
        bos_token_id=tiny.bos_token_id,
        eos_token_id=tiny.eos_token_id,
        pad_token_id=tiny.pad_token_id,
        **TINY_CONFIG,
    )
    torch.manual_seed(1)
    out = tmp_path_factory.mktemp("tiny-seed1")
    LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def config(*overrides: str) -> TrainConfig:
    base = ["model.name=tiny", "model.device=cpu", "lora.rank=4", "optim.warmup_steps=0"]
    return load_config(None, base + ["optim.lr=1e-3", "steps=4", *overrides])


def open_engines(learner: Learner, tmp_path: Path) -> Any:
    """The engines a run of `learner`'s config opens (small, float32 ones)."""
    cfg = learner.cfg.model_copy(update={"backend": learner.cfg.backend.model_copy(update=ENGINE)})
    return open_inference(inference_plan(cfg, learner.agents, "cpu"), tmp_path)


def generate(backend: Any, model: str, seed: int = 0) -> tuple[list[int], list[int], list[float]]:
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=seed, ignore_eos=True)
    generation = asyncio.run(backend.generate(GenerateRequest(model, params, messages=CHAT)))
    (choice,) = generation.completions
    return generation.prompt_token_ids, choice.token_ids, choice.logprobs


def learner_logprobs(learner: Learner, policy: str, prompt: list[int], tokens: list[int]) -> Any:
    sample = Sample(prompt, tokens, [], policy, policy, tree_group(0, 0, policy), 0.0)
    return learner.logprobs(policy, [sample])[0]  # rollout.temperature is 1: raw log-probs


def train_step(learner: Learner, policy: str, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    samples = [
        Sample(
            torch.randint(0, 49152, (10,), generator=gen).tolist(),
            torch.randint(0, 49152, (6,), generator=gen).tolist(),
            [],
            policy,
            policy,
            tree_group(0, 0, policy),
            float(k),
        )
        for k in range(4)
    ]
    learner.step(group_advantages(samples, learner.cfg.algorithm)[0])


# -- full fine-tuning: weights into the engine in place ----------------------------------------


def test_full_weights_reach_the_engine_in_place(tmp_path: Path) -> None:
    learner = Learner(config("policy.finetune=full", "policy.mode=shared"), ["plan", "tool"])
    backend = open_engines(learner, tmp_path)
    try:
        assert isinstance(backend, RouterBackend) and backend.model_names() == ["shared"]
        sync = WeightSync(learner, backend, tmp_path)
        prompt, tokens, before = generate(backend, "shared")
        train_step(learner, "shared", seed=0)
        asyncio.run(sync.push(1))
        prompt, tokens, after = generate(backend, "shared")
        # The engine now samples from the trained weights: its log-probs are the learner's.
        expected = learner_logprobs(learner, "shared", prompt, tokens)
        assert torch.allclose(torch.tensor(after), expected, atol=1e-4)
        assert not torch.allclose(torch.tensor(after), torch.tensor(before), atol=1e-4)
    finally:
        backend.shutdown()


def test_quantized_copies_are_rebuilt_from_the_new_weights(tmp_path: Path) -> None:
    learner = Learner(config("policy.finetune=full"), ["plan"])
    train_step(learner, "plan", seed=1)
    trained = learner.save_model("plan", tmp_path / "trained")
    synced = EmbeddedBackend.from_spec("tiny", max_batch_size=2, dtype="bfloat16", quantize="int8")
    loaded = EmbeddedBackend.from_spec(
        str(trained), max_batch_size=2, dtype="bfloat16", quantize="int8"
    )
    try:
        generate(synced, "")  # the int8 copies of the old weights exist now
        synced.set_base_weights("tiny", learner.full_state_dict("plan"))
        # Same tokens and log-probs as an engine that loaded the trained model from disk. The
        # log-probs agree to a few float32 ulps, not bit for bit: on one CI machine a single one
        # of twelve sat 1 ulp off (the two engines' weights live at different addresses, and
        # vectorised reductions may split differently). Stale int8 copies would be off by ~0.4
        # and pick other tokens.
        prompt, tokens, logprobs = generate(synced, "", seed=3)
        want_prompt, want_tokens, want_logprobs = generate(loaded, "", seed=3)
        assert (prompt, tokens) == (want_prompt, want_tokens)
        assert torch.allclose(
            torch.tensor(logprobs), torch.tensor(want_logprobs), rtol=5e-7, atol=0
        )
        with pytest.raises(BackendError, match="not in tiny"):
            synced.set_base_weights("", {"lm_head.lora_A.weight": torch.zeros(1)})
        with pytest.raises(BackendError, match="needs"):
            synced.set_base_weights("", {"model.norm.weight": torch.zeros(3)})
        with pytest.raises(BackendError, match="not this engine's base model"):
            synced.set_base_weights("other", {})
    finally:
        synced.shutdown()
        loaded.shutdown()


# -- separate bases: each agent from its own engine --------------------------------------------


@pytest.mark.parametrize("finetune", ["lora", "full"])
def test_separate_bases_serve_each_agent_from_its_own_base(
    other_base: Path, finetune: str, tmp_path: Path
) -> None:
    cfg = config(
        "policy.mode=separate",
        f"policy.finetune={finetune}",
        f"policy.models={{tool: {other_base}}}",
    )
    learner = Learner(cfg, ["plan", "tool"])
    backend = open_engines(learner, tmp_path)
    try:
        assert isinstance(backend, RouterBackend) and len(backend.backends) == 2
        sync = WeightSync(learner, backend, tmp_path)
        asyncio.run(sync.push(0))
        for policy, other in (("plan", "tool"), ("tool", "plan")):
            prompt, tokens, served = generate(backend, policy)
            own = learner_logprobs(learner, policy, prompt, tokens)
            assert torch.allclose(torch.tensor(served), own, atol=1e-4), policy
            theirs = learner_logprobs(learner, other, prompt, tokens)
            assert not torch.allclose(torch.tensor(served), theirs, atol=1e-2)  # other base

        train_step(learner, "tool", seed=2)  # only the tool agent's weights move
        asyncio.run(sync.push(1))
        for policy in ("plan", "tool"):
            prompt, tokens, served = generate(backend, policy, seed=5)
            own = learner_logprobs(learner, policy, prompt, tokens)
            assert torch.allclose(torch.tensor(served), own, atol=1e-4), policy
    finally:
        backend.shutdown()


def test_router_errors_name_the_served_models() -> None:
    engine = EmbeddedBackend.from_spec("tiny", **ENGINE)
    try:
        router = RouterBackend({"plan": Route(engine, "")})
        with pytest.raises(BackendError, match=r"serves \['plan'\]"):
            generate(router, "tool")
        assert generate(router, "base")[1]  # the first route's base model
    finally:
        engine.shutdown()


# -- the training loop, end to end --------------------------------------------------------------


def test_training_separate_full_models_with_a_frozen_agent(
    other_base: Path, tmp_path: Path
) -> None:
    from rich.console import Console

    from masenvs.trainer.run.checkpoint import load_latest
    from masenvs.trainer.run.metrics import read_metrics
    from masenvs.trainer.run.train import train

    cfg = config(
        *plan_path_run(tmp_path / "run"),
        "policy.mode=separate",
        "policy.finetune=full",
        f"policy.models={{tool: {other_base}}}",
        "agents.plan.freeze=true",
        "agents.tool.lr=2e-3",
    )
    train(cfg, console=Console(quiet=True))
    rows = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "learner/lr" in r]
    assert len(rows) == 2
    assert rows[0]["learner/tool/lr"] == pytest.approx(2e-3)  # its own peak, same schedule
    assert all(r["learner/tool/lr"] == pytest.approx(2 * r["learner/lr"]) for r in rows)
    assert not any(k.startswith("learner/plan/") for r in rows for k in r)  # frozen
    loaded = load_latest(tmp_path / "run")
    assert loaded is not None and loaded.state.step == 2
    assert sorted(p.name for p in (loaded.path / "models").iterdir()) == ["tool"]
    trained = load_model(str(loaded.path / "models" / "tool")).model.state_dict()
    base = load_model(str(other_base)).model.state_dict()
    assert any(not torch.equal(trained[k], base[k]) for k in base)  # the tool model moved
