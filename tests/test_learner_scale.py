"""The learner at scale: full fine-tuning, per-agent learning rates and freezing, and the
memory options (chunked log-probs, gradient checkpointing, split prompt units), which must
leave the loss and the gradients unchanged."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from safetensors import safe_open
from test_learner import VOCAB, config

from masenvs.engine.loading import cache_dir
from masenvs.trainer.atgrpo import group_advantages
from masenvs.trainer.config import load_config
from masenvs.trainer.learner.learner import Learner
from masenvs.trainer.learner.packing import prompt_units, unit_length
from masenvs.trainer.samples import Sample, tree_group


def branches(agent: str, n_prompts: int, k: int, seed: int, length: int = 12) -> list[Sample]:
    """K completions per prompt with different rewards, as a tree node's K branches."""
    rng = random.Random(seed)
    out = []
    for t in range(n_prompts):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(3, 30))]
        for b in range(k):
            completion = [rng.randrange(VOCAB) for _ in range(rng.randint(2, length))]
            group = tree_group(t, 0, agent)
            out.append(Sample(prompt, completion, [], agent, agent, group, float((b * 7 + t) % 3)))
    return group_advantages(out, config().algorithm)[0]


def grads_and_metrics(
    learner: Learner, policy: str, samples: list[Sample]
) -> tuple[list[torch.Tensor], dict[str, float]]:
    metrics = learner.step(samples)
    grads = [p.grad.clone() for p in learner.policies[policy].params]
    return grads, metrics


def assert_same_update(a: Any, b: Any, policy: str = "coder") -> None:
    (grads_a, m_a), (grads_b, m_b) = a, b
    for x, y in zip(grads_a, grads_b, strict=True):
        assert torch.allclose(x, y, atol=1e-7, rtol=1e-4)
    for key in ("loss", "grad_norm", "entropy"):
        assert m_a[f"learner/{policy}/{key}"] == pytest.approx(
            m_b[f"learner/{policy}/{key}"], rel=1e-5
        ), key


# -- memory options: same update --------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_give_the_unchunked_loss_gradients_and_entropy(
    loader: Any, temperature: float
) -> None:
    samples = branches("coder", 3, 4, seed=1)
    runs = []
    for chunk in (5, 1_000_000):  # many chunks vs one
        cfg = config(f"optim.logprob_chunk_tokens={chunk}", f"rollout.temperature={temperature}")
        learner = Learner(cfg, ["coder"], loader)
        logprobs = learner.logprobs("coder", samples)
        runs.append((grads_and_metrics(learner, "coder", samples), logprobs))
    (chunked, lp_chunked), (whole, lp_whole) = runs
    assert_same_update(chunked, whole)
    for a, b in zip(lp_chunked, lp_whole, strict=True):
        assert torch.allclose(a, b, atol=1e-6)


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")  # peft
def test_gradient_checkpointing_gives_the_same_update(loader: Any) -> None:
    samples = branches("coder", 2, 4, seed=2)
    runs = []
    for on in ("true", "false"):
        learner = Learner(config(f"optim.gradient_checkpointing={on}"), ["coder"], loader)
        base = learner.policies["coder"].model.get_base_model()
        assert _checkpointing(base) is (on == "true")
        runs.append(grads_and_metrics(learner, "coder", samples))
    assert_same_update(*runs)


class _Saved:
    """A tensor autograd keeps for the backward, counted while it is alive."""

    alive = peak = 0

    def __init__(self, tensor: torch.Tensor, size: int) -> None:
        self.tensor, self.size = tensor, size
        _Saved.alive += size
        _Saved.peak = max(_Saved.peak, _Saved.alive)

    def __del__(self) -> None:
        _Saved.alive -= self.size


def peak_saved_activations(learner: Learner, samples: list[Sample]) -> int:
    """Most bytes of activations held for the backward at once during one update (weights,
    which autograd saves too but never copies, are not counted)."""
    weights = {p.untyped_storage().data_ptr() for p in learner.policies["coder"].model.parameters()}

    def pack(t: torch.Tensor) -> Any:
        own = t.untyped_storage().data_ptr() not in weights
        return _Saved(t, t.untyped_storage().nbytes() if own else 0)

    _Saved.alive = _Saved.peak = 0
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda saved: saved.tensor):
        learner.step(samples)
    return _Saved.peak


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")  # peft
def test_the_defaults_keep_an_updates_activations_few(loader: Any) -> None:
    """Issue 44: a run on defaults stays under the main job's peak memory because the update
    recomputes activations in the backward instead of keeping a long answer's whole set
    (docs/memory.md, 'Defaults and the main job's peak')."""
    rng = random.Random(5)
    prompt = [rng.randrange(VOCAB) for _ in range(30)]
    answers = [[rng.randrange(VOCAB) for _ in range(200)] for _ in range(2)]  # long answers
    group = tree_group(0, 0, "coder")
    samples = [
        Sample(prompt, a, [], "coder", "coder", group, float(r)) for r, a in enumerate(answers)
    ]
    samples = group_advantages(samples, config().algorithm)[0]
    peaks = {}
    for name, overrides in {"defaults": [], "kept": ["optim.gradient_checkpointing=false"]}.items():
        learner = Learner(load_config(None, ["model.name=tiny", *overrides]), ["coder"], loader)
        peaks[name] = peak_saved_activations(learner, samples)
    assert peaks["defaults"] < 0.5 * peaks["kept"], peaks


