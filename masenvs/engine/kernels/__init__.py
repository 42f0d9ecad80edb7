"""Native CPU kernels for the embedded engine, compiled on first use with gcc.

- `matmul`: bfloat16 activations times weights stored in 4 or 8 bits with a float16 scale
  (and, for 4 bits, a minimum) per group of 32 inputs, exactly a GGUF Q4_1 or Q8_0 block.
  With AVX-512 BF16 one `vdpbf16ps` multiplies 16 output columns by two inputs and one
  pass over the weights serves 8 rows (torch's int4 kernel: 4): 1.5-2.2x torch's
  `_weight_int4pack_mm_for_cpu`, and ahead of a dense bfloat16 matmul up to ~64-128 rows
  (`bench/cpu_kernels.py`). With AVX2 the inputs become int16 per group (a power-of-two
  scale) and `vpmaddwd` multiplies 16 levels per instruction, summing exactly in int32; 4
  rows per pass.
- `decode_attention`: a decode step's cache writes and attention for one layer (in the
  batch-invariant mode, every prefill token's attention too: see `llama`).
- `lora_add`, `add_rms_norm`, `silu_mul`: a LoRA delta, RMSNorm fused with the residual
  add before it, SwiGLU; one call each instead of several torch ops.
- `logsumexp`: per row, in a fixed order (the batch-invariant engine's log-probabilities).

Two kernel sets implement the same functions on the same packed weights (`KERNEL_SETS`):
"avx512" (`avx512.c`: AVX-512 BF16, e.g. Intel Sapphire Rapids and later, AMD Zen 4
and later) and "avx2" (`avx2.c`: AVX2, FMA and F16C, e.g. Intel Haswell and
later, AMD Zen 1-3). The best one the CPU runs is used; `MASENVS_CPU_KERNELS` forces one
(`avx512`, `avx2`) or turns them off (`0`). A set is built into `cache_root()/kernels`,
keyed by its text and flags, and linked against the OpenMP runtime torch already loaded,
so the process keeps one thread pool (see `omp`). Where none can be built or run (no gcc,
a CPU without AVX2, no OpenMP runtime, not Linux x86-64: Arm included), `enabled()` is
False and the engine uses its torch code paths.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from masenvs.cache import cache_root
from masenvs.engine.omp import runtime_path

GROUP = 32  # inputs per scale and minimum
TILE = 16  # output columns per vector
COMMON_CFLAGS = ("-O3", "-std=c11", "-fPIC", "-fopenmp")
SWITCH = "MASENVS_CPU_KERNELS"


@dataclass(frozen=True)
class KernelSet:
    """One build of the kernels: its source, the CPU flags it needs, gcc's flags."""

    name: str
    source: Path
    cpu_flags: tuple[str, ...]  # as /proc/cpuinfo spells them
    cflags: tuple[str, ...]


KERNEL_SETS = {  # fastest first: the default is the first one the CPU runs
    "avx512": KernelSet(
        "avx512",
        Path(__file__).with_name("avx512.c"),
        ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "f16c", "fma"),
        ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mf16c", "-mfma"),
    ),
    "avx2": KernelSet(
        "avx2",
        Path(__file__).with_name("avx2.c"),
        ("avx2", "fma", "f16c"),
        ("-mavx2", "-mfma", "-mf16c"),  # no AVX-512: runs on any AVX2 CPU
    ),
}


@dataclass(frozen=True)
class LowBitWeights:
    """A [out_features, in_features] matrix packed for `matmul` (see avx512.c)."""

    # 4: weight = level * scale + minimum, level 0..15; 8: level * scale, |level| <= 127
    bits: int
    # 4 bits: int16 [out/16, groups, 4, 16, 2]; 8 bits: int8 [out/16, groups, 16, 16, 2]
    levels: Tensor
    scales: Tensor  # float16 [out/16, groups, 16]
    minimums: Tensor | None  # float16 [out/16, groups, 16]; None for 8 bits
    out_features: int
    in_features: int


