"""Weight-only quantization: the packed low-bit copies the decode steps' matmuls read.

A `Projection` is the weights one matmul reads (one nn.Linear, or several sharing an input
concatenated); with a quantize mode it also holds a 4- or 8-bit copy (`_Packed`) that
serves the small matmuls, through torch's int4/int8 kernels or the native ones (`kernels`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from masenvs.engine import kernels

# Weight-only quantization of the decode steps' matmuls (CPU, bfloat16 activations):
#   "auto": int4 for the matrices whose weights already are 4-bit (a GGUF Q4_1 file such
#           as SmolLM2's: 16 levels per group of 32); with the native kernels
#           (kernels), also int8 for those already 8-bit (Q8_0: SmolLM2's LM head).
#           Exact up to the rounding of each group's scale; other matrices stay dense,
#           except with the AVX2 kernels, where they go to 8 bits per group of 32 (as
#           Q8_0 stores them: bfloat16 matmuls are emulated on those CPUs).
#   "int4": every matrix to 4 bits per group of 32 inputs (lossy for 16-bit weights).
#   "int8": every matrix to 8 bits, per group of 32 inputs with the native kernels, else
#           with one scale per output row (lossy).
QUANTIZE_MODES = ("auto", "int4", "int8")
INT4_GROUP = 32
# Matmuls over more rows than this (larger decode batches, most prefills) read the dense
# weights: there the weight-only kernels, which dequantize per block of rows, cost more
# than the memory they save. torch's cross over at ~16 rows, the native AVX-512 ones
# (kernels) at ~128 (bench/cpu_kernels.py); the AVX2 ones serve every size (`_Packed`).
QUANTIZED_MAX_ROWS = {"int8": 16, "int4": 16, "int4-native": 64, "int8-native": 64}


@dataclass
class Projection:
    """The weights one matmul reads: one nn.Linear, or several that share an input.

    Several sources (q/k/v, gate/up) are concatenated into one matrix. With `quantize`, a
    weight-only int8 or int4 copy serves the small decode steps (see `QUANTIZE_MODES`).
    Copies are rebuilt when a source weight changes in place (its tensor version moves),
    so a trainer updating the transformers model is seen at the next step.
    """

    sources: list[Any]  # nn.Linear modules, in output order
    parts: list[tuple[str, int, int]]  # (module name, first output column, end column)
    quantize: str | None = None
    # Batch-invariant: every row count reads the packed copy through the native kernels,
    # whose rows never depend on one another (see LlamaForward).
    invariant: bool = False
    weight: Tensor | None = None
    bias: Tensor | None = None
    packed: _Packed | None = None
    stamp: tuple = ()

    def refresh(self) -> None:
        stamp = tuple((id(m.weight), m.weight._version) for m in self.sources)
        if stamp == self.stamp:
            return
        with torch.no_grad():
            weights = [m.weight.detach() for m in self.sources]
            self.weight = weights[0] if len(weights) == 1 else torch.cat(weights)
            biases = [m.bias for m in self.sources]
            self.bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
            self.packed = _pack(self.weight, self.quantize, self.invariant)
            if len(weights) > 1 and self.serves_every_size():
                # The concatenated copy (q/k/v, gate/up: ~1/3 of SmolLM2's weights again)
                # would never be read: build it only if a dense matmul ever needs it.
                self.weight = None
        self.stamp = stamp

    def serves_every_size(self) -> bool:
        """Whether the packed copy serves every row count, so the dense one is never read."""
        return self.packed is not None and (self.invariant or self.packed.max_rows == sys.maxsize)

    def __call__(self, x: Tensor, quantized: bool) -> Tensor:
        self.refresh()
        dense = not quantized or self.packed is None or x.shape[0] > self.packed.max_rows
        if dense and not self.invariant:
            if self.weight is None:
                with torch.no_grad():
                    self.weight = torch.cat([m.weight.detach() for m in self.sources])
            return F.linear(x, self.weight, self.bias)
        y = self.packed(x)
        return y if self.bias is None else y + self.bias

    def native_copy(self) -> bool:
        """Whether the native kernels read this projection's packed copy."""
        self.refresh()
        return self.packed is not None and self.packed.kernel.endswith("-native")

    def make_invariant(self) -> None:
        """Read the packed native copy at every row count (see LlamaForward.batch_invariant)."""
        self.invariant = True
        self.refresh()
        if not self.native_copy():  # left dense: repack under the batch-invariant rules
            self.stamp = ()
            self.refresh()
        if not self.native_copy():
            names = ", ".join(name for name, _, _ in self.parts)
            rows = sum(m.weight.shape[0] for m in self.sources)
            columns = self.sources[0].weight.shape[1]
            raise ValueError(
                f"batch_invariant: {names} [{rows}, {columns}] has no copy the native kernels "
                "read (they need out % 16 == 0 and in % 32 == 0)"
            )
        if len(self.sources) > 1:
            self.weight = None  # never read from now on (see refresh)


