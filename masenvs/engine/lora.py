"""LoRA adapters: read from peft, swapped while the engine runs, applied per batch row.

`LoraAdapter` holds one adapter's A and scaled B matrices (from a peft state dict or
directory: `lora_from_state_dict`, `read_peft_dir`); `swap_adapter` adds, replaces or
removes one between decode steps; `LoraRows` says which rows of a batch use which
adapter, and `add_lora` adds their deltas to a projection's output.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from masenvs.engine import kernels
from masenvs.engine.adapter_dir import check_adapter_dir

_LORA_KEY = re.compile(
    r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj)\.lora_([AB])(?:\.[\w-]+)?\.weight$"
)


@dataclass
class LoraAdapter:
    """One LoRA adapter: per (layer, module) the matrices A [r, in] and B*scale [out, r].

    Whoever changes `weights` in place bumps `version`, so that the stacked float32 copies
    the forward pass reads (see `stacked`) are rebuilt.
    """

    name: str
    rank: int
    scale: float
    weights: dict[tuple[int, str], tuple[Tensor, Tensor]] = field(default_factory=dict)
    version: int = 0
    _stacked: dict[tuple[int, str], tuple[Tensor, Tensor] | None] = field(
        default_factory=dict, repr=False
    )
    _stacked_version: int = -1

    def stacked(
        self, index: int, parts: list[tuple[str, int, int]]
    ) -> tuple[Tensor, Tensor] | None:
        """For the modules of one projection (`parts`, as in `Projection`) of layer `index`:
        their A matrices stacked [R, in] and their B matrices placed block-diagonally and
        transposed [R, out], in float32; None if the adapter has none of them. Two small
        matmuls (or one native call) then give the whole projection's delta: tiny bfloat16
        matmuls cost ~30 us each on a CPU, float32 ones a few."""
        if self._stacked_version != self.version:
            self._stacked.clear()
            self._stacked_version = self.version
        key = (index, parts[0][0])
        if key not in self._stacked:
            found = [
                (self.weights[(index, n)], s, e) for n, s, e in parts if (index, n) in self.weights
            ]
            if not found:
                self._stacked[key] = None
            else:
                a = torch.cat([a.float() for (a, _), _, _ in found])
                b_t = a.new_zeros(a.shape[0], parts[-1][2])
                row = 0
                for (_, b_part), start, end in found:
                    b_t[row : row + b_part.shape[1], start:end] = b_part.float().T
                    row += b_part.shape[1]
                self._stacked[key] = (a.contiguous(), b_t)
        return self._stacked[key]


@dataclass
class LoraRows:
    """Which rows of a batch use which adapter (rows not listed use the base model)."""

    groups: list[tuple[LoraAdapter, slice | Tensor]]


def lora_scale(rank: int, alpha: float, use_rslora: bool = False) -> float:
    """peft's scaling of B @ A: alpha / r, or alpha / sqrt(r) with rsLoRA."""
    return alpha / (rank**0.5 if use_rslora else rank)


