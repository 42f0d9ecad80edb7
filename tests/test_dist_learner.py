"""The learner on torch.distributed (2 ranks on gloo, the tiny Llama in fp32): the update
equals the one-process learner's, sharded checkpoints resume exactly and on another world
size, a dead rank fails the next call with a clear error, and `train()` runs on ranks."""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch
from tiny_runs import plan_path_run

from masenvs.trainer.atgrpo import group_advantages
from masenvs.trainer.config import TrainConfig, load_config
from masenvs.trainer.learner.dist_learner import DistributedLearner, LearnerRankError
from masenvs.trainer.learner.learner import Learner
from masenvs.trainer.run.checkpoint import SHARDED, TrainState, load_latest, save_checkpoint
from masenvs.trainer.samples import Sample, tree_group

VOCAB = 49152
AGENTS = ["planner", "coder"]
# AdamW divides each element by its own gradient's size: where a gradient is ~eps, the float
# noise of another summation order (two ranks, or another CPU's kernels) becomes a visible
# step. Every test here that compares weights after AdamW uses a larger eps, which keeps the
# difference below 1e-5 on any instruction set.
STEADY_ADAM = "optim.adam_eps=1e-4"


def config(*overrides: str) -> TrainConfig:
    base = [
        "model.name=tiny",
        "model.device=cpu",
        "lora.rank=4",
        "lora.alpha=8",
        "optim.warmup_steps=0",
        "optim.lr=1e-2",
        "steps=10",
        # several micro-batches per rank, and not as many on each: padding and accumulation
        "optim.max_tokens_per_microbatch=48",
        "distributed.learner.world_size=2",
        "distributed.learner.timeout=120",
    ]
    return load_config(None, base + list(overrides))


def batch(step: int, cfg: TrainConfig) -> list[Sample]:
    """Step `step`'s samples: two tasks per agent, prompts shared by their branches."""
    rng = random.Random(step)
    out = []
    for agent in AGENTS:
        for task in range(2):
            prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(4, 20))]
            for k in range(3):
                completion = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 12))]
                group = tree_group(task, 0, agent)
                policy = cfg.policy.policy_of(agent)
                out.append(Sample(prompt, completion, [], agent, policy, group, float(k)))
    return group_advantages(out, cfg.algorithm)[0]


def weights(learner: Learner | DistributedLearner) -> dict[str, torch.Tensor]:
    out = {}
    for policy in learner.policies:
        if learner.full:
            state = learner.full_state_dict(policy)
        else:
            state = learner.adapter_state_dict(policy)
        out.update({f"{policy}/{k}": v for k, v in state.items()})
    return out


def assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float) -> None:
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst <= atol, f"largest difference {worst:.3g} > {atol:g}"


def assert_same_update(one: dict[str, float], two: dict[str, float]) -> None:
    """Loss terms and the pre-clip gradient norm agree: a rank that normalised by its own
    tokens, or gradients averaged instead of summed, would show here (AdamW hides scale)."""
    ends = ("/loss", "/grad_norm", "/tokens", "/ratio_mean", "/kl_ref")
    keys = [k for k in one if k.endswith(ends)]
    assert keys
    for k in keys:
        assert two[k] == pytest.approx(one[k], rel=1e-4, abs=1e-6), k