def enabled() -> bool:
    """Whether the native kernels can be used here (built on first call)."""
    return kernel_set() is not None


def kernel_set() -> str | None:
    """The kernel set in use ("avx512", "avx2"), or None where none runs: the one
    `MASENVS_CPU_KERNELS` names (`0`: none), else the fastest this CPU runs."""
    return _resolve(os.environ.get(SWITCH, "").strip().lower())


@functools.cache  # every kernel call asks: reading /proc/cpuinfo each time cost ~8%
def _resolve(choice: str) -> str | None:
    if choice in ("0", "off", "none", "false"):
        return None
    if choice in ("", "1", "auto", "on", "true"):
        best = next((name for name in KERNEL_SETS if cpu_supports(name)), None)
        return best if best is not None and _library(best) is not None else None
    if choice not in KERNEL_SETS:
        raise ValueError(
            f"{SWITCH}={choice!r} is not a kernel set; use one of {', '.join(KERNEL_SETS)}, "
            "0 (off) or leave it unset (the fastest this CPU runs)."
        )
    if not cpu_supports(choice):
        missing = set(KERNEL_SETS[choice].cpu_flags) - cpu_flags()
        raise ValueError(
            f"{SWITCH}={choice} needs CPU flags this machine lacks ({', '.join(sorted(missing))}"
            f"); unset {SWITCH} to use the fastest set this CPU runs."
        )
    return choice if _library(choice) is not None else None


def supports(out_features: int, in_features: int) -> bool:
    return out_features % TILE == 0 and in_features % GROUP == 0


def pack_int4(levels: Tensor, scales: Tensor, minimums: Tensor) -> LowBitWeights:
    """Pack `levels` [out, in] (integers 0..15) with `scales` and `minimums` [out, in/32]
    (weight = level * scale + minimum, both rounded to float16 here)."""
    out_features, in_features = levels.shape
    tiles, groups = _tiles(out_features, in_features)
    # [tile, column j, group, r, nibble c, e] -> [tile, group, r, j, e, c]: input 2(4r+c)+e
    grid = levels.to(torch.int32).view(tiles, TILE, groups, 4, 4, 2).permute(0, 2, 3, 1, 5, 4)
    words = (grid << (4 * torch.arange(4, dtype=torch.int32))).sum(-1)
    # Words above 0x7fff wrap to negative int16: the bits are what the kernel reads.
    words = torch.where(words > 0x7FFF, words - 0x10000, words).to(torch.int16)

    return LowBitWeights(
        4,
        words.contiguous(),
        _per_tile(scales, tiles, groups),
        _per_tile(minimums, tiles, groups),
        out_features,
        in_features,
    )


def pack_int8(levels: Tensor, scales: Tensor) -> LowBitWeights:
    """Pack `levels` [out, in] (integers -127..127) with `scales` [out, in/32]
    (weight = level * scale, the scale rounded to float16 here)."""
    out_features, in_features = levels.shape
    tiles, groups = _tiles(out_features, in_features)
    # [tile, column j, group, pair p, e] -> [tile, group, p, j, e]: input 2p + e
    grid = levels.to(torch.int8).view(tiles, TILE, groups, 16, 2).permute(0, 2, 3, 1, 4)
    return LowBitWeights(
        8, grid.contiguous(), _per_tile(scales, tiles, groups), None, out_features, in_features
    )


