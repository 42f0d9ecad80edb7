"""A LoRA linear layer's forward and backward in one autograd function, for the CPU learner.

peft computes `base(x) + lora_B(lora_A(x)) * scaling` as five autograd nodes. On a CPU the
rank-r matmuls dominate what the adapter adds: MKL is slow when the rank is the output's
column count (`x @ A.T` is [M, r]; `dy @ B` in the backward is [M, r] from a 1536-wide
`dy`: 2-3x the time of the same product with the rank as rows), and the scaling and the
sum are two more passes over a [M, out] tensor. Here the rank is always the rows of a
product (`A @ x.T`, `B.T @ dy.T`), the scaling rides on `addmm_`'s alpha and the sum is
done in place: the adapter's cost over the frozen layer falls from ~32% to ~16% on
SmolLM2's projections (bench/lora_layer.py). Same math as peft's form, up to the order of
float sums (tests/test_fast_lora.py, incl. a float64 gradcheck).

`install(model)` gives every plain LoRA linear layer of a peft model this forward; anything
else (dropout, DoRA and other variants, biases, several active adapters, mixed-adapter
batches, merged or disabled adapters, autocast) runs peft's own forward.
`MASENVS_LORA=peft` keeps peft's forward everywhere (to compare).
"""

from __future__ import annotations

import os
import types
from typing import Any

import torch
from peft.tuners.lora import Linear as LoraLinear


class _LoraFunction(torch.autograd.Function):
    """y = x W^T + s (x A^T) B^T with a frozen W; gradients for x, A and B."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        lora_a: torch.Tensor,
        lora_b: torch.Tensor,
        scaling: float,
    ) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        hidden = torch.mm(lora_a, rows.t())  # [r, M]: the rank as rows (see the docstring)
        out = torch.mm(rows, weight.t()).addmm_(hidden.t(), lora_b.t(), alpha=scaling)
        ctx.save_for_backward(rows, weight, lora_a, lora_b, hidden)
        ctx.scaling, ctx.shape = scaling, x.shape
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        rows, weight, lora_a, lora_b, hidden = ctx.saved_tensors
        s = ctx.scaling
        grad = grad.reshape(-1, grad.shape[-1])
        grad_hidden = torch.mm(lora_b.t(), grad.t())  # [r, M]
        grad_x = grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.mm(grad, weight).addmm_(grad_hidden.t(), lora_a, alpha=s)
            grad_x = grad_x.view(ctx.shape)
        if ctx.needs_input_grad[2]:
            grad_a = torch.mm(grad_hidden, rows).mul_(s)
        if ctx.needs_input_grad[3]:
            grad_b = torch.mm(hidden, grad).t().mul(s)
        return grad_x, None, grad_a, grad_b, None


def lora_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """`x @ weight.T + (x @ lora_a.T) @ lora_b.T * scaling`, as one autograd node."""
    return _LoraFunction.apply(x, weight, lora_a, lora_b, scaling)


def _plain_lora(layer: LoraLinear, x: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
    """The frozen weight and the one active adapter's A and B when this call is plain LoRA
    in one dtype that the function computes; None where peft's forward must run."""
    if layer.disable_adapters or layer.merged or len(layer.active_adapters) != 1:
        return None
    name = layer.active_adapters[0]
    if name not in layer.lora_A or name in layer.lora_variant:
        return None
    if not isinstance(layer.lora_dropout[name], torch.nn.Identity):
        return None
    base, lora_a, lora_b = layer.base_layer, layer.lora_A[name], layer.lora_B[name]
    if not isinstance(base, torch.nn.Linear) or base.bias is not None:
        return None
    if lora_a.bias is not None or lora_b.bias is not None:
        return None
    weights = (base.weight, lora_a.weight, lora_b.weight)
    if torch.is_autocast_enabled(x.device.type) or any(w.dtype != x.dtype for w in weights):
        return None
    return weights


def _forward(self: LoraLinear, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    weights = None if args or kwargs else _plain_lora(self, x)
    if weights is None:
        return type(self).forward(self, x, *args, **kwargs)
    return lora_linear(x, *weights, self.scaling[self.active_adapters[0]])


def enabled() -> bool:
    """False where MASENVS_LORA=peft asks for peft's own forward."""
    value = os.environ.get("MASENVS_LORA", "fused").strip().lower()
    if value not in ("fused", "peft"):
        raise ValueError(f"MASENVS_LORA={value!r}: use fused (the default) or peft")
    return value == "fused"


def install(model: torch.nn.Module) -> int:
    """Give every LoRA linear layer of `model` the fused forward; returns how many got it."""
    if not enabled():
        return 0
    count = 0
    for module in model.modules():
        if type(module) is LoraLinear:  # not peft's subclasses (quantized bases)
            module.forward = types.MethodType(_forward, module)
            count += 1
    return count


def uninstall(model: torch.nn.Module) -> int:
    """Give the LoRA layers of `model` peft's own forward back; returns how many had ours."""
    count = 0
    for module in model.modules():
        if isinstance(module, LoraLinear) and "forward" in vars(module):
            del module.forward
            count += 1
    return count
