"""The learner on the tiny Llama: packing, log-probs, per-agent isolation, KL, adapter export."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file

from masenvs.trainer.atgrpo import group_advantages
from masenvs.trainer.config import TrainConfig, load_config
from masenvs.trainer.learner.learner import Learner
from masenvs.trainer.learner.packing import build_microbatch, plan_microbatches, prompt_units
from masenvs.trainer.samples import Sample, tree_group

VOCAB = 49152


def config(*overrides: str) -> TrainConfig:
    base = ["model.name=tiny", "lora.rank=4", "lora.alpha=8", "optim.warmup_steps=0"]
    base += ["optim.lr=1e-2", "steps=10"]
    return load_config(None, base + list(overrides))


def make_samples(agent: str, n: int, seed: int, task: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for k in range(n):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(2, 24))]
        completion = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 16))]
        out.append(
            Sample(prompt, completion, [], agent, agent, tree_group(task, 0, agent), float(k % 3))
        )
    return out


def with_advantages(samples: list[Sample], cfg: TrainConfig) -> list[Sample]:
    return group_advantages(samples, cfg.algorithm)[0]


def direct_logprobs(model: Any, s: Sample) -> torch.Tensor:
    """Reference: one unpacked forward of prompt + completion through the whole model."""
    ids = torch.tensor([s.prompt_token_ids + s.completion_token_ids])
    logp = model(input_ids=ids).logits[0].float().log_softmax(-1)
    p = len(s.prompt_token_ids)
    return logp[p - 1 : -1].gather(-1, torch.tensor(s.completion_token_ids)[:, None])[:, 0]


def snapshot(learner: Learner, policy: str) -> dict[str, torch.Tensor]:
    return learner.adapter_state_dict(policy)


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# -- packing ------------------------------------------------------------------------------------


def test_plan_microbatches_packs_every_sequence_once_within_budget() -> None:
    lengths = [30, 5, 12, 30, 7, 25, 1, 18, 9, 3]
    plan = plan_microbatches(lengths, max_tokens=64)
    placed = sorted(i for mb in plan for row in mb for i in row)
    assert placed == list(range(len(lengths)))
    width = max(lengths)
    for mb in plan:
        assert len(mb) * width <= 64
        assert all(sum(lengths[i] for i in row) <= width for row in mb)
    assert any(len(row) > 1 for mb in plan for row in mb)  # short ones share rows
    assert plan_microbatches([100], max_tokens=16) == [[[0]]]  # too long: alone


def test_packed_rows_lay_out_positions_and_targets() -> None:
    samples = make_samples("coder", 6, seed=1)
    mb = build_microbatch(samples, [[[0], [1], [2]], [[3], [4], [5]]])  # no shared prompt
    assert mb.samples == [0, 1, 2, 3, 4, 5]
    lengths = [s.num_tokens - 1 for s in samples]  # prompt + completion[:-1]
    width = max(sum(lengths[:3]), sum(lengths[3:]))
    assert mb.input_ids.shape == (2, width)
    for r, row in enumerate([[0, 1, 2], [3, 4, 5]]):
        used = sum(lengths[i] for i in row)
        # positions restart at 0 for every sequence and for the padding after them
        expected = [p for i in row for p in range(lengths[i])] + list(range(width - used))
        assert mb.position_ids[r].tolist() == expected
    assert mb.attention_mask is None  # position ids are enough
    assert mb.targets.tolist() == [t for s in samples for t in s.completion_token_ids]
    # each scored position's next input token is the target, except a sequence's last token
    flat = mb.input_ids.flatten()
    k = 0
    for s in samples:
        for j, target in enumerate(s.completion_token_ids):
            if j < len(s.completion_token_ids) - 1:
                assert flat[mb.score_index[k] + 1].item() == target
            k += 1


def branches(agent: str, n_prompts: int, k: int, seed: int) -> list[Sample]:
    """K completions per prompt, as a tree node's K branches."""
    rng = random.Random(seed)
    out = []
    for t in range(n_prompts):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(3, 30))]
        for b in range(k):
            completion = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 12))]
            group = tree_group(t, 0, agent)
            out.append(Sample(prompt, completion, [], agent, agent, group, float((b * 7 + t) % 3)))
    return out


