"""Scoring and the loss: log-probs of completion tokens, chunk by chunk, and the AT-GRPO loss
of one micro-batch (its backward, and the token sums the step's metrics come from)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from masenvs.trainer.atgrpo import LossSums, policy_loss
from masenvs.trainer.samples import Sample
from masenvs.trainer.update_config import AlgorithmConfig


@dataclass
class Scored:
    """Log-probs of a micro-batch's completion tokens, in `MicroBatch.samples` order."""

    logprobs: torch.Tensor  # [n] at the training temperature; with grad in the update pass
    raw_logprobs: torch.Tensor  # [n] at T=1 (what backends report), no grad
    entropy_sum: float


def token_logprobs(
    head: torch.nn.Module | None,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperature: float | torch.Tensor,
    chunk_tokens: int,
    with_entropy: bool = False,
) -> Scored:
    """log softmax(head(hidden) / T)[target] per row, `chunk_tokens` rows at a time.

    The fp32 logits [rows, vocab] are the largest tensor of a step (vocab 150k: 600 kB per
    token). Each chunk's logits exist only while that chunk is scored: with grad, the chunk
    runs under activation checkpointing, so the backward recomputes them chunk by chunk too
    and autograd never keeps them. `head=None` means `hidden` already is the logits.
    `temperature` is one number, or one per row ([rows, 1]) when agents sample at different
    temperatures.
    """
    grad = torch.is_grad_enabled() and hidden.requires_grad
    logprobs, raw, entropy = [], [], 0.0
    for begin in range(0, hidden.shape[0], chunk_tokens):
        h, t = hidden[begin : begin + chunk_tokens], targets[begin : begin + chunk_tokens]
        temp = temperature
        if isinstance(temp, torch.Tensor):
            temp = temp[begin : begin + chunk_tokens]
        if grad:
            lp, logits = checkpoint(_chunk_logprobs, head, h, t, temp, use_reentrant=False)
        else:
            lp, logits = _chunk_logprobs(head, h, t, temp)
        with torch.no_grad():  # from the logits the chunk computed anyway; no graph
            if _is_one(temp):
                raw.append(lp.detach())
            else:
                raw.append(-F.cross_entropy(logits, t, reduction="none"))
            if with_entropy:
                z = logits if _is_one(temp) else logits / temp
                entropy += (
                    (torch.logsumexp(z, -1) - (torch.softmax(z, -1) * z).sum(-1)).sum().item()
                )
        del logits
        logprobs.append(lp)
    empty = hidden.new_zeros(0, dtype=torch.float32)
    return Scored(
        logprobs=torch.cat(logprobs) if logprobs else empty,
        raw_logprobs=torch.cat(raw) if raw else empty,
        entropy_sum=entropy,
    )


def _is_one(temperature: float | torch.Tensor) -> bool:
    return not isinstance(temperature, torch.Tensor) and temperature == 1.0


