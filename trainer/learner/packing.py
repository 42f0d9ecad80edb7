"""Packing for the learner: samples -> prompt units -> rows -> micro-batches.

The K branches of a tree node share one prompt: fed once, followed by each completion, with
an attention mask that keeps siblings apart. Units are packed first-fit-decreasing into rows,
rows into micro-batches within `optim.max_tokens_per_microbatch`.

With a `prefix` (the tokens every prompt of an update starts with, fed once beforehand: see
trainer/learner/prefix.py), each unit holds only the rest of its prompt; its positions continue
after the prefix, and the mask's first `prefix` columns are the prefix's keys.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from masenvs.trainer.samples import Sample

Unit = list[int]
"""Batch indices of samples fed as one copy of their shared prompt followed by each completion."""


def prompt_units(
    batch: Sequence[Sample], share: bool, max_tokens: int | None = None, prefix: int = 0
) -> list[Unit]:
    """Group samples with identical prompts (the K branches of a tree node have one prompt).

    With `max_tokens`, a prompt whose completions do not fit the budget together is split
    into several units, each repeating the prompt (less a `prefix` fed apart): the K
    completions of one prompt may then go to different micro-batches (a lone sequence longer
    than the budget stays whole).
    """
    if not share:
        return [[i] for i in range(len(batch))]
    units: dict[tuple[int, ...], Unit] = {}
    for i, s in enumerate(batch):
        units.setdefault(tuple(s.prompt_token_ids), []).append(i)
    if max_tokens is None:
        return list(units.values())
    split: list[Unit] = []
    for unit in units.values():
        prompt = len(batch[unit[0]].prompt_token_ids) - prefix  # a shared prefix is fed apart
        part: Unit = []
        used = prompt
        for i in unit:
            extra = len(batch[i].completion_token_ids) - 1
            if part and used + extra > max_tokens:
                split.append(part)
                part, used = [], prompt
            part.append(i)
            used += extra
        split.append(part)
    return split


def common_prefix(batch: Sequence[Sample]) -> int:
    """Tokens every prompt of `batch` starts with, short of each prompt's last token (which
    predicts the first completion token, so it stays with its unit)."""
    if not batch:
        return 0
    first = batch[0].prompt_token_ids
    n = min(len(s.prompt_token_ids) for s in batch) - 1
    for s in batch[1:]:
        prompt = s.prompt_token_ids
        k = 0
        while k < n and prompt[k] == first[k]:
            k += 1
        n = k
    return max(n, 0)


def unit_length(batch: Sequence[Sample], unit: Unit, prefix: int = 0) -> int:
    """Input tokens of a unit: the prompt once (less a shared `prefix`), then each completion
    but its last token."""
    prompt = len(batch[unit[0]].prompt_token_ids) - prefix
    return prompt + sum(len(batch[i].completion_token_ids) - 1 for i in unit)


def plan_microbatches(lengths: Sequence[int], max_tokens: int) -> list[list[list[int]]]:
    """Pack units (by length) into rows, and rows into micro-batches of <= `max_tokens`.

    Rows are as wide as the longest unit, filled first-fit-decreasing, so padding is small
    and attention (quadratic in row width) stays as cheap as without packing. A unit longer
    than `max_tokens` gets a micro-batch to itself.
    Returns micro-batches -> rows -> unit indices.
    """
    if not lengths:
        return []
    width = max(lengths)
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for r in range(len(rows)):
            if room[r] >= lengths[i]:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(width - lengths[i])
    per_batch = max(1, max_tokens // width)
    return [rows[k : k + per_batch] for k in range(0, len(rows), per_batch)]


@dataclass
class MicroBatch:
    """Packed rows of units: [prompt][completion 1 minus last token][completion 2 ...] ..."""

    samples: list[int]  # batch indices, in the order their tokens appear in `targets`
    input_ids: torch.Tensor  # [rows, width]
    position_ids: torch.Tensor  # [rows, width]; each completion continues its prompt's positions
    score_index: torch.Tensor  # [n] flat positions whose next token is a completion token
    targets: torch.Tensor  # [n] those completion tokens
    attention_mask: torch.Tensor | None  # [rows, 1, width, width] bool, when prompts are shared
    # Sampling temperature the tokens are scored at: one for all, or [n, 1] when samples differ.
    temperature: float | torch.Tensor = 1.0
    tokens: int = 0  # real (not padding) input tokens, for the FLOP count
    attended: int = 0  # (query, key) pairs among real tokens that attention computes
    prefix: int = 0  # tokens of a shared prefix fed beforehand, the mask's first columns


def build_microbatch(
    batch: Sequence[Sample], rows: list[list[Unit]], prefix: int = 0
) -> MicroBatch:
    """Lay out rows of units; `attention_mask` is None when no prompt is shared.

    Without sharing, position ids that restart at 0 are enough: transformers derives a
    block-diagonal causal mask from them. With sharing, each completion must see its prompt
    but not its sibling completions, so the mask is built here (True = may attend). With a
    `prefix`, every prompt's first `prefix` tokens are left out (they are the keys of the
    mask's first `prefix` columns, which every real token sees).
    """
    width = max(sum(unit_length(batch, u, prefix) for u in row) for row in rows)
    shared = prefix > 0 or any(len(u) > 1 for row in rows for u in row)
    c = prefix  # column of the first token of the row
    mask = torch.zeros(len(rows), 1, width, c + width, dtype=torch.bool) if shared else None
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    position_ids = torch.zeros(len(rows), width, dtype=torch.long)
    order: list[int] = []
    score: list[int] = []
    targets: list[int] = []
    tokens = attended = 0
    for r, row in enumerate(rows):
        o = 0  # where the current unit starts
        for unit in row:
            prompt = batch[unit[0]].prompt_token_ids[prefix:]
            p = len(prompt)
            tokens += p
            attended += p * (p + 1) // 2 + p * prefix
            input_ids[r, o : o + p] = torch.tensor(prompt)
            position_ids[r, o : o + p] = torch.arange(prefix, prefix + p)
            if mask is not None:
                mask[r, 0, o : o + p, :prefix] = True
                mask[r, 0, o : o + p, c + o : c + o + p] = _causal(p)
            start = o + p  # where the current completion starts
            for i in unit:
                completion = batch[i].completion_token_ids
                n = len(completion) - 1
                tokens += n
                # the prefix and its prompt, then itself causally
                attended += n * (prefix + p) + n * (n + 1) // 2
                input_ids[r, start : start + n] = torch.tensor(completion[:-1])
                position_ids[r, start : start + n] = torch.arange(prefix + p, prefix + p + n)
                if mask is not None:
                    mask[r, 0, start : start + n, :prefix] = True
                    mask[r, 0, start : start + n, c + o : c + o + p] = True
                    mask[r, 0, start : start + n, c + start : c + start + n] = _causal(n)
                # completion[0] is predicted by the prompt's last position, completion[j] by
                # the position of completion[j - 1]
                base = r * width
                score += [base + o + p - 1] + [base + start + j for j in range(n)]
                targets += completion
                order.append(i)
                start += n
            o = start
        # Padding is its own sequence (positions restart at 0): real tokens never attend to it.
        position_ids[r, o:] = torch.arange(width - o)
        if mask is not None:
            mask[r, 0, o:, c + o :] = _causal(width - o)  # no fully masked row (NaN in softmax)
    return MicroBatch(
        samples=order,
        input_ids=input_ids,
        position_ids=position_ids,
        score_index=torch.tensor(score, dtype=torch.long),
        targets=torch.tensor(targets, dtype=torch.long),
        attention_mask=mask,
        tokens=tokens,
        attended=attended,
        prefix=prefix,
    )


def prefix_pass(length: int) -> MicroBatch:
    """The shape of a shared prefix's own forward (trainer/learner/prefix.py), for the FLOP count:
    `length` tokens attending causally, nothing scored."""
    empty = torch.zeros(0, dtype=torch.long)
    return MicroBatch(
        samples=[],
        input_ids=torch.zeros(1, length, dtype=torch.long),
        position_ids=torch.arange(length)[None],
        score_index=empty,
        targets=empty,
        attention_mask=None,
        tokens=length,
        attended=length * (length + 1) // 2,
    )


def _causal(n: int) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool).tril()


def mini_batches(n: int, parts: int, seed: int) -> list[list[int]]:
    """Batch indices 0..n-1 split into `parts` mini-batches, shuffled by `seed` (one part:
    the batch in order)."""
    if parts == 1:
        return [list(range(n))]
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    size = math.ceil(n / parts)
    return [order[k : k + size] for k in range(0, n, size)]