def test_shared_prompt_layout_masks_sibling_completions() -> None:
    samples = branches("coder", 1, 3, seed=20)
    units = prompt_units(samples, share=True)
    assert units == [[0, 1, 2]]
    mb = build_microbatch(samples, [units])
    p = len(samples[0].prompt_token_ids)
    mask = mb.attention_mask[0, 0]
    c0 = len(samples[0].completion_token_ids) - 1
    first, second = p, p + c0  # where completions 0 and 1 start
    assert mask[first:second, :p].all()  # completion 0 sees the whole prompt
    assert not mask[second:, first:second].any()  # completion 1+ never sees completion 0
    assert mb.position_ids[0, second].item() == p  # and continues the prompt's positions
    assert mb.score_index.tolist().count(p - 1) == 3  # one prompt position predicts 3 firsts


# -- log-probs ----------------------------------------------------------------------------------


def test_recomputed_logprobs_equal_the_models_logprobs(loader: Any) -> None:
    learner = Learner(config("optim.max_tokens_per_microbatch=48"), ["coder"], loader)
    samples = make_samples("coder", 9, seed=2)
    plan = plan_microbatches([s.num_tokens - 1 for s in samples], 48)
    assert len(plan) > 1 and any(len(row) > 1 for mb in plan for row in mb)  # packing is exercised
    got = learner.logprobs("coder", samples)
    model = learner.policies["coder"].model
    with torch.no_grad():
        for s, lp in zip(samples, got, strict=True):
            assert torch.allclose(lp, direct_logprobs(model, s), atol=1e-5)


def test_shared_prompts_give_the_same_logprobs_and_gradients(loader: Any) -> None:
    samples = branches("coder", 3, 4, seed=21)
    grads = {}
    for share in (True, False):
        cfg = config(
            f"optim.share_prompts={str(share).lower()}", "optim.max_tokens_per_microbatch=80"
        )
        learner = Learner(cfg, ["coder"], loader)
        assert learner.policies["coder"].share_prompts is share
        model = learner.policies["coder"].model
        with torch.no_grad():
            for s, lp in zip(samples, learner.logprobs("coder", samples), strict=True):
                assert torch.allclose(lp, direct_logprobs(model, s), atol=1e-5)
        learner.step(with_advantages(samples, cfg))
        grads[share] = [p.grad.clone() for p in learner.policies["coder"].params]
    for a, b in zip(grads[True], grads[False], strict=True):
        assert torch.allclose(a, b, atol=1e-7, rtol=1e-4)


def test_adapter_starts_as_the_base_model_so_kl_is_zero(loader: Any) -> None:
    cfg = config("algorithm.kl_coef=0.1")
    learner = Learner(cfg, ["coder"], loader)
    samples = make_samples("coder", 6, seed=3)
    policy_lp = learner.logprobs("coder", samples)
    base_lp = learner.logprobs("coder", samples, base=True)
    for a, b in zip(policy_lp, base_lp, strict=True):
        assert torch.equal(a, b)  # LoRA B starts at 0: adapter output == base output
    metrics = learner.step(with_advantages(samples, cfg))
    assert metrics["learner/coder/kl_ref"] == 0.0
    after = learner.logprobs("coder", samples, base=True)
    assert all(torch.equal(a, b) for a, b in zip(after, base_lp, strict=True))  # base untouched
    assert not all(
        torch.equal(a, b) for a, b in zip(learner.logprobs("coder", samples), base_lp, strict=True)
    )


def test_backend_logprob_mismatch_is_measured(loader: Any) -> None:
    learner = Learner(config(), ["coder"], loader)
    samples = make_samples("coder", 4, seed=4)
    true = learner.logprobs("coder", samples)
    for s, lp in zip(samples, true, strict=True):
        s.behavior_logprobs = (lp + 0.25).tolist()
    samples[0].behavior_logprobs[0] -= 1.0  # one token off by 0.75
    metrics = learner.step(with_advantages(samples, learner.cfg))
    n = sum(len(s.completion_token_ids) for s in samples)
    assert metrics["learner/coder/logprob_diff_mean"] == pytest.approx((0.25 * (n - 1) + 0.75) / n)
    assert metrics["learner/coder/logprob_diff_max"] == pytest.approx(0.75)


# -- updates ------------------------------------------------------------------------------------


