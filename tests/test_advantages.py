"""AT-GRPO advantages on hand-computed groups: A = (r - mean) / (std + eps) within a group."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from masenvs.trainer.atgrpo import group_advantages
from masenvs.trainer.samples import Sample, tree_group, workflow_group
from masenvs.trainer.update_config import AlgorithmConfig

EPS = 1e-6


def sample(reward: float, group: tuple, agent: str = "coder", policy: str | None = None) -> Sample:
    return Sample(
        prompt_token_ids=[1, 2, 3],
        completion_token_ids=[4, 5],
        behavior_logprobs=[-0.5, -0.7],
        agent=agent,
        policy=policy or agent,
        group=group,
        reward=reward,
    )


def advantages(samples: list[Sample], **cfg: object) -> list[float]:
    out, _ = group_advantages(samples, AlgorithmConfig(**cfg))
    return [s.advantage for s in out]


def test_two_winners_two_losers_get_plus_and_minus_one() -> None:
    g = tree_group("task0", 0, "coder")
    # mean 0.5, population std 0.5 -> (1 - 0.5) / 0.5 = 1
    a = advantages([sample(1.0, g), sample(0.0, g), sample(0.0, g), sample(1.0, g)])
    expected = 0.5 / (0.5 + EPS)
    assert a == pytest.approx([expected, -expected, -expected, expected], abs=1e-12)


def test_uneven_group_matches_hand_computation() -> None:
    g = tree_group(7, 2, "tester")
    rewards = [2.0, 0.0, 1.0]
    # mean 1, population std sqrt(2/3)
    std = math.sqrt(2 / 3)
    a = advantages([sample(r, g, agent="tester") for r in rewards])
    assert a == pytest.approx([(r - 1.0) / (std + EPS) for r in rewards], abs=1e-12)


def test_unbiased_std_divides_by_n_minus_one() -> None:
    g = tree_group(0, 0, "coder")
    a = advantages([sample(1.0, g), sample(0.0, g)], unbiased_std=True)
    std = math.sqrt(0.5)  # sample std of {0, 1}
    assert a == pytest.approx([0.5 / (std + EPS), -0.5 / (std + EPS)], abs=1e-12)


def test_without_the_std_groups_weigh_by_their_spread() -> None:
    # Dr. GRPO: a group that differs by a step cost (0.01) stays tiny beside a solved one;
    # divided by the std both would get +-1.
    solved, cost = tree_group("t0", 0, "coder"), tree_group("t1", 0, "coder")
    batch = [sample(1.5, solved), sample(0.0, solved), sample(-0.02, cost), sample(-0.03, cost)]
    a = advantages(batch, scale_by_std=False)
    assert a == pytest.approx([0.75, -0.75, 0.005, -0.005], abs=1e-12)
    scaled = advantages(batch)
    assert scaled == pytest.approx([1.0, -1.0, 1.0, -1.0], abs=1e-3)
    # Equal rewards stay exactly 0 either way.
    assert advantages([sample(0.1, cost)] * 3, scale_by_std=False) == [0.0, 0.0, 0.0]


def test_equal_rewards_give_exactly_zero() -> None:
    g = tree_group(0, 1, "coder")
    # 0.1 three times: the float mean is not exactly 0.1; the advantage must still be 0.0.
    out, stats = group_advantages([sample(0.1, g)] * 3, AlgorithmConfig())
    assert [s.advantage for s in out] == [0.0, 0.0, 0.0]
    assert stats.zero_std == 1 and stats.kept == 1


def test_single_sample_group_has_no_baseline_and_gets_zero() -> None:
    out, stats = group_advantages([sample(5.0, tree_group(0, 0, "coder"))], AlgorithmConfig())
    assert out[0].advantage == 0.0
    assert stats.singleton == 1 and stats.zero_std == 1


def test_groups_of_different_tasks_never_merge() -> None:
    # The same (round, agent) in two tasks: each task is its own baseline.
    easy, hard = tree_group("easy", 0, "coder"), tree_group("hard", 0, "coder")
    a = advantages([sample(10.0, easy), sample(11.0, easy), sample(0.0, hard), sample(1.0, hard)])
    one = 0.5 / (0.5 + EPS)
    assert a == pytest.approx([-one, one, -one, one], abs=1e-12)


def test_groups_of_different_agents_and_rounds_never_merge() -> None:
    samples = [
        sample(1.0, tree_group(0, 0, "coder")),
        sample(0.0, tree_group(0, 0, "coder")),
        sample(3.0, tree_group(0, 0, "tester"), agent="tester"),
        sample(3.0, tree_group(0, 1, "coder")),
    ]
    a = advantages(samples)
    one = 0.5 / (0.5 + EPS)
    assert a == pytest.approx([one, -one, 0.0, 0.0], abs=1e-12)


def test_workflow_groups_key_by_call_index() -> None:
    first, second = workflow_group("t", "coder", 0), workflow_group("t", "coder", 1)
    a = advantages(
        [sample(1.0, first), sample(0.0, first), sample(0.0, second), sample(0.0, second)]
    )
    one = 0.5 / (0.5 + EPS)
    assert a == pytest.approx([one, -one, 0.0, 0.0], abs=1e-12)


def test_drop_zero_std_groups_removes_flat_and_singleton_groups() -> None:
    live, flat, single = (tree_group(i, 0, "coder") for i in range(3))
    samples = [sample(1.0, live), sample(0.0, live), sample(2.0, flat), sample(2.0, flat)]
    samples.append(sample(9.0, single))
    out, stats = group_advantages(samples, AlgorithmConfig(drop_zero_std_groups=True))
    assert [s.group for s in out] == [live, live]
    assert (stats.groups, stats.kept, stats.zero_std, stats.samples_kept) == (3, 1, 2, 2)


def test_keep_top_groups_by_std_rounds_up_and_keeps_advantages() -> None:
    narrow, wide, mid = (tree_group(i, 0, "coder") for i in range(3))
    samples = [
        sample(0.0, narrow),
        sample(0.2, narrow),  # std 0.1
        sample(0.0, wide),
        sample(4.0, wide),  # std 2
        sample(0.0, mid),
        sample(1.0, mid),  # std 0.5
    ]
    out, stats = group_advantages(samples, AlgorithmConfig(keep_top_groups=0.5))
    # ceil(0.5 * 3) = 2 groups: the two widest, in batch order.
    assert [s.group for s in out] == [wide, wide, mid, mid]
    unfiltered = advantages(samples)
    assert [s.advantage for s in out] == unfiltered[2:6]
    assert stats.kept == 2


def test_keep_top_groups_by_mean() -> None:
    low, high = tree_group(0, 0, "coder"), tree_group(1, 0, "coder")
    samples = [sample(0.0, low), sample(1.0, low), sample(5.0, high), sample(6.0, high)]
    out, _ = group_advantages(samples, AlgorithmConfig(keep_top_groups=0.5, keep_top_by="mean"))
    assert [s.group for s in out] == [high, high]


def test_keep_top_groups_ranks_each_policys_groups_apart() -> None:
    # The tool's rewards are all higher than the plan's; ranked together, keeping half the
    # groups would keep only the tool's. The authors filter each model's batch on its own.
    tool = [tree_group(i, 0, "tool") for i in range(4)]
    plan = [tree_group(i, 0, "plan") for i in range(4)]
    samples = []
    for i in range(4):
        samples += [sample(10.0 + i, tool[i], "tool"), sample(10.0, tool[i], "tool")]
        samples += [sample(1.0 + i, plan[i], "plan"), sample(0.0, plan[i], "plan")]
    out, stats = group_advantages(samples, AlgorithmConfig(keep_top_groups=0.5, keep_top_by="mean"))
    assert {s.group for s in out} == {tool[2], tool[3], plan[2], plan[3]}
    assert stats.kept == 4
    # One shared policy: its groups are ranked together, as before.
    shared = [replace(s, policy="shared") for s in samples]
    out, _ = group_advantages(shared, AlgorithmConfig(keep_top_groups=0.5, keep_top_by="mean"))
    assert {s.group for s in out} == set(tool)


def test_inputs_are_not_mutated() -> None:
    g = tree_group(0, 0, "coder")
    samples = [sample(1.0, g), sample(0.0, g)]
    group_advantages(samples, AlgorithmConfig())
    assert all(s.advantage is None for s in samples)


def test_a_group_mixing_policies_is_an_error() -> None:
    g = ("task", 0)
    with pytest.raises(ValueError, match="mixes policies"):
        group_advantages([sample(1.0, g, "coder"), sample(0.0, g, "tester")], AlgorithmConfig())


def test_bad_samples_fail_clearly() -> None:
    with pytest.raises(ValueError, match="behavior_logprobs has 1 entries for 2"):
        Sample([1], [2, 3], [-0.1], "a", "a", (0,), 1.0)
    with pytest.raises(ValueError, match="finite"):
        Sample([1], [2], [-0.1], "a", "a", (0,), float("nan"))
    with pytest.raises(ValueError, match="hashable"):
        Sample([1], [2], [-0.1], "a", "a", ([0],), 1.0)  # type: ignore[arg-type]


@given(st.lists(st.lists(st.integers(-5, 5), min_size=2, max_size=8), min_size=1, max_size=6))
def test_every_varied_group_has_zero_mean_and_unit_rms(groups: list[list[int]]) -> None:
    samples = [
        sample(float(r), tree_group(g, 0, "coder")) for g, rs in enumerate(groups) for r in rs
    ]
    out, _ = group_advantages(samples, AlgorithmConfig())
    for g, rewards in enumerate(groups):
        a = [s.advantage for s in out if s.group == tree_group(g, 0, "coder")]
        if len(set(rewards)) == 1:
            assert a == [0.0] * len(rewards)
            continue
        assert sum(a) == pytest.approx(0.0, abs=1e-9)
        # population std: mean(A^2) = std^2 / (std + eps)^2, i.e. 1 up to eps
        assert sum(x * x for x in a) / len(a) == pytest.approx(1.0, abs=1e-5)
