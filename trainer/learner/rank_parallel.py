"""How a learner rank shares the batch with the other ranks on torch.distributed: whole prompt
units dealt to ranks by tokens; gradients, loss sums and log-probs summed over ranks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from masenvs.trainer.atgrpo import SUMMED, LossSums
from masenvs.trainer.learner.packing import prompt_units, unit_length
from masenvs.trainer.learner.parallel import Scores
from masenvs.trainer.learner.scoring import Mismatch
from masenvs.trainer.samples import Sample


class RankParallel:
    """How a rank shares the batch (a `masenvs.trainer.learner.parallel.DataParallel`): whole prompt
    units dealt to ranks by tokens; gradients, loss sums and log-probs summed over ranks."""

    def __init__(self, rank: int, world_size: int, fsdp: bool, device: torch.device) -> None:
        self.rank, self.world_size, self.device = rank, world_size, device
        self.fsdp = fsdp
        self.lockstep = fsdp  # every FSDP forward and backward is a collective
        # FSDP unshards the root unit (embeddings, head) only in the root module's forward,
        # so the backbone-then-head shortcut of the one-process learner is out.
        self.root_forward = fsdp
        # The mean over ranks FSDP's reduce-scatter takes is then the sum over ranks that the
        # global token mean needs.
        self.loss_scale = float(world_size) if fsdp else 1.0

    def assign(self, batch: Sequence[Sample], share: bool, max_tokens: int) -> list[int]:
        units = prompt_units(batch, share, max_tokens)
        return [i for u in _balance(units, batch, self.world_size)[self.rank] for i in u]

    def max_passes(self, count: int) -> int:
        total = torch.tensor([count])
        dist.all_reduce(total, op=dist.ReduceOp.MAX)
        return int(total)

    def gradient_sync(self, causal_lm: Any, last: bool) -> None:
        if self.fsdp:  # gradients are reduced on the last pass only
            causal_lm.set_requires_gradient_sync(last)

    def finish_gradients(self, model: Any, causal_lm: Any) -> None:
        if self.fsdp:
            causal_lm.set_requires_gradient_sync(True)
        else:
            _all_reduce_gradients(model)

    def reduce(self, sums: LossSums, mismatch: Mismatch | None) -> None:
        _reduce_sums(sums)
        if mismatch is not None:
            _reduce_mismatch(mismatch)

    def gather_scores(self, own: Scores) -> Scores:
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, {i: (lp.cpu(), r.cpu()) for i, (lp, r) in own.items()})
        return {
            i: (lp.to(self.device), r.to(self.device))
            for part in gathered
            for i, (lp, r) in part.items()
        }


def _balance(units: list[list[int]], batch: Sequence[Sample], ranks: int) -> list[list[list[int]]]:
    """Prompt units dealt to ranks, longest first to the least loaded (same on every rank)."""
    load = [0] * ranks
    out: list[list[list[int]]] = [[] for _ in range(ranks)]
    for u in sorted(range(len(units)), key=lambda u: (-unit_length(batch, units[u]), u)):
        r = min(range(ranks), key=lambda r: (load[r], r))
        out[r].append(units[u])
        load[r] += unit_length(batch, units[u])
    return out


def _all_reduce_gradients(model: Any) -> None:
    """'ddp': sum the replicas' gradients in one flat buffer (ranks ran unequal micro-batch
    counts, so per-backward hooks as in DistributedDataParallel would not line up)."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat)
    offset = 0
    for p in params:
        n = p.grad.numel()
        p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
        offset += n


def _reduce_sums(sums: LossSums) -> None:
    names = ["tokens", *SUMMED]
    extra = sorted(sums.extra)
    values = torch.tensor(
        [float(getattr(sums, n)) for n in names] + [sums.extra[k] for k in extra],
        dtype=torch.float64,
    )
    dist.all_reduce(values)
    top = torch.tensor([sums.ratio_max], dtype=torch.float64)
    dist.all_reduce(top, op=dist.ReduceOp.MAX)
    for n, v in zip(names, values[: len(names)].tolist(), strict=True):
        setattr(sums, n, int(v) if n == "tokens" else v)
    for k, v in zip(extra, values[len(names) :].tolist(), strict=True):
        sums.extra[k] = v
    sums.ratio_max = float(top)


def _reduce_mismatch(m: Mismatch) -> None:
    values = torch.tensor([m.total, float(m.count)], dtype=torch.float64)
    dist.all_reduce(values)
    top = torch.tensor([m.max], dtype=torch.float64)
    dist.all_reduce(top, op=dist.ReduceOp.MAX)
    m.total, m.count, m.max = float(values[0]), int(values[1]), float(top)
