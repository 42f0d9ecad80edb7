"""The native CPU kernels (masenvs/engine/kernels/*.c) against float32 math: every
test that takes `kernels` (conftest.py) runs once per kernel set this CPU can run (AVX-512
BF16, AVX2), so an AVX-512 machine checks the AVX2 set too."""

from __future__ import annotations

import copy
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from test_models import decode_after, on_4bit_grid, small_model

from masenvs.engine import kernels as cpu_kernels
from masenvs.engine.forward import LlamaForward

# Skipped only where the kernels cannot exist; where they can, failing to build them fails.
needs_kernels = pytest.mark.skipif(
    not cpu_kernels.cpu_supports() or shutil.which("gcc") is None,
    reason="needs an x86-64 Linux CPU with AVX2 (or AVX-512 BF16) and gcc",
)


@pytest.fixture(autouse=True)
def fresh_choice() -> Iterator[None]:
    """Tests change the CPU flags and the switch: forget the kernel set chosen before."""
    cpu_kernels._resolve.cache_clear()
    yield
    cpu_kernels._resolve.cache_clear()


def bf16_rows(rows: int, width: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, width, generator=torch.Generator().manual_seed(seed)).bfloat16()


def assert_close_to(y: torch.Tensor, reference: torch.Tensor) -> None:
    # bfloat16 output: each value is rounded to 8 significant bits.
    assert y.dtype == torch.bfloat16 and y.shape == reference.shape
    error = (y.float() - reference).abs()
    assert bool((error <= reference.abs() * 2.0**-7 + reference.abs().max() * 1e-3).all())


@needs_kernels
def test_kernels_build_once_and_share_torchs_openmp_runtime(
    tmp_path: Path, monkeypatch, kernels: str
) -> None:
    assert cpu_kernels.enabled()
    from masenvs.engine.omp import runtime_path

    monkeypatch.setenv("MASENVS_CACHE", str(tmp_path))
    kernel_set = cpu_kernels.KERNEL_SETS[kernels]
    built = cpu_kernels._build(Path(shutil.which("gcc")), runtime_path(), kernel_set)
    stamp = built.stat().st_mtime_ns
    assert cpu_kernels._build(Path(shutil.which("gcc")), runtime_path(), kernel_set) == built
    assert built.stat().st_mtime_ns == stamp  # cached, not rebuilt
    maps = Path("/proc/self/maps").read_text().splitlines()
    runtimes = {
        line.split()[-1] for line in maps if Path(line.split()[-1]).name.startswith("libgomp")
    }
    assert len(runtimes) == 1, runtimes  # one OpenMP runtime, one thread pool


