"""Which samples share a GRPO baseline: `rollout.group_by`, and the authors' `no_tree` filter.

| group_by | key | the grouping ablation's row |
| --- | --- | --- |
| `turn_agent` | (task, round, agent) | both (the paper's AT-GRPO) |
| `agent` | (task, agent) | agent-only |
| `turn` | (task, round, policy) | turn-only: the agents of a round share a baseline |
| `task` | (task, policy) | no grouping: one group per task |

A baseline never spans two policies (`group_advantages` refuses it): each policy's batch is
normalised on its own, as the authors' per-model trainers do. With one policy per agent,
`turn` is then `turn_agent` and `task` is `agent`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable
from typing import Literal

from masenvs.trainer.samples import GroupKey, Sample, tree_group

GroupBy = Literal["turn_agent", "agent", "turn", "task"]


def group_key(
    group_by: GroupBy, task_id: Hashable, round_: int, agent: str, policy: str
) -> GroupKey:
    """The group of one call of `agent` (trained as `policy`) at `round_` of task `task_id`."""
    if group_by == "turn_agent":
        return tree_group(task_id, round_, agent)
    if group_by == "agent":
        return (task_id, agent)
    if group_by == "turn":
        return (task_id, round_, policy)
    return (task_id, policy)


def spans_turns(group_by: GroupBy) -> bool:
    """Whether a group pools an agent's calls of different rounds (trajectory mode then gives
    each call its agent's episode return: turn rewards of different rounds do not compare)."""
    return group_by in ("agent", "task")


def regroup(samples: list[Sample], task_id: Hashable, group_by: GroupBy) -> None:
    """Set every sample's group (its round is `meta["round"]`) to `group_by`'s key."""
    for s in samples:
        s.group = group_key(group_by, task_id, s.meta["round"], s.agent, s.policy)


def last_turn_only(samples: list[Sample]) -> list[Sample]:
    """The authors' `no_tree` filter over the K episodes of one task: each policy keeps only
    its samples of the largest round any of them reached. Earlier rounds are dropped, and so
    is every episode that ended sooner (one solved in round 1 trains nothing)."""
    last: dict[str, int] = defaultdict(int)
    for s in samples:
        last[s.policy] = max(last[s.policy], s.meta["round"])
    return [s for s in samples if s.meta["round"] == last[s.policy]]