@dataclass
class _Packed:
    """A weight-only quantized copy of a [out, in] matrix and the kernel that reads it."""

    # "int8": torch's, one scale per output row; "int4": torch's, bfloat16 scale and zero
    # per INT4_GROUP inputs; "int4-native" / "int8-native": kernels.matmul, a float16
    # scale (and minimum) per group.
    kernel: str
    weight: Tensor | kernels.LowBitWeights
    scales: Tensor | None = None
    max_rows: int = 0  # set from the kernel: see QUANTIZED_MAX_ROWS

    def __post_init__(self) -> None:
        self.max_rows = QUANTIZED_MAX_ROWS[self.kernel]
        if self.kernel.endswith("-native") and kernels.kernel_set() == "avx2":
            # Without AVX-512 BF16, torch emulates bfloat16 matmuls: ~10x slower than the
            # AVX2 kernels at 128 rows (bench/cpu_kernels.py), so these serve prefills too.
            self.max_rows = sys.maxsize

    def __call__(self, x: Tensor) -> Tensor:
        if self.kernel.endswith("-native"):
            return kernels.matmul(x, self.weight)
        if self.kernel == "int8":
            return torch.ops.aten._weight_int8pack_mm(x, self.weight, self.scales)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.weight, INT4_GROUP, self.scales)


def fused_projection(
    linears: dict[str, Any], names: tuple[str, ...], quantize: str | None
) -> Projection:
    """One Projection over the modules `names` of `linears`, their outputs side by side."""
    parts, start = [], 0
    for name in names:
        end = start + linears[name].weight.shape[0]
        parts.append((name, start, end))
        start = end
    return Projection([linears[name] for name in names], parts, quantize)


def check_quantize(quantize: str | None, model: Any) -> str | None:
    """The quantize mode in force (None: dense); a clear error where it cannot run."""
    if quantize is None or quantize == "none":
        return None
    if quantize not in QUANTIZE_MODES:
        raise ValueError(
            f"Unknown quantize {quantize!r}; the embedded engine offers "
            f"{', '.join(QUANTIZE_MODES)} or none."
        )
    weight = model.lm_head.weight
    if weight.device.type == "cpu" and weight.dtype == torch.bfloat16:
        return quantize
    if quantize == "auto":
        return None  # the kernels pay off for bfloat16 on the CPU only
    dtype = str(weight.dtype).removeprefix("torch.")
    raise ValueError(
        f"quantize={quantize!r} needs bfloat16 weights on the CPU (elsewhere its kernel is "
        f"slower than a dense matmul); this model is {dtype} on {weight.device.type}: load "
        "it with dtype='bfloat16' (--dtype bfloat16)."
    )


def _pack(weight: Tensor, quantize: str | None, invariant: bool = False) -> _Packed | None:
    """The quantized copy of `weight` [out, in] that `quantize` asks for, if any; with
    `invariant` (batch-invariant engine), 16-bit weights go to 8 bits as with AVX2."""
    fits = kernels.supports(*weight.shape)  # torch's int4 kernel has the same rules
    native = fits and kernels.enabled()
    if quantize == "int8":
        if native:
            return _Packed("int8-native", _quantize_int8_native(*_int8_grid(weight)))
        return _Packed("int8", *_quantize_int8(weight))
    if not fits:
        return None
    grid = _int4_grid(weight)
    if quantize == "int4" or _is_4bit(*grid):
        if native:
            return _Packed("int4-native", _quantize_int4_native(*grid))
        return _Packed("int4", *_quantize_int4(weight, *grid))
    if native:  # "auto": 8-bit weights (a GGUF Q8_0 matrix) have a kernel of their own
        grid8 = _int8_grid(weight)
        if _is_8bit(*grid8) or invariant or kernels.kernel_set() == "avx2":
            # AVX2 CPUs emulate bfloat16 matmuls, so there 16-bit weights go to 8 bits per
            # group of 32 (as a GGUF Q8_0 file stores them) rather than stay dense.
            return _Packed("int8-native", _quantize_int8_native(*grid8))
    return None