def test_a_prompts_completions_split_across_micro_batches_when_over_budget(loader: Any) -> None:
    samples = branches("coder", 1, 8, seed=3, length=30)  # one prompt, 8 long completions
    budget = 64
    units = prompt_units(samples, share=True, max_tokens=budget)
    assert len(units) > 1  # the 8 completions do not fit one micro-batch together
    assert sorted(i for u in units for i in u) == list(range(8))
    assert all(unit_length(samples, u) <= budget or len(u) == 1 for u in units)
    assert prompt_units(samples, share=True) == [list(range(8))]  # without a budget: one unit

    split = Learner(config(f"optim.max_tokens_per_microbatch={budget}"), ["coder"], loader)
    whole = Learner(config("optim.max_tokens_per_microbatch=4096"), ["coder"], loader)
    assert_same_update(
        grads_and_metrics(split, "coder", samples), grads_and_metrics(whole, "coder", samples)
    )


def _checkpointing(model: Any) -> bool:
    flag = getattr(type(model), "is_activation_checkpointing", None)  # transformers 5.x
    return model.is_activation_checkpointing if flag else model.is_gradient_checkpointing


# -- full fine-tuning ---------------------------------------------------------------------------


def test_full_finetuning_trains_every_parameter(loader: Any) -> None:
    cfg = config("policy.finetune=full", "optim.lr=1e-3")
    learner = Learner(cfg, ["coder"], loader)
    policy = learner.policies["coder"]
    model = policy.model
    assert not policy.lora and len(policy.params) == len(list(model.parameters()))
    before = learner.full_state_dict("coder")
    samples = branches("coder", 2, 4, seed=4)
    metrics = learner.step(samples)
    after = learner.full_state_dict("coder")
    assert before.keys() == after.keys()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert sorted(changed) == sorted(before)  # embeddings, norms, every projection
    assert metrics["learner/coder/grad_norm"] > 0.0
    assert all(v.device.type == "cpu" for v in after.values())


