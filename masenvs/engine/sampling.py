"""Token sampling for a batch whose rows each have their own settings and random stream.

Every row draws one uniform number from its own `torch.Generator` per token, so a seeded
request samples the same tokens whether it runs alone or batched with others (up to
floating-point differences in the logits). Log-probabilities are always those of the raw
model distribution (temperature 1, no top-p/top-k, no repetition penalty), the quantity an
RL trainer needs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class RowSampling:
    """How one row samples: temperature 0 means greedy."""

    temperature: float
    top_p: float
    top_k: int
    top_logprobs: int
    generator: torch.Generator
    repetition_penalty: float = 1.0  # 1.0: off
    seen: set[int] = field(default_factory=set)  # prompt and answer tokens it applies to


@dataclass
class Sampled:
    tokens: list[int]
    logprobs: list[float]  # raw model log-probability of each sampled token
    top_logprobs: list[dict[int, float] | None]


def sample(logits: Tensor, rows: list[RowSampling], log_total: Tensor | None = None) -> Sampled:
    """Sample one token per row of `logits` [B, V] (float32); `log_total` [B], if given, is
    each row's log(sum(exp(logits))) (the batch-invariant engine sums each row in a fixed
    order: see kernels.logsumexp)."""
    batch = logits.shape[0]
    # log p(token) = logit - log(sum exp(logits)); the exp weights double as the T=1
    # sampling weights (the inverse CDF needs no normalisation).
    peak = logits.amax(dim=-1, keepdim=True)
    weights = (logits - peak).exp_()
    if log_total is None:
        log_total = peak[:, 0] + weights.sum(dim=-1).log()
    tokens = torch.empty(batch, dtype=torch.long, device=logits.device)
    raw = logits
    penalized = [i for i, r in enumerate(rows) if r.repetition_penalty != 1.0 and r.seen]
    if penalized:  # sampling reads the penalized scores; log-probs stay the raw model's
        logits = _penalize(logits, rows, penalized)

    greedy = [i for i, r in enumerate(rows) if r.temperature <= 0.0]
    plain = [
        i for i, r in enumerate(rows) if r.temperature > 0.0 and r.top_k <= 0 and r.top_p >= 1.0
    ]
    filtered = [
        i for i, r in enumerate(rows) if r.temperature > 0.0 and (r.top_k > 0 or r.top_p < 1.0)
    ]
    if greedy:
        index = _index(greedy, batch, logits.device)
        tokens[index] = logits[index].argmax(dim=-1)
    if plain:
        index = _index(plain, batch, logits.device)
        if all(rows[i].temperature == 1.0 for i in plain) and not penalized:
            probs = weights[index]
        else:
            temps = _column([rows[i].temperature for i in plain], logits)
            probs = torch.softmax(logits[index] / temps, dim=-1)
        tokens[index] = _inverse_cdf(probs, _uniforms([rows[i] for i in plain], logits.device))
    if filtered:
        tokens[filtered] = _sample_filtered(logits[filtered], [rows[i] for i in filtered])

    logits = raw
    chosen = logits.gather(1, tokens[:, None])[:, 0] - log_total
    top: list[dict[int, float] | None] = [None] * batch
    most = max(r.top_logprobs for r in rows)
    if most > 0:
        values, ids = logits.topk(most, dim=-1)
        values, ids = (values - log_total[:, None]).tolist(), ids.tolist()
        for i, r in enumerate(rows):
            if r.top_logprobs > 0:
                top[i] = dict(zip(ids[i][: r.top_logprobs], values[i][: r.top_logprobs]))
    return Sampled(tokens.tolist(), chosen.tolist(), top)


def _penalize(logits: Tensor, rows: list[RowSampling], which: list[int]) -> Tensor:
    """A copy of `logits` where each row's seen tokens score lower: a positive score is
    divided by the row's repetition penalty, a negative one multiplied (as vLLM does)."""
    out = logits.clone()
    for i in which:
        ids = torch.tensor(sorted(rows[i].seen), dtype=torch.long, device=logits.device)
        scores = out[i, ids]
        penalty = rows[i].repetition_penalty
        out[i, ids] = torch.where(scores > 0, scores / penalty, scores * penalty)
    return out


def _sample_filtered(logits: Tensor, rows: list[RowSampling]) -> Tensor:
    """Temperature, then top-k, then top-p (nucleus) on the sorted distribution."""
    temps = _column([r.temperature for r in rows], logits)
    sorted_logits, sorted_ids = torch.sort(logits / temps, dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device)[None]
    top_k = torch.tensor([r.top_k if r.top_k > 0 else vocab for r in rows], device=logits.device)
    sorted_logits = sorted_logits.masked_fill(ranks >= top_k[:, None], float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    top_p = _column([r.top_p for r in rows], probs)
    # Drop a token when the tokens ranked above it already hold top_p of the mass; the
    # most likely token always stays.
    mass_before = probs.cumsum(dim=-1) - probs
    probs = probs.masked_fill(mass_before >= top_p, 0.0)
    picks = _inverse_cdf(probs, _uniforms(rows, logits.device))
    return sorted_ids.gather(1, picks[:, None])[:, 0]


def _inverse_cdf(probs: Tensor, uniforms: Tensor, block: int = 256) -> Tensor:
    """The token where each row's cumulative probability first exceeds `uniform * total`.

    Two levels (blocks of `block` tokens, then tokens within the chosen block), because a
    cumulative sum over a whole vocabulary row is a slow sequential scan on CPU.
    """
    batch, vocab = probs.shape
    blocks = -(-vocab // block)
    if blocks * block != vocab:
        probs = torch.nn.functional.pad(probs, (0, blocks * block - vocab))
    grid = probs.view(batch, blocks, block)
    block_cdf = grid.sum(dim=-1).cumsum(dim=-1)
    targets = uniforms * block_cdf[:, -1]
    chosen = _search(block_cdf, targets)
    before = torch.where(
        chosen > 0, block_cdf.gather(1, (chosen - 1).clamp(min=0)[:, None])[:, 0], 0.0
    )
    inner = grid.gather(1, chosen[:, None, None].expand(batch, 1, block))[:, 0]
    within = _search(inner.cumsum(dim=-1), targets - before)
    return chosen * block + within


def _search(cdf: Tensor, targets: Tensor) -> Tensor:
    """First index with cdf > target; never one of zero mass (rounding can pass the end)."""
    picks = torch.searchsorted(cdf, targets[:, None], right=True)[:, 0]
    mass = torch.diff(cdf, dim=-1, prepend=torch.zeros_like(cdf[:, :1])) > 0
    last = cdf.shape[-1] - 1 - mass.flip(-1).to(torch.int8).argmax(dim=-1)
    return torch.minimum(picks, last)


def _uniforms(rows: list[RowSampling], device: torch.device) -> Tensor:
    values = [float(torch.rand((), generator=r.generator)) for r in rows]
    return torch.tensor(values, dtype=torch.float32, device=device)


def _column(values: list[float], like: Tensor) -> Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device)[:, None]


def _index(rows: list[int], batch: int, device: torch.device) -> slice | Tensor:
    if len(rows) == batch:
        return slice(None)
    return torch.tensor(rows, dtype=torch.long, device=device)