def test_lora_per_agent_on_two_fsdp_ranks_updates_as_one_process_and_resumes_anywhere(
    tmp_path: Path,
) -> None:
    cfg = config("policy.mode=per_agent", "distributed.learner.sharding=fsdp", STEADY_ADAM)
    one = Learner(cfg, AGENTS)
    two = DistributedLearner(cfg, AGENTS)
    try:
        assert_same_update(one.step(batch(0, cfg)), two.step(batch(0, cfg)))
        assert_close(weights(one), weights(two), atol=1e-5)
        save_checkpoint(tmp_path / "two", two, TrainState(1, 1), cfg)
        save_checkpoint(tmp_path / "one", one, TrainState(1, 1), cfg)
        assert_same_update(one.step(batch(1, cfg)), two.step(batch(1, cfg)))
        after_two = weights(two)
        assert_close(weights(one), after_two, atol=1e-5)
    finally:
        two.close()
    shards = tmp_path / "two" / "checkpoints" / "step_00000001" / SHARDED
    assert sorted(p.name for p in shards.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert json.loads((shards / "learner.json").read_text())["world_size"] == 2

    # Same world size, fresh ranks: the next update is the uninterrupted one, bit for bit.
    again = DistributedLearner(cfg, AGENTS)
    try:
        assert load_latest(tmp_path / "two").restore(again).step == 1
        again.step(batch(1, cfg))
        resumed = weights(again)
        assert all(torch.equal(resumed[k], after_two[k]) for k in after_two)

        # 1 -> 2: a one-process checkpoint (learner.pt) loads into the ranks.
        load_latest(tmp_path / "one").restore(again)
        again.step(batch(1, cfg))
        assert_close(weights(one), weights(again), atol=1e-5)
    finally:
        again.close()

    # 2 -> 1: the ranks' shards load into a one-process learner (DCP, no process group).
    single = Learner(cfg, AGENTS)
    load_latest(tmp_path / "two").restore(single)
    assert single.steps_done == 1
    assert single.state_dict()["optimizers"]["coder"]["state"]  # AdamW moments came back
    single.step(batch(1, cfg))
    assert_close(after_two, weights(single), atol=1e-5)


def test_full_finetuning_on_two_fsdp_ranks_updates_as_one_process(tmp_path: Path) -> None:
    cfg = config("policy.finetune=full", "policy.mode=shared", STEADY_ADAM)
    one = Learner(cfg, AGENTS)
    two = DistributedLearner(cfg, AGENTS)
    try:
        assert_same_update(one.step(batch(0, cfg)), two.step(batch(0, cfg)))
        assert_close(weights(one), weights(two), atol=1e-5)
        save_checkpoint(tmp_path, two, TrainState(1, 1), cfg)
        assert_same_update(one.step(batch(1, cfg)), two.step(batch(1, cfg)))
        after_two = weights(two)
        assert_close(weights(one), after_two, atol=1e-5)
    finally:
        two.close()
    single = Learner(cfg, AGENTS)  # 2 -> 1 for whole models: models/ + the AdamW shards
    load_latest(tmp_path).restore(single)
    single.step(batch(1, cfg))
    assert_close(after_two, weights(single), atol=1e-5)


def test_scoring_passes_split_over_ranks_as_well() -> None:
    # Two mini-batches and a KL term: pi_old and the base model are scored in no-grad passes
    # before the update, each rank scoring its share.
    cfg = config(
        "policy.mode=shared",
        "algorithm.mini_batches=2",
        "algorithm.kl_coef=0.1",
        STEADY_ADAM,
    )
    one = Learner(cfg, AGENTS)
    two = DistributedLearner(cfg, AGENTS)
    try:
        samples = batch(0, cfg)
        for a, b in zip(one.logprobs("shared", samples), two.logprobs("shared", samples)):
            assert torch.allclose(a, b, atol=1e-5)
        update = two.step(samples)
        assert_same_update(one.step(samples), update)
        assert_close(weights(one), weights(two), atol=1e-5)
        assert_same_update(one.step(batch(1, cfg)), two.step(batch(1, cfg)))
        assert_close(weights(one), weights(two), atol=1e-5)
    finally:
        two.close()


def test_ddp_ranks_update_as_one_process_and_a_dead_rank_fails_the_next_call() -> None:
    cfg = config("policy.mode=shared", "distributed.learner.sharding=ddp", STEADY_ADAM)
    one = Learner(cfg, AGENTS)
    two = DistributedLearner(cfg, AGENTS)
    try:
        assert_same_update(one.step(batch(0, cfg)), two.step(batch(0, cfg)))
        assert_close(weights(one), weights(two), atol=1e-5)

        two.processes[1].kill()
        start = time.monotonic()
        with pytest.raises(LearnerRankError, match=r"learner rank 1 died .* during step"):
            two.step(batch(1, cfg))
        assert time.monotonic() - start < 30  # not the 120 s timeout, and no hang
        assert not any(p.is_alive() for p in two.processes)  # the survivor is stopped too
        with pytest.raises(LearnerRankError, match="closed"):
            two.adapter_state_dict("shared")
    finally:
        two.close()


def test_a_silent_rank_fails_the_call_at_the_timeout() -> None:
    two = DistributedLearner(config("distributed.learner.sharding=ddp"), AGENTS)
    try:
        two.timeout = 3.0  # distributed.learner.timeout, lowered once the ranks are up
        os.kill(two.processes[1].pid, signal.SIGSTOP)  # alive, but never answers
        start = time.monotonic()
        with pytest.raises(
            LearnerRankError, match=r"did not finish step within distributed.learner.timeout=3s"
        ):
            two.step(batch(0, two.cfg))
        assert 3.0 <= time.monotonic() - start < 20
        assert not any(p.is_alive() for p in two.processes)
    finally:
        two.close()


def test_train_runs_two_steps_on_two_learner_ranks(tmp_path: Path) -> None:
    from rich.console import Console

    from masenvs.trainer.run.metrics import read_metrics
    from masenvs.trainer.run.train import train

    cfg = config(*plan_path_run(tmp_path))
    train(cfg, console=Console(quiet=True))
    rows = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "learner/lr" in r]
    assert len(rows) == 2
    trained = [v for r in rows for k, v in r.items() if k.endswith("/tokens")]
    assert trained and all(v > 0 for v in trained), rows  # the ranks trained on the samples
    checkpoint = load_latest(tmp_path)
    assert checkpoint is not None and checkpoint.state.step == 2
    assert (checkpoint.path / SHARDED / "learner.json").is_file()