def matmul(x: Tensor, weights: LowBitWeights) -> Tensor:
    """x [rows, in] bfloat16 @ weights^T -> [rows, out] bfloat16."""
    library = _loaded()
    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != weights.in_features:
        raise ValueError(
            f"matmul takes bfloat16 [rows, {weights.in_features}], got {x.dtype} {list(x.shape)}"
        )
    x = x.contiguous()
    y = torch.empty(x.shape[0], weights.out_features, dtype=torch.bfloat16)
    shape = (x.shape[0], weights.in_features, weights.out_features)
    if weights.bits == 4:
        status = library.int4_matmul(
            x.data_ptr(),
            weights.levels.data_ptr(),
            weights.scales.data_ptr(),
            weights.minimums.data_ptr(),
            y.data_ptr(),
            *shape,
        )
    else:
        status = library.int8_matmul(
            x.data_ptr(), weights.levels.data_ptr(), weights.scales.data_ptr(), y.data_ptr(), *shape
        )
    if status != 0:
        raise RuntimeError(
            f"int{weights.bits}_matmul failed for {list(x.shape)} x {weights.out_features}"
        )
    return y


def _tiles(out_features: int, in_features: int) -> tuple[int, int]:
    if not supports(out_features, in_features):
        raise ValueError(
            f"The low-bit kernels need out_features % {TILE} == 0 and in_features % {GROUP} "
            f"== 0, got [{out_features}, {in_features}]"
        )
    return out_features // TILE, in_features // GROUP


def _per_tile(values: Tensor, tiles: int, groups: int) -> Tensor:
    """[out, groups] -> float16 [out/16, groups, 16]: a group's 16 columns side by side."""
    return values.reshape(tiles, TILE, groups).transpose(1, 2).to(torch.float16).contiguous()


def decode_attention(
    qk: Tensor,
    v: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    positions: Tensor,
    n_kv: int,
    scale: float,
    slots: Tensor | None = None,
    write: bool = True,
) -> Tensor:
    """One decode step's attention, cache writes included (see avx512.c).

    `qk` [B, heads + n_kv, D]: each row's queries, then its new keys; `v` [B, n_kv, D]
    (rows may be strided); `k_cache` [slots, n_kv, D, capacity] and `v_cache` [slots, n_kv,
    capacity, D]; `positions` [B]. Row b uses cache slot `slots[b]` (slot b when `slots` is
    None); with `write` False its key and value must be in the cache already (a prefill
    stored them) and are not written. Returns [B, heads * D]; all bfloat16.
    """
    library = _loaded()
    batch, columns, dim = qk.shape
    heads = columns - n_kv
    highest = batch if slots is None else int(slots.max()) + 1 if slots.numel() else 0
    if (
        any(t.dtype != torch.bfloat16 for t in (qk, v, k_cache, v_cache))
        or qk.stride()[1:] != (dim, 1)
        or v.stride()[1:] != (dim, 1)
        or not (k_cache.is_contiguous() and v_cache.is_contiguous())
        or k_cache.shape[0] < highest
        or (slots is not None and slots.shape != (batch,))
        or heads % n_kv
    ):
        raise ValueError("decode_attention: unsupported dtypes, layouts or shapes")
    positions = positions.to(torch.int64).contiguous()
    if slots is not None:
        slots = slots.to(torch.int64).contiguous()
    out = torch.empty(batch, heads * dim, dtype=torch.bfloat16)
    status = library.decode_attention(
        qk.data_ptr(),
        qk.stride(0),
        v.data_ptr(),
        v.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        positions.data_ptr(),
        None if slots is None else slots.data_ptr(),
        int(write),
        out.data_ptr(),
        batch,
        n_kv,
        heads // n_kv,
        dim,
        k_cache.shape[-1],
        scale,
    )
    if status != 0:
        raise RuntimeError("decode_attention failed: a position beyond the cache, or out of memory")
    return out