def lora_from_state_dict(
    name: str,
    state_dict: dict[str, Tensor],
    *,
    rank: int,
    scale: float,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> LoraAdapter:
    """Read a peft LoRA state dict (keys like `...layers.3.self_attn.q_proj.lora_A.weight`)."""
    pairs: dict[tuple[int, str], dict[str, Tensor]] = {}
    for key, value in state_dict.items():
        match = _LORA_KEY.search(key)
        if match is None:
            raise ValueError(
                f"Unsupported adapter tensor {key!r}: the embedded engine applies LoRA A/B "
                "matrices of attention and MLP projections only (no modules_to_save, DoRA or biases)."
            )
        layer, module, which = int(match[1]), match[2], match[3]
        pairs.setdefault((layer, module), {})[which] = value
    adapter = LoraAdapter(name, rank, scale)
    for (layer, module), ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(
                f"Adapter {name!r} has only lora_{next(iter(ab))} for {module} of layer {layer}."
            )
        a = ab["A"].detach().to(device=device, dtype=dtype).contiguous()
        b = (ab["B"].detach().to(device=device, dtype=torch.float32) * scale).to(dtype).contiguous()
        adapter.weights[(layer, module)] = (a, b)
    return adapter


def group_rows(
    items: list[tuple[LoraAdapter | None, slice]], device: torch.device
) -> LoraRows | None:
    """Rows (token ranges) that use each adapter; None when all rows use the base model."""
    groups: dict[int, tuple[LoraAdapter, list[slice]]] = {}
    for adapter, rows in items:
        if adapter is not None:
            groups.setdefault(id(adapter), (adapter, []))[1].append(rows)
    if not groups:
        return None
    result: list[tuple[LoraAdapter, slice | Tensor]] = []
    total = max(r.stop for _, r in items)
    for adapter, ranges in groups.values():
        if len(ranges) == 1:
            whole = ranges[0].start == 0 and ranges[0].stop == total
            result.append((adapter, slice(None) if whole else ranges[0]))
        else:
            result.append(
                (adapter, torch.cat([torch.arange(r.start, r.stop, device=device) for r in ranges]))
            )
    return LoraRows(result)


def add_lora(
    y: Tensor,
    x: Tensor,
    index: int,
    parts: list[tuple[str, int, int]],
    lora: LoraRows,
    native: bool,
) -> None:
    """y[rows] += x[rows] A^T (scale B)^T for each adapter's rows, in place; with `native`
    (bfloat16 on a CPU with the native kernels) in one call per adapter."""
    native = native and y.is_contiguous() and x.is_contiguous()
    for adapter, rows in lora.groups:
        ab = adapter.stacked(index, parts)
        if ab is None:
            continue
        a, b_t = ab
        if native:
            kernels.lora_add(y, x, rows, a, b_t)
            continue
        delta = torch.matmul(F.linear(x[rows].float(), a), b_t).to(y.dtype)
        if isinstance(rows, slice):
            y[rows] += delta
        else:
            y.index_add_(0, rows, delta)


def lora_rows(adapters: list[LoraAdapter | None]) -> LoraRows | None:
    """Which decode rows use which adapter, given each row's adapter (None: base model)."""
    groups: dict[int, tuple[LoraAdapter, list[int]]] = {}
    for row, adapter in enumerate(adapters):
        if adapter is not None:
            groups.setdefault(id(adapter), (adapter, []))[1].append(row)
    if not groups:
        return None
    result = []
    for adapter, rows in groups.values():
        if len(rows) == len(adapters):
            result.append((adapter, slice(None)))
        elif rows == list(range(rows[0], rows[-1] + 1)):
            result.append((adapter, slice(rows[0], rows[-1] + 1)))
        else:
            result.append((adapter, torch.tensor(rows, dtype=torch.long)))
    return LoraRows(result)


def swap_adapter(
    adapters: dict[str, LoraAdapter], name: str, adapter: LoraAdapter | None, in_place: bool
) -> None:
    """Add, replace or (`adapter` None) remove adapter `name` in `adapters`. With `in_place`
    and the same shapes, the new weights are copied into the current tensors, so requests
    running with it decode with them from the next step."""
    current = adapters.get(name)
    if adapter is None:
        adapters.pop(name, None)
    elif in_place and current is not None and _same_shapes(current, adapter):
        for key, (a, b) in adapter.weights.items():
            current.weights[key][0].copy_(a)
            current.weights[key][1].copy_(b)
        current.version += 1
    else:
        adapters[name] = adapter


def _same_shapes(a: LoraAdapter, b: LoraAdapter) -> bool:
    return a.weights.keys() == b.weights.keys() and all(
        a.weights[k][0].shape == b.weights[k][0].shape
        and a.weights[k][1].shape == b.weights[k][1].shape
        for k in a.weights
    )


def read_peft_dir(path: Path) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """The state dict and adapter_config.json of a peft LoRA directory."""
    adapter = check_adapter_dir(path)
    if adapter.weights.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(adapter.weights)), adapter.config
    return torch.load(adapter.weights, map_location="cpu", weights_only=True), adapter.config