@needs_kernels
@pytest.mark.parametrize("out_features, in_features", [(16, 32), (48, 96), (960, 576)])
@pytest.mark.parametrize("rows", [*range(1, 10), 17])  # every remainder of the row blocks
def test_int4_matmul_matches_float32(
    out_features: int, in_features: int, rows: int, kernels: str
) -> None:
    generator = torch.Generator().manual_seed(rows)
    groups = (out_features, in_features // 32)
    levels = torch.randint(0, 16, (out_features, in_features), generator=generator)
    scales = (torch.rand(groups, generator=generator) * 0.01 + 1e-3).half().float()
    minimums = (torch.randn(groups, generator=generator) * 0.05).half().float()
    weights = levels * scales.repeat_interleave(32, 1) + minimums.repeat_interleave(32, 1)
    x = bf16_rows(rows, in_features, seed=rows)
    y = cpu_kernels.matmul(x, cpu_kernels.pack_int4(levels, scales, minimums))
    assert_close_to(y, x.float() @ weights.T)


@needs_kernels
@pytest.mark.parametrize("rows", [*range(1, 10), 12, 32])
def test_int8_matmul_matches_float32(rows: int, kernels: str) -> None:
    out_features, in_features = 64, 128
    generator = torch.Generator().manual_seed(rows)
    levels = torch.randint(-127, 128, (out_features, in_features), generator=generator)
    scales = (torch.rand(out_features, in_features // 32, generator=generator) * 1e-3).half()
    weights = levels * scales.float().repeat_interleave(32, 1)
    x = bf16_rows(rows, in_features, seed=rows)
    y = cpu_kernels.matmul(x, cpu_kernels.pack_int8(levels, scales.float()))
    assert_close_to(y, x.float() @ weights.T)


@needs_kernels
@pytest.mark.parametrize("bits", [4, 8])
def test_matmuls_keep_small_inputs_beside_large_ones_and_propagate_inf_and_nan(
    bits: int, kernels: str
) -> None:
    # The AVX2 set scales each row's group of 32 inputs to int16 by its largest: inputs
    # 2^20 below it must still count, and a group holding inf or NaN must not vanish.
    generator = torch.Generator().manual_seed(bits)
    levels = torch.randint(0 if bits == 4 else -127, 16 if bits == 4 else 128, (48, 96))
    scales = (torch.rand(48, 3, generator=generator) * 0.01 + 1e-3).half().float()
    minimums = (torch.randn(48, 3, generator=generator) * 0.05).half().float()
    weights = levels * scales.repeat_interleave(32, 1)
    if bits == 4:
        weights = weights + minimums.repeat_interleave(32, 1)
        packed = cpu_kernels.pack_int4(levels, scales, minimums)
    else:
        packed = cpu_kernels.pack_int8(levels, scales)
    x = bf16_rows(5, 96, seed=3)
    x[:, 32:64] *= 2.0**-20  # a group of tiny inputs
    x[0, 40] = 1.0  # ... beside one large one in row 0
    x[1, 0] = 1e30  # a group of huge inputs
    x[1, 1] = -1e30
    y = cpu_kernels.matmul(x, packed)
    assert_close_to(y[[0, 2, 3, 4]], x[[0, 2, 3, 4]].float() @ weights.T)
    assert_close_to(y[1:2], x[1:2].float() @ weights.T)
    tiny = x.clone()
    tiny[:, :32] = tiny[:, 64:] = 0  # only the tiny group: its own scale, no large input
    assert_close_to(cpu_kernels.matmul(tiny, packed), tiny.float() @ weights.T)
    for bad in (float("nan"), float("inf")):
        x[2, 70] = bad
        assert not cpu_kernels.matmul(x, packed)[2].isfinite().any()  # as float32 math


@needs_kernels
def test_bad_shapes_and_inputs_are_refused_clearly(kernels: str) -> None:
    with pytest.raises(ValueError, match="out_features % 16"):
        cpu_kernels.pack_int4(torch.zeros(20, 32), torch.ones(20, 1), torch.zeros(20, 1))
    packed = cpu_kernels.pack_int8(torch.zeros(16, 64), torch.ones(16, 2))
    with pytest.raises(ValueError, match="bfloat16"):
        cpu_kernels.matmul(torch.zeros(2, 64), packed)  # float32
    with pytest.raises(ValueError, match=r"\[rows, 64\]"):
        cpu_kernels.matmul(torch.zeros(2, 32, dtype=torch.bfloat16), packed)


def quantized_model() -> torch.nn.Module:
    """A small float32 model stored as a GGUF Q4_1/Q8_0 file would give it: projections on
    a 4-bit grid (`on_4bit_grid`), the untied LM head on an 8-bit one (per group of 32
    inputs, integers -127..127 times a float16 scale)."""
    model = small_model("qwen2", vocab_size=320)  # an untied head, 320 % 16 == 0
    with torch.no_grad():
        head = model.lm_head.weight
        levels = torch.randint(-127, 128, (320, 2, 32))
        levels[..., 0] = 127  # Q8_0 maps each group's largest magnitude to 127
        scales = (torch.rand(320, 2, 1) * 0.002 + 0.001).half().float()
        head.copy_((levels * scales).view(320, 64))
    return on_4bit_grid(model)


@needs_kernels
def test_auto_reads_4bit_and_8bit_weights_natively_and_stays_faithful(kernels: str) -> None:
    exact_model = quantized_model()
    model = copy.deepcopy(exact_model).to(torch.bfloat16)  # what the engine loads
    prompts = [torch.randint(0, 320, (n,)) for n in (9, 4, 13)]
    exact = decode_after(LlamaForward(exact_model, 3, 64), prompts)
    dense = decode_after(LlamaForward(model, max_slots=3, max_len=64), prompts)
    forward = LlamaForward(model, max_slots=3, max_len=64, quantize="auto")
    native = decode_after(forward, prompts)
    assert forward.lm_head.packed.kernel == "int8-native"
    assert {layer.down.packed.kernel for layer in forward.layers} == {"int4-native"}
    assert not torch.equal(dense, native)  # the kernels really ran
    # At least as close to the float32 model as the dense bfloat16 weights are: the
    # kernels read the grid itself, not its bfloat16 rounding.
    native_gap = (native.log_softmax(-1) - exact.log_softmax(-1)).abs()
    dense_gap = (dense.log_softmax(-1) - exact.log_softmax(-1)).abs()
    # The largest gap is bfloat16 activations' rounding, ~0.04-0.055 for both forms, which the
    # instruction set's float order moves: measured against the dense form's, not a constant.
    assert native_gap.max() < 1.5 * dense_gap.max(), (native_gap.max(), dense_gap.max())
    assert native_gap.mean() <= 1.3 * dense_gap.mean(), (native_gap.mean(), dense_gap.mean())


def test_refit_recovers_a_q4_1_grid_from_bfloat16_weights() -> None:
    from masenvs.engine.quant import _int4_grid, _int4_levels

    exact = on_4bit_grid(small_model("llama")).model.layers[0].mlp.up_proj.weight.detach()
    held = exact.bfloat16()  # what the engine holds
    levels, step, low = _int4_levels(*_int4_grid(held))
    rebuilt = (levels * step + low).view(exact.shape)
    # Closer to the file's weights than their own bfloat16 rounding, on average and at worst.
    assert (rebuilt - exact).abs().mean() < 0.75 * (held.float() - exact).abs().mean()
    assert (rebuilt - exact).abs().max() <= (held.float() - exact).abs().max()


@needs_kernels
def test_auto_leaves_16bit_weights_dense_and_the_switch_turns_kernels_off(
    monkeypatch, kernels: str
) -> None:
    model = small_model("llama").to(torch.bfloat16)
    auto = LlamaForward(model, max_slots=1, max_len=64, quantize="auto")
    decode_after(auto, [torch.randint(0, 300, (5,))])
    packed = {
        p.packed and p.packed.kernel for layer in auto.layers for p in (layer.qkv, layer.down)
    }
    # AVX2 CPUs emulate bfloat16 matmuls, so there 16-bit weights go to 8 bits instead.
    assert packed == ({"int8-native"} if kernels == "avx2" else {None})

    monkeypatch.setenv("MASENVS_CPU_KERNELS", "0")
    assert not cpu_kernels.enabled()
    forced = LlamaForward(model, max_slots=1, max_len=64, quantize="int4")
    decode_after(forced, [torch.randint(0, 300, (5,))])
    assert {layer.qkv.packed.kernel for layer in forced.layers} == {"int4"}  # torch's


def attention_reference(qk, v, k_cache, v_cache, positions, n_kv, scale):
    """Float32 attention of each row over its slot's positions 0..positions[b], after
    writing the row's key and value there, as the engine's torch path computes it."""
    batch, columns, dim = qk.shape
    heads, groups = columns - n_kv, (columns - n_kv) // n_kv
    keys, values = k_cache.float().clone(), v_cache.float().clone()
    rows = torch.arange(batch)
    keys[rows, :, :, positions] = qk[:, heads:].float()
    values[rows, :, positions] = v.float()
    out = torch.empty(batch, heads, dim)
    for b in range(batch):
        end = int(positions[b]) + 1
        for head in range(heads):
            kv = head // groups
            weights = (qk[b, head].float() @ keys[b, kv, :, :end] * scale).softmax(-1)
            out[b, head] = weights @ values[b, kv, :end]
    return out.view(batch, -1), keys, values


@needs_kernels
@pytest.mark.parametrize(
    "batch, n_kv, groups, dim, longest",
    [
        (1, 3, 3, 64, 1),
        (8, 3, 3, 64, 100),
        (5, 2, 2, 16, 17),
        (3, 1, 4, 128, 40),
        (32, 4, 1, 32, 33),
    ],
)
def test_decode_attention_matches_float32(batch, n_kv, groups, dim, longest, kernels: str) -> None:
    generator = torch.Generator().manual_seed(batch * 100 + longest)
    heads, capacity = n_kv * groups, 64 * (longest // 64 + 1)

    def randn(*shape):
        return torch.randn(*shape, generator=generator).bfloat16()

    k_cache, v_cache = randn(batch + 2, n_kv, dim, capacity), randn(batch + 2, n_kv, capacity, dim)
    qkv = randn(batch, (heads + 2 * n_kv) * dim)  # as the q/k/v projection returns them
    qk = qkv[:, : (heads + n_kv) * dim].reshape(batch, heads + n_kv, dim).clone()
    v = qkv[:, (heads + n_kv) * dim :].view(batch, n_kv, dim)  # strided rows
    positions = torch.randint(0, longest, (batch,), generator=generator)
    positions[0] = longest - 1
    scale = dim**-0.5
    expected, keys, values = attention_reference(qk, v, k_cache, v_cache, positions, n_kv, scale)
    out = cpu_kernels.decode_attention(qk, v, k_cache, v_cache, positions, n_kv, scale)
    assert torch.equal(k_cache.float(), keys) and torch.equal(v_cache.float(), values)
    assert_close_to(out, expected)


@needs_kernels
def test_decode_attention_refuses_positions_beyond_the_cache(kernels: str) -> None:
    qk = torch.zeros(1, 4, 16, dtype=torch.bfloat16)
    v = torch.zeros(1, 2, 16, dtype=torch.bfloat16)
    k_cache = torch.zeros(1, 2, 16, 32, dtype=torch.bfloat16)
    v_cache = torch.zeros(1, 2, 32, 16, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="beyond the cache"):
        cpu_kernels.decode_attention(qk, v, k_cache, v_cache, torch.tensor([32]), 2, 0.25)
    with pytest.raises(ValueError, match="unsupported"):
        cpu_kernels.decode_attention(qk.float(), v, k_cache, v_cache, torch.tensor([0]), 2, 0.25)


@needs_kernels
@pytest.mark.parametrize("rows", [slice(None), slice(2, 5), torch.tensor([0, 3, 4])])
def test_lora_add_matches_float32(rows, kernels: str) -> None:
    generator = torch.Generator().manual_seed(7)
    y, x = bf16_rows(6, 40, seed=1), bf16_rows(6, 72, seed=2)  # widths off the 16-lane grid
    a = torch.randn(12, 72, generator=generator)
    b_t = torch.randn(12, 40, generator=generator) * 0.1
    expected = y.float().clone()
    expected[rows] += x[rows].float() @ a.T @ b_t
    updated = y.clone()
    cpu_kernels.lora_add(updated, x, rows, a, b_t)
    selected = torch.zeros(6, dtype=torch.bool)
    selected[rows] = True
    assert torch.equal(updated[~selected], y[~selected])  # other rows untouched
    assert_close_to(updated[selected], expected[selected])
    with pytest.raises(RuntimeError, match="outside"):
        cpu_kernels.lora_add(updated, x, torch.tensor([6]), a, b_t)


def random_adapter(model: torch.nn.Module, name: str, seed: int):
    from masenvs.engine.lora import lora_from_state_dict

    generator = torch.Generator().manual_seed(seed)
    state = {}
    for module_name, module in model.named_modules():
        if module_name.endswith(("q_proj", "v_proj", "gate_proj", "down_proj")):
            out_features, in_features = module.weight.shape
            state[f"{module_name}.lora_A.weight"] = torch.randn(4, in_features, generator=generator)
            state[f"{module_name}.lora_B.weight"] = torch.randn(
                out_features, 4, generator=generator
            )
    return lora_from_state_dict(name, state, rank=4, scale=0.05)


@needs_kernels
def test_native_lora_rows_match_the_torch_path(monkeypatch, kernels: str) -> None:
    from masenvs.engine.forward import Prefill
    from masenvs.engine.lora import LoraRows

    model = small_model("llama").to(torch.bfloat16)
    first, second = random_adapter(model, "a", 1), random_adapter(model, "b", 2)
    prompts = [torch.randint(0, 300, (n,)) for n in (6, 9, 4, 7)]
    # rows 0 and 2 with adapter a, row 3 with b, row 1 the base model
    lora = LoraRows([(first, torch.tensor([0, 2])), (second, slice(3, 4))])

    def logits(forward: LlamaForward, rows: LoraRows | None = lora) -> torch.Tensor:
        forward.prefill([Prefill(slot, p[:-1]) for slot, p in enumerate(prompts)])
        tokens = torch.stack([p[-1] for p in prompts])
        positions = torch.tensor([len(p) - 1 for p in prompts])
        return forward.decode(tokens, positions, rows).log_softmax(-1)

    native = LlamaForward(model, max_slots=4, max_len=64)
    assert native.native
    with_kernels = logits(native)
    monkeypatch.setenv("MASENVS_CPU_KERNELS", "0")
    with_torch = logits(LlamaForward(model, max_slots=4, max_len=64))
    without_lora = logits(LlamaForward(model, max_slots=4, max_len=64), None)
    assert (with_kernels - with_torch).abs().max() < 0.02
    assert (with_torch - without_lora).abs().max() > 0.1  # the adapters matter here
    assert (with_kernels[1] - without_lora[1]).abs().max() < 0.02  # row 1: base model


@needs_kernels
@pytest.mark.parametrize("rows", [1, 8, 33])
def test_add_rms_norm_and_silu_mul_match_float32(rows: int, kernels: str) -> None:
    import torch.nn.functional as F

    x, delta = bf16_rows(rows, 576, seed=rows) * 3, bf16_rows(rows, 576, seed=rows + 1)
    weight = (torch.rand(576, generator=torch.Generator().manual_seed(0)) + 0.5).bfloat16()
    summed = x + delta  # torch's bfloat16 add
    out = cpu_kernels.add_rms_norm(x, delta, weight, 1e-5)
    assert torch.equal(x, summed)  # the residual add, in place and rounded as torch rounds
    assert_close_to(out, F.rms_norm(summed.float(), (576,), weight.float(), 1e-5))
    assert_close_to(
        cpu_kernels.add_rms_norm(x, None, weight, 1e-5),
        F.rms_norm(x.float(), (576,), weight.float(), 1e-5),
    )

    gate_up = bf16_rows(rows, 2 * 1536, seed=rows + 2) * 4
    expected = F.silu(gate_up[:, :1536].float()) * gate_up[:, 1536:].float()
    assert_close_to(cpu_kernels.silu_mul(gate_up), expected)
    with pytest.raises(ValueError, match="unsupported"):
        cpu_kernels.add_rms_norm(x.float(), None, weight, 1e-5)


@needs_kernels
def test_a_missing_compiler_is_said_and_the_torch_paths_take_over(monkeypatch) -> None:
    monkeypatch.setattr(cpu_kernels.shutil, "which", lambda name: None)
    monkeypatch.delenv("CC", raising=False)
    cpu_kernels._library.cache_clear()
    try:
        with pytest.warns(UserWarning, match="no gcc found"):
            assert not cpu_kernels.enabled()
        forward = LlamaForward(small_model("llama").to(torch.bfloat16), 1, 64, quantize="int4")
        decode_after(forward, [torch.randint(0, 300, (5,))])
        assert not forward.native and forward.layers[0].qkv.packed.kernel == "int4"
    finally:
        cpu_kernels._library.cache_clear()


@needs_kernels
def test_the_switch_picks_a_set_and_refuses_unknown_ones(monkeypatch) -> None:
    monkeypatch.delenv("MASENVS_CPU_KERNELS", raising=False)
    best = next(name for name in cpu_kernels.KERNEL_SETS if cpu_kernels.cpu_supports(name))
    assert cpu_kernels.kernel_set() == best  # the fastest this CPU runs
    monkeypatch.setenv("MASENVS_CPU_KERNELS", "0")
    assert cpu_kernels.kernel_set() is None and not cpu_kernels.enabled()
    monkeypatch.setenv("MASENVS_CPU_KERNELS", "sse2")
    with pytest.raises(ValueError, match="not a kernel set; use one of avx512, avx2"):
        cpu_kernels.kernel_set()
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: {"avx2", "fma", "f16c"})
    cpu_kernels._resolve.cache_clear()  # the choice is made once per process otherwise
    monkeypatch.setenv("MASENVS_CPU_KERNELS", "avx512")
    with pytest.raises(ValueError, match="lacks .*avx512_bf16"):
        cpu_kernels.kernel_set()
    monkeypatch.delenv("MASENVS_CPU_KERNELS")
    assert cpu_kernels.kernel_set() == "avx2"  # an AVX2-only CPU gets the AVX2 set


@pytest.mark.parametrize(
    "machine, flags",
    [("aarch64", {"fp", "asimd", "bf16"}), ("x86_64", {"sse2", "avx", "f16c"})],
)
def test_cpus_without_a_kernel_set_run_the_torch_paths(monkeypatch, machine, flags) -> None:
    monkeypatch.delenv("MASENVS_CPU_KERNELS", raising=False)
    monkeypatch.setattr(cpu_kernels.platform, "machine", lambda: machine)
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: flags)
    assert not cpu_kernels.cpu_supports() and cpu_kernels.kernel_set() is None
    model = small_model("llama").to(torch.bfloat16)
    forward = LlamaForward(model, max_slots=1, max_len=64, quantize="int4")
    prompt = [torch.randint(0, 300, (5,))]
    logits = decode_after(forward, prompt)
    assert not forward.native and forward.layers[0].qkv.packed.kernel == "int4"  # torch's
    dense = decode_after(LlamaForward(model, max_slots=1, max_len=64), prompt)
    assert (logits.log_softmax(-1) - dense.log_softmax(-1)).abs().max() < 0.1


@needs_kernels
def test_engine_runs_bfloat16_where_any_kernel_set_runs(monkeypatch) -> None:
    from masenvs.engine import loading as models

    monkeypatch.setattr(models, "cpu_has_native_bf16", lambda: False)  # an AVX2-only CPU
    monkeypatch.setenv("MASENVS_CPU_KERNELS", "avx2")
    assert models.engine_dtype("cpu") == torch.bfloat16
