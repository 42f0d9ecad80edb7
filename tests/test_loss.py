"""The PPO-clip loss on hand-computed tokens: both clip sides, dual clip, KL, token mean; and
a hand-computed batch through group_advantages and Learner.step, with injected bugs caught."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch

from masenvs.trainer.atgrpo import LossSums, group_advantages, policy_loss
from masenvs.trainer.config import load_config
from masenvs.trainer.learner import scoring as scoring_module
from masenvs.trainer.learner.learner import Learner
from masenvs.trainer.samples import Sample, tree_group
from masenvs.trainer.update_config import AlgorithmConfig


def tokens(ratios: list[float], advantages: list[float]) -> tuple[torch.Tensor, ...]:
    """log-probs with the given ratio to old log-probs of -1.0 (with grad), and advantages."""
    old = torch.full((len(ratios),), -1.0, dtype=torch.float64)
    logp = (old + torch.tensor(ratios, dtype=torch.float64).log()).requires_grad_(True)
    return logp, old, torch.tensor(advantages, dtype=torch.float64)


def per_token_grad(logp: torch.Tensor, loss: torch.Tensor) -> list[float]:
    (grad,) = torch.autograd.grad(loss, logp)
    return grad.tolist()


def test_on_policy_loss_is_minus_mean_advantage() -> None:
    logp, old, adv = tokens([1.0, 1.0, 1.0], [1.0, -2.0, 0.5])
    loss, sums = policy_loss(logp, old, adv, num_tokens=3, cfg=AlgorithmConfig())
    assert loss.item() == pytest.approx(-(1.0 - 2.0 + 0.5) / 3)
    # d/dlogp of -A * exp(logp - old) at ratio 1 is -A; token mean divides by 3.
    assert per_token_grad(logp, loss) == pytest.approx([-1 / 3, 2 / 3, -0.5 / 3])
    assert sums.ratio == pytest.approx(3.0) and sums.approx_kl_old == pytest.approx(0.0)


def test_clipping_on_both_sides_with_asymmetric_bounds() -> None:
    cfg = AlgorithmConfig(clip_low=0.2, clip_high=0.28, clip_c=None)
    # token: (ratio, advantage) -> per-token loss -min(r A, clip(r) A)
    cases = [
        (1.5, 1.0, -1.28, "high"),  # pushed up past 1 + 0.28: clipped, no gradient
        (0.5, 1.0, -0.5, None),  # A > 0 but ratio fell: unclipped, gradient restores it
        (0.5, -1.0, 0.8, "low"),  # pushed down past 1 - 0.2: clipped, no gradient
        (1.5, -1.0, 1.5, None),  # A < 0 but ratio rose: unclipped (pessimistic bound)
        (1.1, 1.0, -1.1, None),  # inside the trust region
    ]
    logp, old, adv = tokens([c[0] for c in cases], [c[1] for c in cases])
    loss, sums = policy_loss(logp, old, adv, num_tokens=len(cases), cfg=cfg)
    assert loss.item() == pytest.approx(sum(c[2] for c in cases) / len(cases))
    grad = per_token_grad(logp, loss)
    for (ratio, a, _, clipped), g in zip(cases, grad, strict=True):
        expected = 0.0 if clipped else -a * ratio / len(cases)
        assert g == pytest.approx(expected), (ratio, a)
    assert sums.clipped_high == 1 and sums.clipped_low == 1 and sums.dual_clipped == 0


def test_dual_clip_bounds_the_loss_of_negative_advantages() -> None:
    cfg = AlgorithmConfig(clip_c=3.0)
    # ratio 5 with A = -2: PPO loss 5 * 2 = 10, dual clip caps it at c * |A| = 6 (no gradient).
    # ratio 2 with A = -2: loss 4 < 6, untouched. ratio 5 with A = +2: dual clip never applies.
    logp, old, adv = tokens([5.0, 2.0, 5.0], [-2.0, -2.0, 2.0])
    loss, sums = policy_loss(logp, old, adv, num_tokens=3, cfg=cfg)
    assert loss.item() == pytest.approx((6.0 + 4.0 - 1.2 * 2.0) / 3)
    assert per_token_grad(logp, loss) == pytest.approx([0.0, 2.0 * 2.0 / 3, 0.0])
    assert sums.dual_clipped == 1

    off, _ = policy_loss(logp, old, adv, num_tokens=3, cfg=AlgorithmConfig(clip_c=None))
    assert off.item() == pytest.approx((10.0 + 4.0 - 1.2 * 2.0) / 3)


def test_token_mean_weighs_tokens_not_sequences() -> None:
    # Sequence one: 1 token with A=+3; sequence two: 3 tokens with A=-1. On policy (ratio 1),
    # the token mean is -(3 - 1 - 1 - 1) / 4 = 0, while a mean of sequence means would be -1.
    logp, old, adv = tokens([1.0] * 4, [3.0, -1.0, -1.0, -1.0])
    loss, _ = policy_loss(logp, old, adv, num_tokens=4, cfg=AlgorithmConfig())
    assert loss.item() == pytest.approx(0.0)


def test_micro_batch_split_equals_full_batch() -> None:
    gen = torch.Generator().manual_seed(0)
    n = 37
    ratios = (torch.rand(n, generator=gen, dtype=torch.float64) * 1.6 + 0.2).tolist()
    advs = torch.randn(n, generator=gen, dtype=torch.float64).tolist()
    cfg = AlgorithmConfig(clip_high=0.28, kl_coef=0.05)
    ref = torch.randn(n, generator=gen, dtype=torch.float64) * 0.1 - 1.0

    logp, old, adv = tokens(ratios, advs)
    full, full_sums = policy_loss(logp, old, adv, n, cfg, ref_logprobs=ref)
    full_grad = per_token_grad(logp, full)

    logp2, _, _ = tokens(ratios, advs)
    total = torch.zeros((), dtype=torch.float64)
    split_sums = LossSums()
    for lo, hi in [(0, 5), (5, 6), (6, 30), (30, n)]:  # uneven micro-batches
        part, part_sums = policy_loss(
            logp2[lo:hi], old[lo:hi], adv[lo:hi], n, cfg, ref_logprobs=ref[lo:hi]
        )
        total = total + part
        split_sums.add(part_sums)
    assert total.item() == pytest.approx(full.item(), abs=1e-12)
    assert per_token_grad(logp2, total) == pytest.approx(full_grad, abs=1e-12)
    assert split_sums.means() == pytest.approx(full_sums.means())


def test_k3_kl_to_the_base_model() -> None:
    cfg = AlgorithmConfig(kl_coef=0.1)
    logp, old, adv = tokens([1.0, 1.0], [0.0, 0.0])
    same = logp.detach().clone()
    loss, sums = policy_loss(logp, old, adv, 2, cfg, ref_logprobs=same)
    assert loss.item() == 0.0 and sums.kl_ref == 0.0  # identical policies: KL exactly 0

    # ref twice as likely as the policy on both tokens: k3 = 2 - ln 2 - 1 per token
    ref = logp.detach() + math.log(2.0)
    loss, sums = policy_loss(logp, old, adv, 2, cfg, ref_logprobs=ref)
    k3 = 2.0 - math.log(2.0) - 1.0
    assert sums.kl_ref == pytest.approx(2 * k3)
    assert loss.item() == pytest.approx(0.1 * k3)
    # d k3 / d logp = 1 - exp(ref - logp) = -1 per token: raising logp towards ref lowers KL
    assert per_token_grad(logp, loss) == pytest.approx([0.1 * -1.0 / 2] * 2)


def test_kl_without_reference_log_probs_is_an_error() -> None:
    logp, old, adv = tokens([1.0], [1.0])
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(logp, old, adv, 1, AlgorithmConfig(kl_coef=0.1))


def test_metrics_are_token_means() -> None:
    logp, old, adv = tokens([2.0, 1.0], [1.0, 1.0])
    _, sums = policy_loss(logp, old, adv, 2, AlgorithmConfig())
    m = sums.means()
    assert m["ratio_mean"] == pytest.approx(1.5)
    assert m["ratio_max"] == pytest.approx(2.0)
    assert m["clip_frac_high"] == pytest.approx(0.5)
    # k3 of KL(old || new) on the first token: (r - 1) - ln r
    assert m["approx_kl"] == pytest.approx(((2.0 - 1.0) - math.log(2.0)) / 2)


# -- a hand-computed batch through group_advantages and Learner.step (the RL sanity suite) -----


def hand_batch() -> tuple[list[Sample], list[float]]:
    """Two groups with hand-computed advantages (population std, eps 1e-6).

    Group a, rewards [1, 0]: mean 0.5, std 0.5, A = [+1, -1].
    Group b, rewards [3, 1, 2]: mean 2, std sqrt(2/3), A = [+1.2247, -1.2247, 0].
    """
    a, b = tree_group("a", 0, "coder"), tree_group("b", 0, "coder")
    rows = [  # (prompt, completion, group, reward)
        ([5, 6, 7], [11, 12], a, 1.0),
        ([5, 6, 7], [13, 14, 15], a, 0.0),
        ([8, 9], [21], b, 3.0),
        ([8, 9], [22, 23], b, 1.0),
        ([8, 9], [24, 25, 26, 27], b, 2.0),
    ]
    samples = [Sample(p, c, [], "coder", "coder", g, r) for p, c, g, r in rows]
    s = math.sqrt(2 / 3)
    expected = [0.5 / (0.5 + 1e-6), -0.5 / (0.5 + 1e-6), 1 / (s + 1e-6), -1 / (s + 1e-6), 0.0]
    return samples, expected


def update_problems(learner: Learner, samples: list[Sample]) -> list[str]:
    """Check one update against the hand computation; returns what disagrees (empty: sound).

    On policy (one optimizer step) every ratio is 1, so the token-mean loss is
    -sum(A_i * len_i) / sum(len_i), and a small step must raise sum(A_i * log pi(y_i)).
    """
    batch, _ = group_advantages(samples, AlgorithmConfig())
    _, expected = hand_batch()
    problems = []
    got = [s.advantage for s in batch]
    if got != pytest.approx(expected, abs=1e-9):
        problems.append(f"advantages {got} != {expected}")
    lengths = [len(s.completion_token_ids) for s in batch]
    loss = -sum(a * n for a, n in zip(expected, lengths, strict=True)) / sum(lengths)
    before = learner.logprobs("coder", batch)
    metrics = learner.step(batch)
    after = learner.logprobs("coder", batch)
    if metrics["learner/coder/pg_loss"] != pytest.approx(loss, abs=1e-5):
        problems.append(f"pg_loss {metrics['learner/coder/pg_loss']} != {loss}")
    if metrics["learner/coder/ratio_mean"] != pytest.approx(1.0, abs=1e-6):
        problems.append(f"on-policy ratio {metrics['learner/coder/ratio_mean']} != 1")
    gain = sum(
        s.advantage * (new.sum() - old.sum()).item()
        for s, old, new in zip(batch, before, after, strict=True)
    )
    if gain <= 0:
        problems.append(f"the step lowered sum(A * log pi) by {-gain}")
    return problems


def hand_learner(loader: Any) -> Learner:
    cfg = load_config(
        None, ["model.name=tiny", "lora.rank=4", "optim.lr=1e-3", "optim.warmup_steps=0"]
    )
    return Learner(cfg, ["coder"], loader)


@pytest.mark.learning
def test_a_hand_computed_batch_gets_the_hand_computed_update(loader: Any) -> None:
    samples, _ = hand_batch()
    learner = hand_learner(loader)
    before = learner.adapter_state_dict("coder")
    assert update_problems(learner, samples) == []
    # learner/<policy>/update_norm is how far the adapter moved in this step
    after = learner.adapter_state_dict("coder")
    moved = math.sqrt(sum(float((after[k] - before[k]).pow(2).sum()) for k in before))
    metrics = learner.step(group_advantages(samples, AlgorithmConfig())[0])
    assert moved > 0 and metrics["learner/coder/update_norm"] > 0
    assert metrics["learner/coder/update_rel"] == pytest.approx(
        metrics["learner/coder/update_norm"]
        / math.sqrt(sum(float(v.pow(2).sum()) for v in after.values())),
        rel=1e-4,
    )


def test_a_flipped_sign_in_the_loss_is_caught(loader: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    def flipped(logprobs: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, *a: Any, **k: Any):
        return policy_loss(logprobs, old, -adv, *a, **k)

    monkeypatch.setattr(scoring_module, "policy_loss", flipped)
    samples, _ = hand_batch()
    problems = update_problems(hand_learner(loader), samples)
    assert any("pg_loss" in p for p in problems) and any("lowered" in p for p in problems)


def test_advantages_that_ignore_the_group_are_caught(loader: Any) -> None:
    # A classic bug: one baseline for the whole batch instead of one per (task, turn, agent).
    samples, _ = hand_batch()
    merged = [dataclasses.replace(s, group=("all",)) for s in samples]
    problems = update_problems(hand_learner(loader), merged)
    assert any("advantages" in p for p in problems)
