"""How a `Learner` shares each batch with other processes: the hooks its step calls.

`OneProcess` (the default) computes every sample here and every hook is a no-op. A learner
rank on torch.distributed (`masenvs.trainer.learner.rank_learner.RankParallel`) computes its share of
the prompt units and sums gradients, loss sums and log-probs over the ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from masenvs.trainer.atgrpo import LossSums
from masenvs.trainer.learner.scoring import Mismatch
from masenvs.trainer.samples import Sample

Scores = dict[int, tuple[torch.Tensor, torch.Tensor]]
"""Batch index -> (log-probs at each sample's temperature, log-probs at T=1) of its tokens."""


class DataParallel(Protocol):
    """The hooks `Learner.step` and `Learner.logprobs` call (see `OneProcess` for each)."""

    world_size: int
    lockstep: bool
    root_forward: bool
    loss_scale: float

    def assign(self, batch: Sequence[Sample], share: bool, max_tokens: int) -> list[int]: ...
    def max_passes(self, count: int) -> int: ...
    def gradient_sync(self, causal_lm: Any, last: bool) -> None: ...
    def finish_gradients(self, model: Any, causal_lm: Any) -> None: ...
    def reduce(self, sums: LossSums, mismatch: Mismatch | None) -> None: ...
    def gather_scores(self, own: Scores) -> Scores: ...


class OneProcess:
    """The learner alone: it computes every sample, nothing to sum over processes."""

    world_size = 1
    # Every forward and backward is a collective (FSDP): all processes run as many passes.
    lockstep = False
    # Score through the model's own forward, not backbone-then-head (FSDP unshards the
    # embeddings and the head only inside the root module's forward).
    root_forward = False
    # Multiplies each micro-batch's loss before its backward.
    loss_scale = 1.0

    def assign(self, batch: Sequence[Sample], share: bool, max_tokens: int) -> list[int]:
        """Positions in `batch` this process computes, in the order it computes them."""
        return list(range(len(batch)))

    def max_passes(self, count: int) -> int:
        """The most micro-batch passes any process runs (`count` here)."""
        return count

    def gradient_sync(self, causal_lm: Any, last: bool) -> None:
        """Before a pass's backward: whether gradients are reduced over processes in it."""

    def finish_gradients(self, model: Any, causal_lm: Any) -> None:
        """After a mini-batch's passes: make the gradients the sum over processes."""

    def reduce(self, sums: LossSums, mismatch: Mismatch | None) -> None:
        """Turn this process's loss sums (and log-prob mismatch) into every process's."""

    def gather_scores(self, own: Scores) -> Scores:
        """Every process's scores, given this process's (on the learner's device)."""
        return own