def _quantize_int8(weight: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric per-output-row int8: weight ~ q * scale, |q| <= 127.

    The kernel takes the scales in the weights' dtype, so each scale is rounded up to that
    dtype first and the rows are quantized against the rounded scale: the only error left
    is int8 rounding, at most half a step per weight.
    """
    w = weight.float()
    exact = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
    scale = exact.to(weight.dtype)
    scale = torch.where(
        scale.float() < exact, torch.nextafter(scale, torch.full_like(scale, float("inf"))), scale
    )
    q = torch.round(w / scale.float()[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()
    return q, scale


def _int4_grid(weight: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Weights as [out, groups, 32] with each group's lowest value and 4-bit step."""
    w = weight.float().view(weight.shape[0], -1, INT4_GROUP)
    low, high = w.amin(dim=-1, keepdim=True), w.amax(dim=-1, keepdim=True)
    step = ((high - low) / 15).clamp_min(1e-12)
    return w, low, step


def _is_4bit(w: Tensor, low: Tensor, step: Tensor) -> bool:
    """Whether each group of 32 weights (`_int4_grid`) sits on its 16 evenly spaced levels,
    up to the rounding of the weights' own dtype: true of weights from a Q4_1 GGUF file."""
    error = (low + step * torch.round((w - low) / step) - w).abs()
    spread = torch.maximum(low.abs(), (low + 15 * step).abs())
    return bool((error <= spread * 2.0**-7).all())


def _quantize_int4(weight: Tensor, w: Tensor, low: Tensor, step: Tensor) -> tuple[Tensor, Tensor]:
    """Packed 4-bit weights and the kernel's [groups, out, 2] table of (scale, zero), where
    weight ~ (q - 8) * scale + zero with q in 0..15.

    Scale and zero are rounded to the weights' dtype (the kernel's) before the levels are
    chosen, so each weight gets the nearest level the kernel can represent. `w`, `low`
    and `step` are `_int4_grid(weight)`.
    """
    scale = step.to(weight.dtype).float()
    zero = (low + 8 * scale).to(weight.dtype).float()
    q = torch.round((w - zero) / scale + 8).clamp_(0, 15).to(torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.view(weight.shape), 2)
    table = torch.cat([scale, zero], dim=-1).transpose(0, 1).contiguous().to(weight.dtype)
    return packed, table


def _int8_grid(weight: Tensor) -> tuple[Tensor, Tensor]:
    """Weights as [out, groups, 32] and each group's symmetric 8-bit step (absmax / 127),
    rounded to float16 as the kernel stores it."""
    w = weight.float().view(weight.shape[0], -1, INT4_GROUP)
    step = (w.abs().amax(dim=-1, keepdim=True) / 127).clamp_min(2.0**-24).half().float()
    return w, step


def _is_8bit(w: Tensor, step: Tensor) -> bool:
    """Whether every group of 32 weights sits on its 8-bit levels up to the rounding of
    the weights' own dtype: true of a GGUF Q8_0 matrix read in bfloat16, not of 16-bit
    weights (their distance to the levels does not shrink with the weight)."""
    error = (torch.round(w / step).clamp_(-127, 127) * step - w).abs()
    return bool((error <= w.abs() * 2.0**-7 + step * 2.0**-6).all())


def _quantize_int8_native(w: Tensor, step: Tensor) -> kernels.LowBitWeights:
    """The levels of `_int8_grid` packed for kernels.matmul: weight ~ q * step, step
    refit to all 32 weights of its group (see `_refit`) and rounded to float16."""
    q = torch.round(w / step).clamp_(-127, 127)
    step = _refit(w, q, step, None)[0].clamp_min(2.0**-24).half().float()
    q = torch.round(w / step).clamp_(-127, 127)
    return kernels.pack_int8(q.view(q.shape[0], -1), step[..., 0])


def _quantize_int4_native(w: Tensor, low: Tensor, step: Tensor) -> kernels.LowBitWeights:
    """The levels of `_int4_grid` packed for kernels.matmul (see `_int4_levels`)."""
    q, step, low = _int4_levels(w, low, step)
    return kernels.pack_int4(q.view(q.shape[0], -1), step[..., 0], low[..., 0])


def _int4_levels(w: Tensor, low: Tensor, step: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Levels q of each group [.., 32] with weight ~ q * step + low: step and low refit to
    all 32 weights of their group (see `_refit`) and rounded to float16 (as a GGUF Q4_1
    block stores them) before the levels are chosen."""
    q = torch.round((w - low) / step).clamp_(0, 15)
    step, low = _refit(w, q, step, low)
    # Clamped so that a constant group keeps a positive float16 step.
    step = step.clamp_min(2.0**-24).half().float()
    low = low.half().float()
    return torch.round((w - low) / step).clamp_(0, 15), step, low


def _refit(w: Tensor, q: Tensor, step: Tensor, low: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """Least-squares step (and offset, unless `low` is None) of each group [.., 32] given
    its levels `q`. A grid read off the group's extremes inherits their rounding (bfloat16
    for the weights the engine holds), an error shared by all 32 weights; the fit averages
    it over the group, so it lands much nearer the file's own float16 values."""
    if low is None:
        norm = (q * q).sum(-1, keepdim=True)
        fitted = (q * w).sum(-1, keepdim=True) / norm.clamp_min(1.0)
        return torch.where(norm > 0, fitted, step), None
    n = w.shape[-1]
    sum_q, sum_w = q.sum(-1, keepdim=True), w.sum(-1, keepdim=True)
    det = n * (q * q).sum(-1, keepdim=True) - sum_q**2
    fitted = (n * (q * w).sum(-1, keepdim=True) - sum_q * sum_w) / det.clamp_min(1.0)
    step = torch.where(det > 0, fitted, step)
    return step, torch.where(det > 0, (sum_w - step * sum_q) / n, low)
