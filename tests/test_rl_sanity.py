"""RL sanity suite: the whole loop learns a bandit, and known bugs make it fail visibly.

Every run goes through the real path: tree rollouts of the `say` env, the capture endpoint,
the embedded engine, traces, group advantages, the learner and the weight sync. The bandit
(say "Yes" in one token; see tests/rl_sanity.py for the model it runs on, and for why the
verdict holds on every CPU) is learned in 12 steps in every policy mode and both rollout modes
(tree, trajectory); a flipped advantage sign, a weight sync that leaves the backend on stale
weights, and old log-probs scored with stale weights are each injected and caught.
Slower checks (a rule learned on held-out tasks, with SmolLM2) are in bench/rl_sanity.py.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from rl_sanity import bandit_model, bandit_run, learned, max_logprob_mismatch, validations

import masenvs
from masenvs.envs.say import said
from masenvs.trainer.inference.sync import WeightSync
from masenvs.trainer.learner.learner import Learner
from masenvs.trainer.run import train as train_module

# Run again with torch held to AVX2 on AVX-512 CPUs by .ci/run (issue 47).
pytestmark = pytest.mark.learning

MODES = {
    "shared-lora": ("policy.mode=shared",),
    "per-agent-lora": ("policy.mode=per_agent",),
    # Whole weights move in place of a rank-4 adapter: a smaller step does the same.
    "per-agent-full": ("policy.mode=per_agent", "policy.finetune=full", "optim.lr=1e-3"),
}
ROLLOUTS = ["tree", "trajectory"]  # AT-GRPO tree sampling; K independent episodes (GRPO)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return bandit_model(tmp_path_factory.mktemp("bandit") / "model")


def summary(records: list[dict[str, Any]]) -> str:
    """The numbers a failed assertion should show: greedy and sampled success per step."""
    rows = [
        {k: round(v, 3) for k, v in r.items() if k.startswith(("train/reward/", "val/success"))}
        for r in records
    ]
    return "\n".join(f"step {r['step']}: {row}" for r, row in zip(records, rows, strict=True))


def test_the_say_env_pays_for_the_word_only() -> None:
    env = masenvs.make("say", task="fixed", target="Yes", max_rounds=1)
    env.reset(seed=0)
    assert env.possible_agents == ["first", "second"]
    _, rewards, _, _, _ = env.step({"first": '  "yes!" I said'})
    assert rewards["first"] == 1.0
    _, rewards, terms, truncs, infos = env.step({"second": "No. Yes."})
    assert rewards["second"] == 0.0 and not infos["second"]["success"]
    assert all(truncs.values()) and not any(terms.values())
    assert said("**Yes**", "Yes") and not said("Yesterday", "yes", case_sensitive=True)
    assert not said("", "Yes") and not said("Ye", "Yes")
    # echo: a made-up word per task, the same for a seed, different across seeds
    a, b = masenvs.make("say"), masenvs.make("say")
    words = {a.reset(seed=s)[1]["first"]["task"]["word"] for s in range(20)}
    assert len(words) > 10 and b.reset(seed=3)[1] == a.reset(seed=3)[1]
    with pytest.raises(ValueError, match="a say task is a word"):
        a.reset(options={"task": {"word": " "}})


@pytest.mark.parametrize("rollout", ROLLOUTS)
@pytest.mark.parametrize("mode", MODES)
def test_the_say_bandit_is_learned_in_every_policy_mode(
    mode: str, rollout: str, model_dir: Path, tmp_path: Path
) -> None:
    records = bandit_run(model_dir, tmp_path, *MODES[mode], f"rollout.mode={rollout}")
    assert learned(records), summary(records)
    # the backend sampled every step with the weights the learner scored: same log-probs
    assert max_logprob_mismatch(records) < 1e-3


@pytest.mark.parametrize("rollout", ROLLOUTS)
def test_a_flipped_advantage_sign_is_caught(
    rollout: str, model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = train_module.group_advantages

    def flipped(samples: list, cfg: Any) -> tuple[list, Any]:
        out, stats = real(samples, cfg)
        return [dataclasses.replace(s, advantage=-s.advantage) for s in out], stats

    monkeypatch.setattr(train_module, "group_advantages", flipped)
    records = bandit_run(model_dir, tmp_path, "policy.mode=per_agent", f"rollout.mode={rollout}")
    assert not learned(records), summary(records)
    # it unlearns: the word is said less than before training, greedy never
    rewards = [r["train/reward/first"] for r in records if "train/reward/first" in r]
    assert rewards[-1] < rewards[0] and validations(records)[-1] == 0.0


def test_stale_weights_in_the_backend_are_caught(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = WeightSync.push

    async def only_the_first(self: WeightSync, version: int) -> None:
        if version == 0:  # the base weights go out, no update ever follows
            await real(self, version)

    monkeypatch.setattr(WeightSync, "push", only_the_first)
    records = bandit_run(model_dir, tmp_path, "policy.mode=per_agent")
    # the learner scores samples at its new weights; the backend drew them with the old ones
    assert max_logprob_mismatch(records) > 0.05, summary(records)
    assert not learned(records)


@pytest.mark.parametrize("stale", [False, True], ids=["fresh", "stale"])
def test_old_log_probs_from_stale_weights_are_caught(
    stale: bool, model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two PPO epochs: pi_old comes from a separate no-grad pass before the update. Scored
    # with the base weights (the adapter off) instead of the current ones, every ratio is
    # off by the whole of training so far, and the mismatch against the backend shows it.
    if stale:
        real = Learner._score

        def with_base(self: Learner, policy: Any, batch: list, base: bool = False) -> Any:
            return real(self, policy, batch, base=True)

        monkeypatch.setattr(Learner, "_score", with_base)
    records = bandit_run(
        model_dir,
        tmp_path,
        "policy.mode=per_agent",
        "algorithm.ppo_epochs=2",
        "steps=3",
        "validation.every=0",
    )
    mismatch = max_logprob_mismatch(records)
    assert (mismatch > 0.05) if stale else (mismatch < 1e-3), summary(records)