def test_per_agent_step_changes_only_that_agents_adapter(loader: Any) -> None:
    cfg = config("policy.mode=per_agent")
    learner = Learner(cfg, ["coder", "tester"], loader)
    assert learner.policies["coder"].model is learner.policies["tester"].model  # one base
    coder0, tester0 = snapshot(learner, "coder"), snapshot(learner, "tester")
    base0 = {
        k: v.clone()
        for k, v in learner.policies["coder"].model.named_parameters()
        if "lora_" not in k
    }

    metrics = learner.step(with_advantages(make_samples("coder", 6, seed=5), cfg))
    assert "learner/coder/loss" in metrics and "learner/tester/loss" not in metrics
    assert not same(snapshot(learner, "coder"), coder0)
    assert same(snapshot(learner, "tester"), tester0)
    assert learner.policies["tester"].optimizer.state == {}  # never stepped
    for k, v in learner.policies["coder"].model.named_parameters():
        if "lora_" not in k:
            assert torch.equal(v, base0[k]), k  # the base model is frozen

    tester1 = with_advantages(make_samples("tester", 6, seed=6), cfg)
    coder1 = snapshot(learner, "coder")
    learner.step(tester1)
    assert same(snapshot(learner, "coder"), coder1)
    assert not same(snapshot(learner, "tester"), tester0)


def test_shared_mode_trains_one_adapter_on_every_agent(loader: Any) -> None:
    cfg = config("policy.mode=shared")
    learner = Learner(cfg, ["coder", "tester"], loader)
    assert list(learner.policies) == ["shared"] and learner.policy_of("tester") == "shared"
    samples = make_samples("coder", 4, seed=7) + make_samples("tester", 4, seed=8)
    for s in samples:
        s.policy = "shared"
    metrics = learner.step(with_advantages(samples, cfg))
    assert metrics["learner/shared/samples"] == 8.0


def test_separate_mode_has_one_model_per_agent(loader: Any) -> None:
    cfg = config("policy.mode=separate")
    learner = Learner(cfg, ["coder", "tester"], loader)
    assert learner.policies["coder"].model is not learner.policies["tester"].model
    tester0 = snapshot(learner, "tester")
    learner.step(with_advantages(make_samples("coder", 4, seed=9), cfg))
    assert same(snapshot(learner, "tester"), tester0)


def test_micro_batch_size_does_not_change_the_update(loader: Any) -> None:
    samples = make_samples("coder", 10, seed=10)
    results = []
    for budget in (16, 4096):  # many micro-batches vs one
        cfg = config(f"optim.max_tokens_per_microbatch={budget}")
        learner = Learner(cfg, ["coder"], loader)
        metrics = learner.step(with_advantages(samples, cfg))
        # Compare the accumulated gradients: Adam's first step is ~lr * sign(grad), which
        # would amplify rounding noise on near-zero entries.
        grads = [p.grad.clone() for p in learner.policies["coder"].params]
        results.append((grads, metrics))
    (small, m_small), (big, m_big) = results
    for a, b in zip(small, big, strict=True):
        assert torch.allclose(a, b, atol=1e-7, rtol=1e-4)
    assert m_small["learner/coder/loss"] == pytest.approx(m_big["learner/coder/loss"], rel=1e-5)
    assert m_small["learner/coder/grad_norm"] == pytest.approx(
        m_big["learner/coder/grad_norm"], rel=1e-5
    )


@pytest.mark.learning
def test_positive_advantage_raises_the_completions_probability(loader: Any) -> None:
    cfg = config("optim.lr=5e-3", "optim.grad_clip=null")
    learner = Learner(cfg, ["coder"], loader)
    good, bad = make_samples("coder", 2, seed=11)
    good.reward, bad.reward = 1.0, 0.0
    good.group = bad.group = tree_group(0, 0, "coder")
    batch = with_advantages([good, bad], cfg)
    before = [lp.sum().item() for lp in learner.logprobs("coder", [good, bad])]
    for _ in range(3):
        learner.step(batch)
    after = [lp.sum().item() for lp in learner.logprobs("coder", [good, bad])]
    assert after[0] > before[0] and after[1] < before[1]


