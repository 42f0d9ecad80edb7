"""Low-bit matmul kernels side by side: microseconds per call at the decode batch sizes.

For SmolLM2-135M's matrix shapes, in one process on the same inputs: the native kernels
(`masenvs.engine.kernels`, 4-bit with a float16 scale and minimum per
group of 32, 8-bit with a float16 scale per group), torch's `_weight_int4pack_mm_for_cpu`
(what the engine uses without them) and a dense bfloat16 matmul. Medians of interleaved
rounds; weights are re-read from memory each call only as far as the caches allow, so
the in-engine figures (bench/engine.py) are the ones that count. Every kernel set this
CPU runs gets its columns (an AVX-512 BF16 machine times the AVX2 set too). Run:

    python bench/cpu_kernels.py --threads 2 --rows 1 4 8 16 32
    # torch held to AVX2 too, as on a CPU without AVX-512 (its bf16 matmuls emulated):
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python bench/cpu_kernels.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
from rich.console import Console
from rich.table import Table

from masenvs.engine import kernels as cpu_kernels

# (name, out_features, in_features) of SmolLM2-135M's matmuls, q/k/v and gate/up fused.
SHAPES = [
    ("q/k/v", 960, 576),
    ("o", 576, 576),
    ("gate/up", 3072, 576),
    ("down", 576, 1536),
    ("lm head", 49152, 576),
]


def timed(fn: Callable[[], object], calls: int, kernel_set: str | None) -> float:
    if kernel_set is not None:  # cpu_kernels.matmul runs the set this names
        os.environ[cpu_kernels.SWITCH] = kernel_set
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def contenders(out_features: int, in_features: int) -> dict[str, Callable[[torch.Tensor], object]]:
    groups = (out_features, in_features // 32)
    levels = torch.randint(0, 16, (out_features, in_features))
    scales = (torch.rand(groups) * 0.01 + 1e-3).half().float()
    minimums = (-8 * scales).half().float()
    weights = levels * scales.repeat_interleave(32, 1) + minimums.repeat_interleave(32, 1)
    dense = weights.bfloat16()
    torch_int4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(levels.int(), 2)
    table = torch.stack([scales.T, (minimums + 8 * scales).T], -1).bfloat16().contiguous()
    found = {
        "dense bf16": lambda x: torch.nn.functional.linear(x, dense),
        "torch int4": lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, torch_int4, 32, table
        ),
    }
    native4 = cpu_kernels.pack_int4(levels, scales, minimums)
    native8 = cpu_kernels.pack_int8(levels * 8 - 60, scales)
    for name in available_sets():  # the packed weights are the same for every set
        found[f"{name} int4"] = lambda x: cpu_kernels.matmul(x, native4)
        found[f"{name} int8"] = lambda x: cpu_kernels.matmul(x, native8)
    return found


def available_sets() -> list[str]:
    """The kernel sets this CPU runs (and gcc builds)."""
    found = []
    for name in cpu_kernels.KERNEL_SETS:
        if cpu_kernels.cpu_supports(name):
            os.environ[cpu_kernels.SWITCH] = name
            if cpu_kernels.kernel_set() == name:
                found.append(name)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    console = Console()
    sets = available_sets()
    if not sets:
        console.print("[yellow]The native kernels are not available here; torch and dense only.")
    columns = ["dense bf16", "torch int4"] + [f"{s} int{b}" for s in sets for b in (4, 8)]
    table = Table(
        title=f"us per call (median of {args.rounds} rounds), {args.threads} threads, torch "
        f"CPU capability {torch.backends.cpu.get_cpu_capability()}"
    )
    for column in ("matrix", "rows", *columns):
        table.add_column(column, justify="right")
    for name, out_features, in_features in SHAPES:
        kernels = contenders(out_features, in_features)
        calls = max(3, int(3e5 // (out_features * in_features / 1000)))
        for rows in args.rows:
            x = torch.randn(rows, in_features).bfloat16()
            samples: dict[str, list[float]] = {k: [] for k in kernels}
            for kernel in kernels.values():
                kernel(x)  # warm up
            for _ in range(args.rounds):
                for key, kernel in kernels.items():
                    kernel_set = key.split()[0] if key.split()[0] in sets else None
                    samples[key].append(timed(partial(kernel, x), calls, kernel_set))
            medians = {k: statistics.median(v) for k, v in samples.items()}
            base = medians["torch int4"]
            cells = [f"{medians[k]:.0f} ({base / medians[k]:.2f}x)" for k in columns]
            table.add_row(name, str(rows), *cells)
    console.print(table)
    console.print("Ratios are against torch int4 (what the engine runs without native kernels).")


if __name__ == "__main__":
    main()