def test_full_state_dict_uses_the_base_models_safetensors_names(loader: Any) -> None:
    learner = Learner(config("policy.finetune=full"), ["coder"], loader)
    state = learner.full_state_dict("coder")
    with safe_open(str(cache_dir() / "tiny" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert set(state) == names  # a tied LM head appears once, as the file stores it
        for name in names:
            assert torch.equal(state[name], f.get_tensor(name)), name
    with pytest.raises(ValueError, match="adapter_state_dict"):
        Learner(config(), ["coder"], loader).full_state_dict("coder")


@pytest.mark.learning
def test_full_finetuning_raises_the_probability_of_good_completions(loader: Any) -> None:
    cfg = config("policy.finetune=full", "optim.lr=1e-3", "optim.grad_clip=null")
    learner = Learner(cfg, ["coder"], loader)
    samples = branches("coder", 1, 2, seed=5)
    good, bad = sorted(samples, key=lambda s: -(s.advantage or 0.0))
    before = [lp.sum().item() for lp in learner.logprobs("coder", [good, bad])]
    for _ in range(3):
        learner.step(samples)
    after = [lp.sum().item() for lp in learner.logprobs("coder", [good, bad])]
    assert after[0] > before[0] and after[1] < before[1]


def test_full_finetuning_per_agent_has_one_model_per_agent(loader: Any) -> None:
    cfg = config("policy.finetune=full", "policy.mode=per_agent")
    learner = Learner(cfg, ["coder", "tester"], loader)
    assert learner.policies["coder"].model is not learner.policies["tester"].model
    tester0 = learner.full_state_dict("tester")
    learner.step(branches("coder", 2, 4, seed=6))
    after = learner.full_state_dict("tester")
    assert all(torch.equal(tester0[k], after[k]) for k in tester0)

    shared = Learner(
        config("policy.finetune=full", "policy.mode=shared"), ["coder", "tester"], loader
    )
    assert list(shared.policies) == ["shared"]


def test_full_finetuning_kl_uses_a_frozen_reference_copy(loader: Any) -> None:
    cfg = config("policy.finetune=full", "algorithm.kl_coef=0.1", "optim.lr=1e-3")
    learner = Learner(cfg, ["coder"], loader)
    samples = branches("coder", 2, 3, seed=7)
    base = learner.logprobs("coder", samples, base=True)
    metrics = learner.step(samples)
    assert metrics["learner/coder/kl_ref"] == pytest.approx(0.0, abs=1e-7)  # before the update
    again = learner.logprobs("coder", samples, base=True)
    assert all(torch.equal(a, b) for a, b in zip(base, again, strict=True))
    moved = learner.logprobs("coder", samples)
    assert not all(torch.allclose(a, b) for a, b in zip(base, moved, strict=True))


# -- per-agent learning rate and freezing -------------------------------------------------------


def test_per_agent_learning_rate_scales_that_agents_update(loader: Any) -> None:
    samples = branches("coder", 2, 4, seed=8)
    deltas = {}
    for lr in (None, 2e-2):
        overrides = ["policy.mode=per_agent"] + ([f"agents.coder.lr={lr}"] if lr else [])
        learner = Learner(config(*overrides), ["coder", "tester"], loader)
        before = learner.adapter_state_dict("coder")
        metrics = learner.step(samples)
        after = learner.adapter_state_dict("coder")
        deltas[lr] = torch.cat([(after[k] - before[k]).flatten() for k in before])
        largest = max(w.abs().max().item() for w in before.values())
        assert metrics["learner/coder/lr"] == pytest.approx(lr or 1e-2)
    # AdamW's first step (and its weight decay) is proportional to the learning rate. A move
    # read back as `after - before` in float32 is off by up to an ulp of the weight, from
    # each of the two runs: 4 ulps of the largest weight bound that on any CPU.
    ulps = 4 * torch.finfo(torch.float32).eps * largest
    assert torch.allclose(deltas[2e-2], 2 * deltas[None], rtol=1e-3, atol=ulps)


def test_a_frozen_agent_is_never_trained(loader: Any) -> None:
    cfg = config("policy.mode=per_agent", "agents.tester.freeze=true")
    learner = Learner(cfg, ["coder", "tester"], loader)
    assert learner.trains("coder") and not learner.trains("tester")
    tester0 = learner.adapter_state_dict("tester")
    metrics = learner.step(branches("coder", 1, 4, seed=9) + branches("tester", 1, 4, seed=10))
    assert "learner/coder/loss" in metrics and "learner/tester/loss" not in metrics
    after = learner.adapter_state_dict("tester")
    assert all(torch.equal(tester0[k], after[k]) for k in tester0)

    full = Learner(
        config("policy.finetune=full", "policy.mode=per_agent", "agents.tester.freeze=true"),
        ["coder", "tester"],
        loader,
    )
    assert not any(p.requires_grad for p in full.policies["tester"].params)


def test_inconsistent_per_agent_settings_fail_clearly(loader: Any) -> None:
    with pytest.raises(ValueError, match="frozen but share policy 'shared'"):
        Learner(
            config("policy.mode=shared", "agents.tester.freeze=true"), ["coder", "tester"], loader
        )
    with pytest.raises(ValueError, match="different learning rates"):
        Learner(config("policy.mode=shared", "agents.tester.lr=1e-3"), ["coder", "tester"], loader)
    with pytest.raises(ValueError, match=r"agents names agents \['ghost'\]"):
        Learner(config("agents.ghost.lr=1e-3"), ["coder"], loader)
    # every agent of a shared policy frozen, or all with one learning rate: fine
    Learner(
        config("policy.mode=shared", "agents.coder.freeze=true", "agents.tester.freeze=true"),
        ["coder", "tester"],
        loader,
    )


def test_full_finetuning_keeps_fp32_master_weights_under_bf16_autocast(loader: Any) -> None:
    # On a GPU, full fine-tuning with model.dtype 'auto' computes in bf16 (autocast) on fp32
    # weights; CPU autocast runs the same code path here.
    cfg = config("policy.finetune=full", "optim.lr=1e-6", "optim.logprob_chunk_tokens=7")
    samples = branches("coder", 1, 4, seed=11)
    exact = Learner(cfg, ["coder"], loader).logprobs("coder", samples)
    learner = Learner(cfg, ["coder"], loader)
    learner.autocast = torch.bfloat16
    for a, b in zip(learner.logprobs("coder", samples), exact, strict=True):
        assert torch.allclose(a, b, atol=2e-2)  # bf16 matmuls, fp32 log-softmax
    before = learner.full_state_dict("coder")
    learner.step(samples)
    after = learner.full_state_dict("coder")
    assert all(v.dtype == torch.float32 for v in after.values())
    # A 1e-6 step moves every fp32 weight; bf16 weights would have dropped most of it.
    moved = [k for k in before if not torch.equal(before[k], after[k])]
    kept_in_bf16 = [k for k in moved if not torch.equal(before[k].bfloat16(), after[k].bfloat16())]
    assert sorted(moved) == sorted(before) and len(kept_in_bf16) < len(moved)