def lora_add(y: Tensor, x: Tensor, rows: slice | Tensor, a: Tensor, b_t: Tensor) -> None:
    """y[rows] += (x[rows] a^T) b_t in place, rounding y once: y [M, N] and x [M, K]
    bfloat16 and contiguous, `a` [R, K] and `b_t` [R, N] float32 (the adapter's scaled B,
    transposed), `rows` a slice of rows or a tensor of row indices."""
    library = _loaded()
    (m, n), (r, k) = y.shape, a.shape
    if (
        y.dtype != torch.bfloat16
        or x.dtype != torch.bfloat16
        or a.dtype != torch.float32
        or b_t.dtype != torch.float32
        or x.shape != (m, k)
        or b_t.shape != (r, n)
        or not all(t.is_contiguous() for t in (y, x, a, b_t))
    ):
        raise ValueError("lora_add: unsupported dtypes, layouts or shapes")
    if isinstance(rows, slice):
        start, stop, _ = rows.indices(m)
        index, start, count = None, start, max(0, stop - start)
    else:
        rows = rows.to(torch.int64).contiguous()
        index, start, count = rows.data_ptr(), 0, rows.numel()
    status = library.lora_add(
        y.data_ptr(), x.data_ptr(), index, start, count, a.data_ptr(), b_t.data_ptr(), m, k, n, r
    )
    if status != 0:
        raise RuntimeError(f"lora_add failed: a row outside 0..{m - 1}, or rank {r} above 1024")


def add_rms_norm(x: Tensor, delta: Tensor | None, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm of x's rows times `weight`, after `x += delta` in place when `delta` is
    given (a residual add fused with the next norm); bfloat16 [M, H], H % 16 == 0."""
    library = _loaded()
    m, h = x.shape
    tensors = (x, weight) if delta is None else (x, weight, delta)
    if (
        any(t.dtype != torch.bfloat16 or not t.is_contiguous() for t in tensors)
        or weight.shape != (h,)
        or (delta is not None and delta.shape != x.shape)
    ):
        raise ValueError("add_rms_norm: unsupported dtypes, layouts or shapes")
    out = torch.empty_like(x)
    pointer = None if delta is None else delta.data_ptr()
    if library.add_rms_norm(x.data_ptr(), pointer, weight.data_ptr(), out.data_ptr(), m, h, eps):
        raise ValueError(f"add_rms_norm needs a width divisible by 16, got {h}")
    return out


def silu_mul(gate_up: Tensor) -> Tensor:
    """silu(gate) * up for gate_up = [gate | up] [M, 2I] bfloat16 -> [M, I]."""
    library = _loaded()
    m, width = gate_up.shape
    if gate_up.dtype != torch.bfloat16 or not gate_up.is_contiguous() or width % 32:
        raise ValueError("silu_mul: unsupported dtype, layout or width")
    out = torch.empty(m, width // 2, dtype=torch.bfloat16)
    library.silu_mul(gate_up.data_ptr(), out.data_ptr(), m, width // 2)
    return out


def logsumexp(x: Tensor) -> Tensor:
    """log(sum(exp(x[b]))) for each row of float32 x [B, V] -> [B]: each row summed in one
    fixed order, so a row's value never depends on the others (torch's reductions split a
    lone row across threads)."""
    library = _loaded()
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[0] == 0 or x.shape[1] == 0:
        raise ValueError(f"logsumexp takes float32 [rows, V], got {x.dtype} {list(x.shape)}")
    x = x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.float32)
    library.logsumexp_rows(x.data_ptr(), out.data_ptr(), *x.shape)
    return out


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU has bf16 dot-product instructions (x86 AVX512-BF16 or AMX-BF16,
    Arm BF16), read from `cpuinfo` (see `cpu_flags`)."""
    return bool(cpu_flags(cpuinfo) & {"avx512_bf16", "amx_bf16", "bf16"})


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The CPU's feature flags (x86 `flags`, Arm `Features`) from `cpuinfo`, by default
    /proc/cpuinfo; empty where it does not exist."""
    text = cpuinfo
    if text is None:
        try:
            text = Path("/proc/cpuinfo").read_text()
        except OSError:
            return set()
    flags = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
    return flags


def cpu_supports(name: str | None = None) -> bool:
    """Whether this CPU has the instructions kernel set `name` uses (by default: any set);
    x86-64 Linux only."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    names = [name] if name is not None else list(KERNEL_SETS)
    return any(set(KERNEL_SETS[n].cpu_flags) <= cpu_flags() for n in names)


