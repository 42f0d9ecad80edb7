"""`top_k` and the repetition penalty (the authors sample with top_k 20 and vLLM's default
repetition penalty): from the config through the endpoint to the embedded engine's sampler
and to vLLM's request body; log-probabilities stay the raw model's."""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch
from fake_vllm import FakeVLLM

from masenvs.adapters.backends.launch import model_dir
from masenvs.adapters.backends.vllm import VLLMBackend
from masenvs.adapters.endpoint import EndpointServer
from masenvs.engine.engine import EmbeddedBackend
from masenvs.engine.protocol import GenerateRequest, SamplingParams
from masenvs.engine.sampling import RowSampling, sample
from masenvs.traces import TraceStore
from masenvs.trainer.config import load_config
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
