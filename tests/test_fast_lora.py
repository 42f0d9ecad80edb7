"""The fused LoRA layer (trainer/learner/fast_lora.py) computes peft's LoRA: same outputs and
gradients, a float64 gradcheck, and peft's own forward wherever the call is not plain LoRA."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.lora import Linear as LoraLinear

from masenvs.trainer.config import load_config
from masenvs.trainer.learner import fast_lora
from masenvs.trainer.learner.learner import Learner


def peft_form(x: torch.Tensor, w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, s: float):
    return x @ w.t() + (x @ a.t()) @ b.t() * s


@pytest.mark.parametrize("shape", [(7, 12), (2, 5, 12), (1, 1, 12)])
def test_same_output_and_gradients_as_peft_form(shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    w = torch.randn(20, 12)
    a = torch.randn(3, 12, requires_grad=True)
    b = torch.randn(20, 3, requires_grad=True)
    x0 = torch.randn(*shape)
    results = []
    for form in (peft_form, fast_lora.lora_linear):
        a.grad = b.grad = None
        x = x0.clone().requires_grad_()
        out = form(x, w, a, b, 1.5)
        (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
        results.append([out.detach(), x.grad, a.grad.clone(), b.grad.clone()])
    assert results[1][0].shape == (*shape[:-1], 20)
    for ours, theirs in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_gradcheck_in_float64() -> None:
    torch.manual_seed(1)
    x = torch.randn(2, 4, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 6, dtype=torch.float64)
    a = torch.randn(2, 6, dtype=torch.float64, requires_grad=True)
    b = torch.randn(5, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda x, a, b: fast_lora.lora_linear(x, w, a, b, 0.7), (x, a, b)
    )


def test_frozen_input_gets_no_gradient_and_lora_still_learns() -> None:
    x = torch.randn(4, 6)  # the first layer's input: no grad wanted
    a = torch.randn(2, 6, requires_grad=True)
    b = torch.randn(5, 2, requires_grad=True)
    fast_lora.lora_linear(x, torch.randn(5, 6), a, b, 2.0).sum().backward()
    assert a.grad is not None and b.grad is not None and not x.requires_grad


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = torch.nn.Linear(8, 8, bias=False)
        self.up = torch.nn.Linear(8, 16, bias=False)
        self.out = torch.nn.Linear(16, 3, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.up(self.q(x))))


def two_adapters(dropout: float = 0.0) -> Any:
    torch.manual_seed(2)
    config = LoraConfig(r=2, lora_alpha=4, lora_dropout=dropout, target_modules=["q", "up", "out"])
    model = get_peft_model(Net(), config, adapter_name="tool")
    model.add_adapter("plan", config)
    for p in model.parameters():  # lora_B starts at zero: make the adapters matter
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.3)
    return model


def grads(model: Any, x: torch.Tensor, adapter: str) -> tuple[torch.Tensor, list]:
    model.set_adapter(adapter)
    model.zero_grad(set_to_none=True)
    out = model(x)
    out.square().sum().backward()
    return out.detach(), [p.grad for p in model.parameters() if p.requires_grad]


def test_installed_model_matches_peft_for_each_adapter() -> None:
    reference = two_adapters()
    model = copy.deepcopy(reference)
    # q and up are plain; `out` has a bias, so it keeps peft's forward (counted all the same)
    assert fast_lora.install(model) == 3
    x = torch.randn(5, 8)
    for adapter in ("tool", "plan", "tool"):
        out, ours = grads(model, x, adapter)
        ref_out, theirs = grads(reference, x, adapter)
        torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
        assert sum(g is not None for g in ours) == 6  # the active adapter's A and B, 3 layers
        for g, h in zip(ours, theirs, strict=True):
            assert (g is None) == (h is None)
            if g is not None:
                torch.testing.assert_close(g, h, rtol=1e-5, atol=1e-6)
    with model.disable_adapter(), reference.disable_adapter():
        torch.testing.assert_close(model(x), reference(x))


def test_the_fused_function_runs_only_where_the_call_is_plain(monkeypatch) -> None:
    calls = []
    real = fast_lora._LoraFunction.apply
    monkeypatch.setattr(fast_lora._LoraFunction, "apply", lambda *a: calls.append(1) or real(*a))
    model = two_adapters()
    fast_lora.install(model)
    x = torch.randn(3, 8)
    model(x)
    assert len(calls) == 2  # q and up; `out` has a bias
    calls.clear()
    with model.disable_adapter():
        model(x)
    with torch.autocast("cpu", torch.bfloat16):
        model(x)
    model.base_model.model.q.merge()
    model(x)
    assert len(calls) == 1  # up only: q is merged
    dropped = two_adapters(dropout=0.5)
    fast_lora.install(dropped)
    calls.clear()
    dropped.train()(x)
    assert calls == []


def test_peft_mode_by_environment(monkeypatch) -> None:
    monkeypatch.setenv("MASENVS_LORA", "peft")
    model = two_adapters()
    assert fast_lora.install(model) == 0
    assert all("forward" not in vars(m) for m in model.modules() if isinstance(m, LoraLinear))
    monkeypatch.setenv("MASENVS_LORA", "fast")
    with pytest.raises(ValueError, match="MASENVS_LORA"):
        fast_lora.install(model)


def test_the_learner_trains_through_it(loader: Any) -> None:
    cfg = load_config(None, ["model.name=tiny", "lora.rank=4", "policy.mode=per_agent"])
    learner = Learner(cfg, ["tool", "plan"], loader)
    layers = [m for m in learner.policies["tool"].model.modules() if isinstance(m, LoraLinear)]
    assert layers and all("forward" in vars(m) for m in layers)
