"""The trainer's unit of data: one `Sample` is one LLM call with its reward.

Token ids and behaviour log-probabilities come from the backend that generated them
(never re-tokenized), and so do the sampling parameters the call used: the learner scores
each sample at its own temperature. The group key decides which samples share an advantage
baseline.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from masenvs.sampling_args import SamplingArgs
from masenvs.traces import CallRecord

GroupKey = tuple[Hashable, ...]


def tree_group(task_id: Hashable, round: int, agent: str) -> GroupKey:
    """AT-GRPO tree rollouts: the K candidates of one agent at one round of one task (the
    default; `rollout.group_by`'s other keys are in trainer/rollout/grouping.py)."""
    return (task_id, round, agent)


def workflow_group(
    task_id: Hashable, agent: str, call_index: int, step: str | None = None
) -> GroupKey:
    """Framework workflows (no branching): the same call of K independent runs of one task.

    Without a step, the c-th call of the agent; with one (`model="critic@verdict"`), the
    c-th call of the agent at that step, so like decisions group together.
    """
    return (task_id, agent, call_index) if step is None else (task_id, agent, step, call_index)


@dataclass
class Sample:
    """One training sample = one LLM call: its tokens, who made it, and how good it was."""

    prompt_token_ids: list[int]
    completion_token_ids: list[int]  # includes the EOS token when the model stopped on it
    behavior_logprobs: list[float]  # backend log-prob of each completion token (T=1), or []
    agent: str  # role that made the call
    policy: str  # adapter (or model) this sample trains
    group: GroupKey  # samples with equal keys share a baseline, see tree_group / workflow_group
    reward: float
    advantage: float | None = None  # filled by group_advantages
    meta: dict[str, Any] = field(default_factory=dict)  # free-form: trace id, episode, round
    # How the call sampled (from its request, or its trace record); None: not known, and the
    # learner scores at the agent's configured temperature.
    sampling: SamplingArgs | None = None

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("a sample needs at least one prompt token")
        if self.behavior_logprobs and len(self.behavior_logprobs) != len(self.completion_token_ids):
            raise ValueError(
                f"behavior_logprobs has {len(self.behavior_logprobs)} entries for "
                f"{len(self.completion_token_ids)} completion tokens; they must match one to one"
            )
        if not math.isfinite(self.reward):
            raise ValueError(f"reward must be a finite number, got {self.reward!r}")
        try:
            hash(self.group)
        except TypeError:
            raise ValueError(f"group key {self.group!r} must be hashable (a tuple)") from None

    @property
    def num_tokens(self) -> int:
        """Prompt plus completion length."""
        return len(self.prompt_token_ids) + len(self.completion_token_ids)


def call_samples(
    call: CallRecord,
    *,
    agent: str,
    policy: str,
    group: GroupKey,
    reward: float,
    meta: dict[str, Any],
) -> list[Sample]:
    """One sample per sampled choice of a recorded call (workflow runs, calls an env made),
    with the sampling parameters the record says it used; behaviour log-probs kept only
    when there is one per token."""
    sampling = SamplingArgs.from_record(call.params)
    samples = []
    for choice in call.choices:
        logprobs = choice.logprobs if len(choice.logprobs) == len(choice.token_ids) else []
        samples.append(
            Sample(
                prompt_token_ids=list(call.prompt_token_ids),
                completion_token_ids=list(choice.token_ids),
                behavior_logprobs=list(logprobs),
                agent=agent,
                policy=policy,
                group=group,
                reward=reward,
                meta=dict(meta),
                sampling=sampling,
            )
        )
    return samples
