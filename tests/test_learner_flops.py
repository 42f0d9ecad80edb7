"""What the learner's speed figures rest on: the FLOP count behind learner/mfu, and the
single-pass update (no separate old-log-prob forward) giving the two-pass update's gradients."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_learner import branches, config, make_samples, with_advantages

from masenvs.trainer.learner import learner as learner_module
from masenvs.trainer.learner.flops import forward_flops, linear_params, mfu_metrics
from masenvs.trainer.learner.learner import Learner
from masenvs.trainer.learner.packing import build_microbatch, prompt_units


def _brute_force_pairs(mb: Any) -> tuple[int, int]:
    """(real tokens, attended pairs among them) from the mask a micro-batch hands sdpa."""
    width = mb.input_ids.shape[1]
    tokens = pairs = 0
    for r in range(mb.input_ids.shape[0]):
        # a row's real tokens end at its last scored position; padding follows
        used = max(int(i) % width for i in mb.score_index if int(i) // width == r) + 1
        tokens += used
        pairs += int(mb.attention_mask[r, 0, :used, :used].sum())
    return tokens, pairs


def test_token_and_pair_counts_match_the_attention_mask() -> None:
    samples = branches("coder", 3, 4, seed=31)
    units = prompt_units(samples, share=True)
    mb = build_microbatch(samples, [units[:2], units[2:]])
    assert mb.attention_mask is not None
    assert (mb.tokens, mb.attended) == _brute_force_pairs(mb)
    # the prompt is fed once per unit: fewer tokens than prompt + completion per sample
    assert mb.tokens < sum(s.num_tokens for s in samples)


def test_forward_flops_count_weights_attention_and_the_scored_head(loader: Any) -> None:
    model = loader("tiny", torch.device("cpu"), torch.float32)
    c = model.config
    samples = make_samples("coder", 1, seed=3)
    mb = build_microbatch(samples, [[[0]]])
    p, n = len(samples[0].prompt_token_ids), len(samples[0].completion_token_ids)
    params = linear_params(model)
    per_layer = sum(
        m.weight.numel() for m in model.model.layers[0].modules() if isinstance(m, torch.nn.Linear)
    )
    assert params == per_layer * c.num_hidden_layers  # the LM head is not a decoder weight
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    pairs = p * (p + 1) // 2 + (n - 1) * p + (n - 1) * n // 2
    expected = (
        2 * params * (p + n - 1)
        + 4 * c.num_attention_heads * head_dim * c.num_hidden_layers * pairs
        + 2 * c.hidden_size * c.vocab_size * n
    )
    assert forward_flops(c, params, mb) == expected


def test_an_update_counts_forward_and_backward_once(loader: Any) -> None:
    cfg = config()
    learner = Learner(cfg, ["coder"], loader)
    samples = with_advantages(make_samples("coder", 6, seed=4), cfg)
    before = learner.flops
    learner.logprobs("coder", samples)  # a no-grad pass: forward only
    forward = learner.flops - before
    metrics = learner.step(samples)
    # one optimizer step: no separate old-log-prob pass, so forward + backward = 2 x forward
    assert metrics["learner/gflops"] * 1e9 == pytest.approx(2 * forward)
    assert metrics["learner/gflop_per_s"] > 0


def test_single_step_update_equals_a_separate_old_logprob_pass(
    loader: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With one optimizer step the update's own forward gives pi_old (ratio exactly 1); a
    learner made to run the separate no-grad pass first computes the same loss and gradients."""
    samples = make_samples("coder", 8, seed=5)
    results = []
    for separate in (False, True):
        if separate:  # what the learner does when it cannot trust the update's forward
            monkeypatch.setattr(learner_module, "has_dropout", lambda model: True)
        cfg = config()
        learner = Learner(cfg, ["coder"], loader)
        metrics = learner.step(with_advantages(samples, cfg))
        grads = [p.grad.clone() for p in learner.policies["coder"].params]
        results.append((metrics, grads, learner.flops))
    (one, g_one, f_one), (two, g_two, f_two) = results
    assert one["learner/coder/ratio_mean"] == 1.0
    assert two["learner/coder/ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert one["learner/coder/loss"] == pytest.approx(two["learner/coder/loss"], rel=1e-6)
    for a, b in zip(g_one, g_two, strict=True):
        assert torch.allclose(a, b, atol=1e-8, rtol=1e-5)
    assert f_two == pytest.approx(1.5 * f_one)  # the separate pass is one forward more


def test_mfu_is_the_updates_flop_rate_over_a_matmuls_timed_after_it(loader: Any) -> None:
    cfg = config()
    learner = Learner(cfg, ["coder"], loader)
    update = learner.step(with_advantages(make_samples("coder", 6, seed=6), cfg))
    assert update["learner/cpu_s"] > 0
    out = mfu_metrics(update)
    peak = out["learner/matmul_gflop_per_s"]
    assert peak > 0
    assert out["learner/mfu"] == pytest.approx(update["learner/gflop_per_s"] / peak)
    assert 0 < out["learner/mfu_cpu"] < 10  # a ratio of FLOP per CPU second, not a raw rate
