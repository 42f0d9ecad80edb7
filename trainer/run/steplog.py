"""`samples.jsonl`: what each training step did with every sample, for `masenvs ui`.

One JSON line per sample per step: the trace call it came from (`call_id`, `choice`), its
group, reward and reward parts, its advantage, whether its group trained or was dropped and
why, whether its branch continued (tree rollouts), and the learner's log-probs of its tokens
when the learner computed them. The traces hold the text; this file holds the decisions.
"""

from __future__ import annotations

import json
import uuid
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from masenvs.trainer.samples import GroupKey, Sample

SAMPLES_FILE = "samples.jsonl"

# Why a sample did not train: its agent is frozen or off-phase, its group's rewards were all
# equal (advantage 0 everywhere), or a keep_top_groups filter left its group out.
DROP_FROZEN = "frozen"
DROP_FLAT = "flat"
DROP_FILTERED = "filtered"


def step_records(
    step: int, samples: Sequence[Sample], trained: Sequence[Sample], trainable: Sequence[Sample]
) -> list[dict[str, Any]]:
    """One record per sample of the step.

    `trained`: the samples that could train (trained agents, in phase); `trainable`: what
    `group_advantages` returned for them (kept groups, with advantages).
    """
    batch = uuid.uuid4().hex[:12]  # a resumed run rewrites a step: the viewer keeps the last
    could_train = {id(s) for s in trained}
    # group_advantages copies samples but shares their meta dict: it identifies a sample
    advantage = {id(s.meta): s.advantage for s in trainable}
    rewards: dict[GroupKey, list[float]] = defaultdict(list)
    for s in samples:
        rewards[s.group].append(s.reward)
    seen: dict[str, int] = defaultdict(int)
    out = []
    for s in samples:
        key = id(s.meta)
        kept = key in advantage
        if kept:
            drop = None
        elif id(s) not in could_train:
            drop = DROP_FROZEN
        elif len(set(rewards[s.group])) == 1:
            drop = DROP_FLAT
        else:
            drop = DROP_FILTERED
        group = list(s.group)
        call_id = s.meta.get("call_id")
        choice = s.meta.get("choice")
        if choice is None:  # captured and workflow samples: one per choice, in order
            choice = seen[str(call_id)]
            seen[str(call_id)] += 1
        out.append(
            {
                "step": step,
                "batch": batch,
                "call_id": call_id,
                "choice": choice,
                "rollout_id": s.meta.get("rollout_id"),
                "agent": s.agent,
                "policy": s.policy,
                "group": group,
                "task_id": str(group[1] if group and group[0] == "caller" else group[0]),
                "round": s.meta.get("round"),
                "reward": s.reward,
                "reward_parts": s.meta.get("reward_parts"),
                # the team term other agents' steps of the round added to `reward` (RoundCredit)
                "team_term": s.meta.get("team_term"),
                "advantage": advantage.get(key),
                "kept": kept,
                "drop": drop,
                "continued": bool(s.meta.get("continued", False)),
                "design_id": s.meta.get("design_id"),
                "failed": s.meta.get("failed"),
                "completion_tokens": len(s.completion_token_ids),
                "learner_logprobs": _rounded(s.meta.get("learner_logprobs")),
            }
        )
    return out


def write_step_samples(
    path: str | Path,
    step: int,
    samples: Sequence[Sample],
    trained: Sequence[Sample],
    trainable: Sequence[Sample],
) -> None:
    """Append the step's records to `path` (one write, so a reader sees whole lines)."""
    records = step_records(step, samples, trained, trainable)
    if not records:
        return
    text = "".join(json.dumps(r, default=str) + "\n" for r in records)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(text)


def _rounded(values: list[float] | None) -> list[float] | None:
    # written by the learner (trainer/learner/learner.py) when it scored the sample; 5 decimals
    # keep the file small and are far below any mismatch worth seeing
    return [round(v, 5) for v in values] if values else None