def _loaded() -> ctypes.CDLL:
    name = kernel_set()
    if name is None:
        raise RuntimeError(f"The native CPU kernels are not available on this machine ({SWITCH}).")
    return _library(name)


@functools.cache
def _library(name: str) -> ctypes.CDLL | None:
    kernels = KERNEL_SETS[name]
    if not cpu_supports(name):
        return None
    runtime = runtime_path()
    if runtime is None or not runtime.name.startswith("libgomp"):
        return None  # the kernels are built with gcc's OpenMP; torch must use the same
    compiler = os.environ.get("CC") or shutil.which("gcc")
    if compiler is None:
        warnings.warn(
            "masenvs: no gcc found, so the embedded engine's native CPU kernels (2-4x faster "
            "decoding on this CPU) are off; install gcc to turn them on.",
            stacklevel=2,
        )
        return None
    try:
        path = _build(Path(compiler), runtime, kernels)
        library = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as exc:
        warnings.warn(
            f"masenvs: the native CPU kernels ({name}) could not be built ({exc}); using "
            "torch's paths.",
            stacklevel=2,
        )
        return None
    pointer, integer = ctypes.c_void_p, ctypes.c_int
    library.int4_matmul.argtypes = [pointer] * 5 + [integer] * 3
    library.int8_matmul.argtypes = [pointer] * 4 + [integer] * 3
    library.decode_attention.argtypes = [pointer, integer, pointer, integer] + [pointer] * 4
    library.decode_attention.argtypes += [integer, pointer] + [integer] * 5 + [ctypes.c_float]
    library.lora_add.argtypes = [pointer, pointer, pointer, integer, integer, pointer, pointer]
    library.lora_add.argtypes += [integer] * 4
    library.add_rms_norm.argtypes = [pointer] * 4 + [integer] * 2 + [ctypes.c_float]
    library.silu_mul.argtypes = [pointer] * 2 + [integer] * 2
    library.logsumexp_rows.argtypes = [pointer] * 2 + [integer] * 2
    functions = (
        library.int4_matmul,
        library.int8_matmul,
        library.decode_attention,
        library.lora_add,
        library.add_rms_norm,
        library.silu_mul,
        library.logsumexp_rows,
    )
    for function in functions:
        function.restype = integer
    return library


def _build(compiler: Path, runtime: Path, kernels: KernelSet = KERNEL_SETS["avx512"]) -> Path:
    """Compile a kernel set into the cache (once per source, flags and runtime)."""
    source = kernels.source.read_bytes()
    cflags = (*COMMON_CFLAGS, *kernels.cflags)
    key = hashlib.sha256(
        b"\0".join(
            [source, " ".join(cflags).encode(), str(runtime).encode(), str(compiler).encode()]
        )
    )
    target = cache_root() / "kernels" / f"{kernels.source.stem}-{key.hexdigest()[:16]}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        obj, lib = Path(tmp) / "kernels.o", Path(tmp) / "kernels.so"
        # Link the runtime torch loaded, not the compiler's own libgomp: one thread pool.
        for command in (
            [str(compiler), *cflags, "-c", str(kernels.source), "-o", str(obj)],
            [
                str(compiler),
                "-shared",
                str(obj),
                "-o",
                str(lib),
                str(runtime),
                f"-Wl,-rpath,{runtime.parent}",
            ],
        ):
            done = subprocess.run(command, capture_output=True, text=True, timeout=120)
            if done.returncode != 0:
                raise subprocess.SubprocessError(
                    done.stderr.strip()[-2000:] or f"{command[0]} failed"
                )
        os.replace(lib, target)
    return target
