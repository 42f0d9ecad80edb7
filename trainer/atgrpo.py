"""AT-GRPO (Stronger-MAS, arXiv:2510.11062): group-relative advantages and the PPO-clip loss.

Read top to bottom:

1. `group_advantages`: samples are grouped by their key, (task, round, agent) for tree
   rollouts, and each reward is normalised inside its group:

       A_i = (r_i - mean(r_g)) / (std(r_g) + eps)

2. `policy_loss`: token-level PPO-clip with an asymmetric clip range, an optional dual clip
   and an optional k3 KL penalty to the base model, summed over tokens and divided by the
   number of completion tokens in the whole optimizer step (token mean).
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from dataclasses import dataclass, field, replace

import torch

from masenvs.trainer.samples import GroupKey, Sample
from masenvs.trainer.update_config import AlgorithmConfig

# ---------------------------------------------------------------------------------------------
# 1. Advantages
# ---------------------------------------------------------------------------------------------


@dataclass
class GroupStats:
    """What happened to the groups of one batch (logged every step)."""

    groups: int = 0  # groups in the batch
    kept: int = 0  # groups that train
    singleton: int = 0  # groups of one sample (no baseline: advantage 0)
    zero_std: int = 0  # groups whose rewards are all equal, singletons included (advantage 0)
    samples_kept: int = 0


def group_advantages(
    samples: list[Sample], cfg: AlgorithmConfig
) -> tuple[list[Sample], GroupStats]:
    """Advantages of every sample of the kept groups; returns new samples with `advantage` set.

    - A group of one sample has no baseline: its advantage is 0 (r - mean = 0).
    - A group of equal rewards has std 0 and advantage 0 for every member.
    - std is the population std (divide by n): every group's advantages then have unit RMS
      whatever its size, so groups of 2 and of 8 weigh alike. `cfg.unbiased_std` switches to
      the sample std (n - 1, as VERL and TRL), which shrinks small groups by sqrt((n-1)/n).
    - `cfg.scale_by_std` False keeps r - mean (Dr. GRPO): groups then weigh by their spread.
    - Filters: `drop_zero_std_groups`, then `keep_top_groups` (a fraction of each policy's
      groups, ranked by reward std or mean); neither changes the advantages of the groups
      that stay.
    """
    groups: dict[GroupKey, list[int]] = defaultdict(list)
    for i, s in enumerate(samples):
        groups[s.group].append(i)

    stats = GroupStats(groups=len(groups))
    mean: dict[GroupKey, float] = {}
    std: dict[GroupKey, float] = {}
    flat: dict[GroupKey, bool] = {}  # all rewards equal (singletons included): advantage 0
    for key, members in groups.items():
        policies = {samples[i].policy for i in members}
        if len(policies) > 1:
            raise ValueError(
                f"group {key!r} mixes policies {sorted(policies)}; a group's samples must come "
                "from one agent's policy (key groups by agent)"
            )
        r = [samples[i].reward for i in members]
        mean[key] = statistics.fmean(r)
        std[key] = statistics.stdev(r) if cfg.unbiased_std and len(r) > 1 else statistics.pstdev(r)
        flat[key] = all(x == r[0] for x in r)
        stats.singleton += len(r) == 1
        stats.zero_std += flat[key]

    kept = list(groups)  # order of first appearance, so ties break deterministically
    if cfg.drop_zero_std_groups:
        kept = [k for k in kept if not flat[k]]
    if cfg.keep_top_groups < 1.0 and kept:
        # Each policy's groups are ranked among themselves, as the authors filter each
        # model's batch: one role's higher rewards do not crowd out another's groups.
        score = std if cfg.keep_top_by == "std" else mean
        by_policy: dict[str, list[GroupKey]] = defaultdict(list)
        for k in kept:
            by_policy[samples[groups[k][0]].policy].append(k)
        top: set[GroupKey] = set()
        for keys in by_policy.values():
            n_keep = math.ceil(cfg.keep_top_groups * len(keys))
            top.update(sorted(keys, key=lambda k: -score[k])[:n_keep])  # stable sort
        kept = [k for k in kept if k in top]

    out: list[Sample] = []
    for key in kept:
        for i in groups[key]:
            s = samples[i]
            # Exactly 0 for flat groups: float rounding in the mean must not leak through 1/eps.
            scale = std[key] + cfg.adv_eps if cfg.scale_by_std else 1.0
            advantage = 0.0 if flat[key] else (s.reward - mean[key]) / scale
            out.append(replace(s, advantage=advantage))
    stats.kept = len(kept)
    stats.samples_kept = len(out)
    return out, stats


# ---------------------------------------------------------------------------------------------
# 2. Loss
# ---------------------------------------------------------------------------------------------


# LossSums fields that add across micro-batches (ratio_max takes the max instead).
SUMMED = (
    "pg_loss",
    "kl_ref",
    "ratio",
    "approx_kl_old",
    "clipped_low",
    "clipped_high",
    "dual_clipped",
)


@dataclass
class LossSums:
    """Token sums of the loss terms; micro-batches add up, `means()` divides by `tokens`."""

    tokens: int = 0
    pg_loss: float = 0.0  # sum of the clipped policy-gradient loss
    kl_ref: float = 0.0  # sum of k3 KL to the base model (when kl_coef > 0)
    ratio: float = 0.0  # sum of pi_theta / pi_old
    ratio_max: float = 0.0
    approx_kl_old: float = 0.0  # sum of k3 KL(pi_old || pi_theta): how far this update moved
    clipped_low: float = 0.0  # A < 0 and ratio < 1 - clip_low: no gradient pushes it lower
    clipped_high: float = 0.0  # A > 0 and ratio > 1 + clip_high: no gradient pushes it higher
    dual_clipped: float = 0.0  # A < 0 and the loss hit the dual-clip bound -c * A
    extra: dict[str, float] = field(default_factory=dict)  # other token sums (entropy, ...)

    def add(self, other: LossSums) -> None:
        self.tokens += other.tokens
        for name in SUMMED:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.ratio_max = max(self.ratio_max, other.ratio_max)
        for k, v in other.extra.items():
            self.extra[k] = self.extra.get(k, 0.0) + v

    def means(self) -> dict[str, float]:
        n = max(self.tokens, 1)
        out = {
            "pg_loss": self.pg_loss / n,
            "kl_ref": self.kl_ref / n,
            "ratio_mean": self.ratio / n,
            "ratio_max": self.ratio_max,
            "approx_kl": self.approx_kl_old / n,
            "clip_frac_low": self.clipped_low / n,
            "clip_frac_high": self.clipped_high / n,
            "dual_clip_frac": self.dual_clipped / n,
            "tokens": float(self.tokens),
        }
        out.update({k: v / n for k, v in self.extra.items()})
        return out


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    num_tokens: int,
    cfg: AlgorithmConfig,
    ref_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossSums]:
    """PPO-clip loss of some completion tokens, as their share of a token mean over `num_tokens`.

    All tensors are flat, one entry per completion token: `logprobs` of the policy being
    trained (with grad), `old_logprobs` of the policy before this update, `advantages` of the
    token's sample. Calling this once per micro-batch with the same `num_tokens` (the
    completion tokens of the whole optimizer step) and summing the results gives exactly the
    full-batch token mean, however the tokens are split.
    """
    # r_t = pi_theta(y_t | ...) / pi_old(y_t | ...)
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)

    # PPO-clip with separate bounds: L_t = -min(r_t A, clip(r_t, 1 - eps_low, 1 + eps_high) A)
    clipped_ratio = torch.clamp(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    pg = torch.maximum(-advantages * ratio, -advantages * clipped_ratio)

    # Dual clip (Ye et al. 2020): when A < 0, L_t <= -c A, i.e. the objective is bounded below.
    dual = torch.zeros_like(pg, dtype=torch.bool)
    if cfg.clip_c is not None:
        bound = -advantages * cfg.clip_c
        dual = (advantages < 0) & (pg > bound)
        pg = torch.where(advantages < 0, torch.minimum(pg, bound), pg)

    per_token = pg
    # k3 estimator of KL(pi_theta || pi_ref), unbiased and always >= 0 (Schulman 2020):
    # kl_t = exp(ref - logp) - (ref - logp) - 1
    kl = None
    if cfg.kl_coef > 0.0:
        if ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs (the base model's log-probs)")
        delta = ref_logprobs - logprobs
        kl = torch.exp(delta) - delta - 1.0
        per_token = per_token + cfg.kl_coef * kl

    # Token mean over the optimizer step: every completion token weighs 1 / num_tokens.
    loss = per_token.sum() / max(num_tokens, 1)

    with torch.no_grad():  # one device sync for all metrics
        zero = pg.new_zeros(())
        values = torch.stack(
            [
                pg.sum(),
                kl.sum() if kl is not None else zero,
                ratio.sum(),
                ((ratio - 1.0) - log_ratio).sum(),  # k3 of KL(pi_old || pi_theta)
                ((advantages < 0) & (ratio < 1.0 - cfg.clip_low)).sum().to(pg.dtype),
                ((advantages > 0) & (ratio > 1.0 + cfg.clip_high)).sum().to(pg.dtype),
                dual.sum().to(pg.dtype),
                ratio.max() if ratio.numel() else zero,
            ]
        ).tolist()
    sums = LossSums(tokens=int(logprobs.numel()), ratio_max=values.pop())
    for name, value in zip(SUMMED, values, strict=True):
        setattr(sums, name, value)
    return loss, sums