def _chunk_logprobs(
    head: torch.nn.Module | None,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperature: float | torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs at `temperature` with grad, the fp32 logits at T=1 without)."""
    logits = (head(hidden) if head is not None else hidden).float()
    scaled = logits if _is_one(temperature) else logits / temperature
    return -F.cross_entropy(scaled, targets, reduction="none"), logits.detach()


def microbatch_backward(
    batch: Sequence[Sample],
    idx: Sequence[int],
    scored: Scored,
    old: list[torch.Tensor] | None,
    ref: list[torch.Tensor] | None,
    num_tokens: int,
    algo: AlgorithmConfig,
    device: torch.device,
    scale: float = 1.0,
) -> LossSums:
    """Backward of micro-batch `batch[idx]`'s share of the token-mean loss over `num_tokens`
    tokens (times `scale`); its token sums. `old`/`ref`: per-sample log-probs, or None."""
    old_lp = gather(old, idx) if old is not None else scored.logprobs.detach()
    ref_lp = gather(ref, idx) if ref is not None else None
    adv = torch.cat(
        [torch.full((len(batch[i].completion_token_ids),), batch[i].advantage) for i in idx]
    ).to(device)
    loss, sums = policy_loss(scored.logprobs, old_lp, adv, num_tokens, algo, ref_logprobs=ref_lp)
    (loss * scale if scale != 1.0 else loss).backward()
    sums.extra["entropy"] = scored.entropy_sum
    return sums


class Mismatch:
    """|learner log-prob - backend log-prob| over completion tokens (same weights, T=1)."""

    def __init__(self) -> None:
        self.total = 0.0
        self.count = 0
        self.max = 0.0

    def add(self, batch: Sequence[Sample], idx: Sequence[int], raw: Sequence[torch.Tensor]) -> None:
        for i, lp in zip(idx, raw, strict=True):
            # Kept per sample for the viewer (`masenvs ui` shows both, token by token).
            batch[i].meta["learner_logprobs"] = lp.cpu().tolist()
            behavior = batch[i].behavior_logprobs
            if not behavior:
                continue
            diff = (lp.cpu().double() - torch.tensor(behavior, dtype=torch.float64)).abs()
            self.total += diff.sum().item()
            self.count += diff.numel()
            self.max = max(self.max, diff.max().item())

    def means(self) -> dict[str, float]:
        if not self.count:
            return {}
        return {"logprob_diff_mean": self.total / self.count, "logprob_diff_max": self.max}

    def merge(self, other: Mismatch) -> None:
        """Add another's totals (another rank's share of the batch)."""
        self.total += other.total
        self.count += other.count
        self.max = max(self.max, other.max)


def split_per_sample(
    flat: torch.Tensor, batch: Sequence[Sample], idx: Sequence[int]
) -> list[torch.Tensor]:
    """A micro-batch's flat per-token values, one (detached) tensor per sample of `idx`."""
    sizes = [len(batch[i].completion_token_ids) for i in idx]
    return list(torch.split(flat.detach(), sizes))


def gather(per_sample: list[torch.Tensor], idx: Sequence[int]) -> torch.Tensor:
    """Per-sample tensors of `idx`, concatenated in that order."""
    return torch.cat([per_sample[i] for i in idx])


def plain_lm_head(config: Any) -> bool:
    """True when logits are exactly lm_head(hidden) (Llama, Qwen, Mistral, SmolLM ...)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    scalers = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier")
    return all(getattr(text, name, None) in (None, 1.0) for name in scalers)


def mask_for(config: Any, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """sdpa takes the boolean mask as is; eager attention adds a float mask to the scores."""
    if config._attn_implementation == "sdpa":
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
        ~mask, torch.finfo(dtype).min
    )


def score_tokens(
    causal_lm: Any,
    inputs: dict[str, Any],
    index: torch.Tensor,
    targets: torch.Tensor,
    temperature: float | torch.Tensor,
    chunk_tokens: int,
    with_entropy: bool,
    through_head: bool = True,
) -> Scored:
    """One pass of `causal_lm` over `inputs`, scored at the `index` positions.

    With a plain LM head (and `through_head`, false where FSDP must run the root module) only
    the positions that predict completion tokens go through the head, in chunks (see
    `token_logprobs`): the head is a big matmul, and its fp32 logits are the largest tensor of
    the step. Heads with soft-capping or scaling are applied by the model, unchunked."""
    if plain_lm_head(causal_lm.config) and through_head:
        backbone = getattr(causal_lm, causal_lm.base_model_prefix)
        hidden = backbone(**inputs, use_cache=False).last_hidden_state
        hidden = hidden.reshape(-1, hidden.shape[-1])[index]
        head = causal_lm.get_output_embeddings()
    else:
        logits = causal_lm(**inputs, use_cache=False).logits
        hidden = logits.reshape(-1, logits.shape[-1])[index]
        head = None
    return token_logprobs(
        head, hidden, targets, temperature, chunk_tokens, with_entropy=with_entropy
    )


def temperatures(samples: Sequence[Sample], temps: Iterable[float]) -> float | torch.Tensor:
    """The temperature each sample was drawn at, for one micro-batch: one number where all
    agree, else one row per completion token ([tokens, 1], to divide the logits by)."""
    temps = list(temps)
    if len(set(temps)) == 1:
        return temps[0]
    return torch.cat(
        [torch.full((len(s.completion_token_ids), 1), t) for s, t in zip(samples, temps)]
    )