def test_several_ppo_epochs_and_mini_batches_move_the_ratio(loader: Any) -> None:
    cfg = config("algorithm.ppo_epochs=2", "algorithm.mini_batches=2", "optim.lr=5e-3")
    learner = Learner(cfg, ["coder"], loader)
    metrics = learner.step(with_advantages(make_samples("coder", 8, seed=12), cfg))
    # The first mini-batch runs at pi_old; the next three see moved weights.
    assert metrics["learner/coder/approx_kl"] > 0.0
    assert metrics["learner/coder/ratio_mean"] != 1.0


def test_lr_schedule_warms_up_then_decays_to_the_floor() -> None:
    opt = load_config(
        None, ["optim.lr=1.0", "optim.warmup_steps=4", "optim.min_lr_ratio=0.1"]
    ).optim
    assert [opt.lr_at(s, 20) for s in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert opt.lr_at(4, 20) == pytest.approx(1.0)
    assert opt.lr_at(12, 20) == pytest.approx(0.55)  # halfway through the cosine
    assert opt.lr_at(20, 20) == pytest.approx(0.1)
    assert opt.lr_at(500, 20) == pytest.approx(0.1)


def test_bad_input_fails_clearly(loader: Any) -> None:
    learner = Learner(config(), ["coder"], loader)
    samples = make_samples("coder", 2, seed=13)
    with pytest.raises(ValueError, match="group_advantages"):
        learner.step(samples)
    samples = with_advantages(samples, learner.cfg)
    samples[0].policy = "nobody"
    with pytest.raises(KeyError, match="unknown policy 'nobody'"):
        learner.step(samples)
    with pytest.raises(ValueError, match="not in this env's agents"):
        Learner(config("policy.mode=separate", "policy.models={ghost: tiny}"), ["coder"], loader)


# -- adapter export -----------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")  # peft
def test_saved_adapter_loads_in_peft_with_identical_outputs(loader: Any, tmp_path: Any) -> None:
    cfg = config("policy.mode=per_agent")
    learner = Learner(cfg, ["coder", "tester"], loader)
    learner.step(with_advantages(make_samples("tester", 6, seed=14), cfg))
    out = learner.save_adapter("tester", tmp_path / "tester")

    assert sorted(p.name for p in out.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    conf = json.loads((out / "adapter_config.json").read_text())
    assert (conf["r"], conf["lora_alpha"], conf["bias"], conf["peft_type"]) == (
        4,
        8,
        "none",
        "LORA",
    )
    assert conf["target_modules"] == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    weights = load_file(str(out / "adapter_model.safetensors"))
    assert weights.keys() == learner.adapter_state_dict("tester").keys()
    assert all(k.startswith("base_model.model.") and ".tester." not in k for k in weights)

    fresh = loader("tiny", torch.device("cpu"), torch.float32)
    served = PeftModel.from_pretrained(fresh, str(out)).eval()
    ids = torch.tensor([[5, 17, 300, 4000, 9]])
    model = learner.policies["tester"].model
    model.set_adapter("tester")
    with torch.no_grad():
        assert torch.allclose(served(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-5)

    # and back into a learner
    other = Learner(cfg, ["coder", "tester"], loader)
    other.load_adapter("tester", out)
    assert same(other.adapter_state_dict("tester"), learner.adapter_state_dict("tester"))


def test_mini_batch_size_sets_the_optimizer_steps_like_ppo_mini_batch_size(loader: Any) -> None:
    # The ref's VERL actor steps once per ppo_mini_batch_size samples: the count follows
    # each policy's batch, where mini_batches fixes it.
    cfg = config("algorithm.mini_batch_size=3", "optim.lr=5e-3")
    assert cfg.algorithm.optimizer_steps(8) == 3 and cfg.algorithm.optimizer_steps(2) == 1
    learner = Learner(cfg, ["coder", "tester"], loader)
    samples = make_samples("coder", 8, seed=21) + make_samples("tester", 3, seed=22, task=1)
    metrics = learner.step(with_advantages(samples, cfg))
    assert metrics["learner/coder/optimizer_steps"] == 3.0  # 8 samples: 3 + 3 + 2
    assert metrics["learner/tester/optimizer_steps"] == 1.0
    assert metrics["learner/coder/ratio_mean"] != 1.0  # later steps see moved weights
    default = Learner(config(), ["coder"], loader)
    one = default.step(with_advantages(make_samples("coder", 8, seed=21), default.cfg))
    assert one["learner/coder/optimizer_steps"] == 1.0
