"""`top_k` and the repetition penalty (the authors sample with top_k 20 and vLLM's default
repetition penalty): from the config through the endpoint to the embedded engine's sampler
and to vLLM's request body; log-probabilities stay the raw model's. And `SamplingArgs`, where
every knob is declared once: the config, the commands, the endpoint and the engine all take
its bounds and defaults."""

from __future__ import annotations

import argparse
import asyncio
import re
from pathlib import Path

import pytest
import torch
from fake_vllm import FakeVLLM

from masenvs.adapters.backends.launch import model_dir
from masenvs.adapters.backends.vllm import VLLMBackend
from masenvs.adapters.endpoint import EndpointServer
from masenvs.engine.engine import EmbeddedBackend
from masenvs.engine.protocol import BackendError, GenerateRequest, SamplingParams
from masenvs.engine.sampling import RowSampling, sample
from masenvs.sampling_args import SamplingArgs
from masenvs.traces import TraceStore
from masenvs.trainer.config import ConfigError, load_config
from masenvs.trainer.run.train import train

HELLO = [{"role": "user", "content": "Say hello."}]


def test_the_penalty_moves_sampling_off_seen_tokens_but_not_the_logprobs() -> None:
    logits = torch.tensor([[4.0, 3.0, -1.0, 0.5], [4.0, 3.0, -1.0, 0.5]])
    greedy = [RowSampling(0.0, 1.0, 0, 0, torch.Generator()) for _ in range(2)]
    greedy[1].repetition_penalty, greedy[1].seen = 2.0, {0}  # token 0 was seen: 4 -> 2
    drawn = sample(logits.clone(), greedy)
    assert drawn.tokens == [0, 1]
    raw = torch.log_softmax(logits[0], -1)
    assert abs(drawn.logprobs[1] - raw[1]) < 1e-6  # the raw model's log-prob of token 1

    # Sampled at T=1: token 0 (p 0.71) gives way to token 1 once 0 is seen (4 -> 4/3); a
    # seen negative score is multiplied (-1 -> -3), so it drops too (vLLM's rule).
    def draws(penalty: float) -> list[int]:
        rows = [RowSampling(1.0, 1.0, 0, 0, torch.Generator().manual_seed(s)) for s in range(400)]
        for r in rows:
            r.repetition_penalty, r.seen = penalty, {0, 2}
        return sample(logits[:1].expand(400, -1).clone(), rows).tokens

    free, penalized = draws(1.0), draws(3.0)
    assert free.count(0) > 2 * free.count(1) and penalized.count(1) > 2 * penalized.count(0)
    assert penalized.count(2) < free.count(2) + 1


def test_top_k_and_the_penalty_reach_the_engine(tmp_path: Path) -> None:
    engine = EmbeddedBackend.from_spec("tiny", max_model_len=256, dtype="float32")
    try:

        def answer(**params) -> list[int]:
            request = GenerateRequest("", SamplingParams(max_tokens=24, **params), messages=HELLO)
            return asyncio.run(engine.generate(request)).completions[0].token_ids

        plain = answer(temperature=0)
        penalized = answer(temperature=0, repetition_penalty=5.0)
        # Greedy on the random tiny model loops over a few tokens; the penalty breaks it.
        assert len(set(penalized)) > len(set(plain))
        top1 = {tuple(answer(temperature=1.0, top_k=1, seed=s)) for s in range(3)}
        assert top1 == {tuple(plain)}  # top_k=1 is greedy whatever the seed
    finally:
        engine.shutdown()


def test_vllm_gets_top_k_and_the_penalty_in_its_request_body() -> None:
    engine = EmbeddedBackend.from_spec("tiny", max_model_len=256, dtype="float32")
    path = model_dir("tiny")
    app = FakeVLLM(engine, served_model=path, root=path)
    try:
        with EndpointServer(app) as server:
            backend = VLLMBackend(server.url)
            params = SamplingParams(max_tokens=4, top_k=20, repetition_penalty=1.2)
            asyncio.run(backend.generate(GenerateRequest("", params, messages=HELLO)))
            sent = app.requests[-1]
            assert (sent["top_k"], sent["repetition_penalty"]) == (20, 1.2)
            asyncio.run(backend.generate(GenerateRequest("", SamplingParams(4), messages=HELLO)))
            assert "top_k" not in app.requests[-1]
            assert "repetition_penalty" not in app.requests[-1]  # 1.0: off, not sent
    finally:
        engine.shutdown()


def test_training_calls_carry_each_agents_top_k_and_penalty(tmp_path: Path) -> None:
    cfg = load_config(
        None,
        [
            "model.name=tiny",
            f"run_dir={tmp_path}",
            "steps=1",
            "env.options={size: 4}",
            "rollout.branches=2",
            "rollout.tasks_per_step=1",
            "rollout.max_rounds=1",
            "rollout.max_tokens=6",
            "rollout.top_k=20",
            "agents.plan.repetition_penalty=1.2",
            "validation.every=1",
            "validation.episodes=1",
            "logging.tensorboard=false",
        ],
    )
    assert cfg.agent("plan").repetition_penalty == 1.2 and cfg.agent("tool").top_k == 20
    train(cfg)
    seen = {
        (c.agent, c.rollout_id.startswith("val"), c.params["top_k"], c.params["repetition_penalty"])
        for c in TraceStore(tmp_path / "traces").calls()
    }
    assert seen == {
        ("plan", False, 20, 1.2),
        ("tool", False, 20, 1.0),
        ("plan", True, 0, 1.0),  # validation samples as the ref validates: neither
        ("tool", True, 0, 1.0),
    }


