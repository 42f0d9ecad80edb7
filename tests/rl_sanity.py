"""Helpers of the RL sanity suite (tests/test_rl_sanity.py): a bandit model, a run, the checks.

The tiny test model is random: over 49k tokens it says no word often enough for a bandit,
and with its 0.02-scale tied embeddings no LoRA can make one token likely (a logit is at
most |h| |e| ~ 1.3). `bandit_model` writes a copy that can: embeddings scaled by 10 (the
tiny model then mostly echoes the prompt's last token, a newline), and the word's embedding
pulled towards the newline's, so a sampled first token is the word ~3-20% of the time while
the greedy answer is blank. Learning has to move the greedy answer onto the word.

Why the verdict holds on every CPU (AVX2, AVX-512, AVX512-BF16 order their sums differently,
so two CPUs train along different paths from the same seed): the answer is one token. The
env pays for an answer that *starts* with the word after whitespace, so with 4 tokens
"\n\nYes" paid as much as "Yes": training stopped once sampling said the word somewhere in 4
tokens (97%) while the first token's argmax could still be the newline (41% vs 26% on one
AVX-512 run), and greedy validation read 0%. With one token, sampled success at T=0.7 is the
word's tempered probability and greedy success is its argmax, so the two can only disagree
when the word is below ~50%. `learned` asks for both, well past that edge: of 48 runs (the 6
mode x rollout tests, seeds 0-4 on AVX-512 and 0-2 with torch held to AVX2) all learned, each
agent's last steps sampled 84-100% and greedy was 100%; the bar is 75% over the last 3 steps.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from masenvs.engine.loading import load_model
from masenvs.trainer.config import load_config
from masenvs.trainer.run.metrics import read_metrics
from masenvs.trainer.run.train import train

WORD = "Yes"


def bandit_model(out: Path, word: str = WORD, scale: float = 10.0, pull: float = 0.9) -> Path:
    """Save the tiny model, changed as the module docstring says, as a model directory."""
    loaded = load_model("tiny")
    model, tokenizer = loaded.model, loaded.tokenizer
    (newline,) = tokenizer.encode("\n")
    ids = tokenizer.encode(word)
    if len(ids) != 1:
        raise ValueError(f"{word!r} is {len(ids)} tokens; the bandit word must be one token")
    weight = model.get_input_embeddings().weight  # tied: the LM head too
    with torch.no_grad():
        weight.mul_(scale)
        weight[ids[0]] = pull * weight[newline] + math.sqrt(1 - pull**2) * weight[ids[0]]
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def bandit_overrides(model_dir: Path, run_dir: Path) -> list[str]:
    """`--set` overrides of a say-bandit run: 12 steps, K=8, 8 tasks a step, one-token answers,
    greedy validation of 4 episodes before and after, float32 throughout (the mismatch check
    compares exactly). lr 1e-2 (not 2e-2): at 2e-2 Adam's steps overshot and one run's agent
    collapsed from 88% to 0%; 8 tasks a step (not 4) keep the sampled curve off its noise."""
    return [
        f"run_dir={run_dir}",
        f"model.name={model_dir}",
        "env.name=say",
        f"env.options={{task: fixed, target: '{WORD}'}}",
        "steps=12",
        "rollout.branches=8",
        "rollout.tasks_per_step=8",
        "rollout.max_rounds=1",
        "rollout.max_tokens=1",
        "rollout.temperature=0.7",
        "optim.lr=1e-2",
        "optim.warmup_steps=0",
        "lora.rank=4",
        "lora.alpha=8",
        "validation.every=12",
        "validation.episodes=4",
        "checkpoint.every=100",
        "logging.tensorboard=false",
        "logging.plot_every=0",
        "backend.dtype=float32",
        "backend.max_batch_size=32",
    ]


def bandit_run(model_dir: Path, run_dir: Path, *overrides: str) -> list[dict[str, Any]]:
    """Train on the say bandit through the whole loop; the metrics records of the run."""
    cfg = load_config(None, [*bandit_overrides(model_dir, run_dir), *overrides])
    train(cfg)
    return read_metrics(run_dir / "metrics.jsonl")


# --- the checks ------------------------------------------------------------------------------


def validations(records: list[dict[str, Any]]) -> list[float]:
    return [r["val/success"] for r in records if "val/success" in r]


def sampled(records: list[dict[str, Any]], agent: str, last: int = 3) -> float:
    """An agent's mean sampled reward over the last `last` training steps (0 or 1 a sample)."""
    rewards = [r.get(f"train/reward/{agent}", 0.0) for r in records if "train/success" in r]
    return sum(rewards[-last:]) / len(rewards[-last:])


def learned(records: list[dict[str, Any]], agents: tuple[str, ...] = ("first", "second")) -> bool:
    """The bandit is learned: greedy success 0 before training and >= 90% after, and every
    agent's sampled reward over the last 3 steps >= 0.75 (runs end at 0.84-1.0)."""
    val = validations(records)
    return (
        len(val) >= 2
        and val[0] == 0.0
        and val[-1] >= 0.9
        and all(sampled(records, a) >= 0.75 for a in agents)
    )


def max_logprob_mismatch(records: list[dict[str, Any]]) -> float:
    """Largest mean |learner - backend| log-prob of any policy at any step: the learner scores
    the samples at the weights that generated them, so this is ~0 when weights reach the
    backend after every update (float32: ~1e-5) and grows when the backend samples stale ones."""
    return max(
        (v for r in records for k, v in r.items() if k.endswith("/logprob_diff_mean")),
        default=math.nan,
    )
