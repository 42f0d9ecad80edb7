"""Mixed task sources: each draw picks a source by weight, then a task from it.

MetaAgent-X trains on math and code together (the published `mixed_env`: a math share, and
within the code share APPS and CodeContests at `apps_ratio`). Here that is

    MixedSource(((generated_math, 0.5), (apps, 0.35), (code_contests, 0.15)))

or `mixed_math_code(math, [(apps, 0.7), (code_contests, 0.3)], math_ratio=0.5)`; the
auto_mas env builds it from `task: mixed` (math_ratio, math_source, code_sources). Draws use only the episode's generator, so a seed gives the same task.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from masenvs.tasks.loaders import TaskSource


@dataclass(frozen=True)
class MixedSource:
    """Sources with weights (normalised to probabilities)."""

    parts: tuple[tuple[TaskSource, float], ...]
    name: str = "mixed"

    def __post_init__(self) -> None:
        if not self.parts:
            raise ValueError("a mixed source needs at least one source")
        for source, weight in self.parts:
            if not (isinstance(weight, int | float) and math.isfinite(weight) and weight >= 0):
                raise ValueError(
                    f"the weight of source {getattr(source, 'name', source)!r} must be a "
                    f"finite number >= 0, got {weight!r}"
                )
        if sum(w for _, w in self.parts) <= 0:
            raise ValueError("the weights of a mixed source must not all be 0")

    @property
    def probabilities(self) -> list[float]:
        total = sum(w for _, w in self.parts)
        return [w / total for _, w in self.parts]

    def sample(self, rng: np.random.Generator) -> Any:
        index = int(rng.choice(len(self.parts), p=self.probabilities))
        return self.parts[index][0].sample(rng)


def mixed_math_code(
    math_source: TaskSource,
    code_sources: Sequence[tuple[TaskSource, float]],
    math_ratio: float = 0.5,
) -> MixedSource:
    """Math with probability `math_ratio`, else code; the code share split among
    `code_sources` (source, weight) by weight (the published `apps_ratio` r is
    [(apps, r), (code_contests, 1 - r)])."""
    if not (isinstance(math_ratio, int | float) and 0.0 <= math_ratio <= 1.0):
        raise ValueError(f"math_ratio must be between 0 and 1, got {math_ratio!r}")
    code = MixedSource(tuple(code_sources), name="code")
    parts = [(math_source, float(math_ratio))]
    parts += [(s, (1.0 - math_ratio) * p) for (s, _), p in zip(code.parts, code.probabilities)]
    names = ", ".join(f"{getattr(s, 'name', s)}:{w:.2f}" for s, w in parts)
    return MixedSource(tuple(parts), name=f"mixed({names})")