# -- SamplingArgs: each knob declared once, read by the config, the CLIs, the schema, the engine


def test_a_knob_out_of_bounds_fails_when_the_config_loads_naming_the_key() -> None:
    for override, message in [
        ("rollout.temperature=2.5", "rollout.temperature: Input should be less than or equal to 2"),
        ("rollout.temperature=0", "rollout.temperature: Input should be greater than 0"),
        ("rollout.top_p=1.5", "rollout.top_p: Input should be less than or equal to 1"),
        ("rollout.max_tokens=0", "rollout.max_tokens: Input should be greater than or equal to 1"),
        ("agents.plan.repetition_penalty=0", "agents.plan.repetition_penalty: Input should be"),
        ("agents.plan.temperature=3", "agents.plan.temperature: Input should be less than or"),
        ("validation.temperature=2.5", "validation.temperature: Input should be less than or"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_config(None, [override])
    # The defaults are SamplingArgs'; an agent's section is a partial update of rollout's.
    cfg = load_config(None, ["rollout.top_k=20", "agents.plan.temperature=0.5"])
    assert SamplingArgs.of(load_config(None).rollout) == SamplingArgs()
    assert cfg.sampling("plan") == SamplingArgs(temperature=0.5, top_k=20)
    assert cfg.sampling("tool") == SamplingArgs(top_k=20)


def command_parsers() -> dict[str, argparse.ArgumentParser]:
    from masenvs.adapters.rollout import build_parser as rollout_parser
    from masenvs.trainer.commands.eval import build_parser as eval_parser
    from masenvs.trainer.commands.workflow import build_parser as workflow_parser

    return {
        "masenvs rollout": rollout_parser(),
        "masenvs eval": eval_parser(),
        "workflow scripts": workflow_parser("examples"),
    }


REQUIRED = {"masenvs rollout": ["--env", "math"]}


def test_every_command_takes_the_same_sampling_flags_with_the_same_defaults() -> None:
    for command, parser in command_parsers().items():
        args = parser.parse_args(REQUIRED.get(command, []))
        help_text = " ".join(parser.format_help().split())
        for name in SamplingArgs.names():
            flag = "--" + name.replace("_", "-")
            assert hasattr(args, name), f"{command} has no {flag}"
            default = getattr(SamplingArgs(), name)
            value = getattr(args, name)
            if value != default:  # a command's own default says why in its help
                shown = "(default: " if value is None else f"(default {value}: "
                assert shown in help_text, f"{command} {flag} {value}: no reason given"
        # The bounds hold on the command line too, in the words of the config.
        with pytest.raises(SystemExit):
            parser.parse_args([*REQUIRED.get(command, []), "--temperature", "2.5"])
    eval_help = " ".join(command_parsers()["masenvs eval"].format_help().split())
    assert "--temperature TEMPERATURE sampling temperature; 0 is greedy (default: 0.7," in eval_help


def test_the_endpoint_accepts_exactly_what_SamplingArgs_accepts() -> None:
    from pydantic import ValidationError

    from masenvs.adapters.openai_schema import ChatRequest

    tried = {
        "temperature": [-0.1, 0.0, 2.0, 2.01],
        "top_p": [0.0, 0.5, 1.0, 1.01],
        "top_k": [-2, -1, 0, 20],
        "repetition_penalty": [0.0, 0.5, 1.3],
    }
    message = [{"role": "user", "content": "hi"}]
    for name, values in tried.items():
        for value in values:
            refused = bool(SamplingArgs.problems({name: value}))
            try:
                ChatRequest(model="a", messages=message, **{name: value})
            except ValidationError:
                assert refused, f"the endpoint refuses {name}={value}, SamplingArgs takes it"
            else:
                assert not refused, f"the endpoint takes {name}={value}, SamplingArgs refuses it"
    # Unset knobs take SamplingArgs' defaults; so does an engine request built in code.
    params = ChatRequest(model="a", messages=message).to_generate("", 512).params
    assert SamplingArgs.of(params) == SamplingArgs() == SamplingArgs.of(SamplingParams())


def test_the_engine_refuses_a_knob_out_of_bounds_naming_it() -> None:
    engine = EmbeddedBackend.from_spec("tiny", max_model_len=256, dtype="float32")
    try:
        request = GenerateRequest("", SamplingParams(temperature=2.5), messages=HELLO)
        with pytest.raises(BackendError, match=re.escape("temperature=2.5 must be at most 2.0")):
            asyncio.run(engine.generate(request))
    finally:
        engine.shutdown()
