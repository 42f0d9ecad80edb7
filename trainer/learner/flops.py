"""Model FLOPs of the learner's passes, and the MFU of an update against a timed matmul."""

from __future__ import annotations

import math
import time
from typing import Any

import torch
from peft import PeftModel

from masenvs.trainer.learner.packing import MicroBatch


def matmul_flops_per_s(n: int = 2048, repeats: int = 3) -> tuple[float, float]:
    """A large square fp32 `torch.mm` on this thread right now: (FLOP per second of wall
    time, best of `repeats`; FLOP per second of the process's CPU time, over all of them).

    The peak an update's MFU is measured against. On a shared machine the second is the
    steadier: time slices lost to other processes count in neither."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    best = math.inf
    cpu = time.process_time()
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    cpu = time.process_time() - cpu
    return 2 * n**3 / best, 2 * n**3 * repeats / max(cpu, 1e-9)


def mfu_metrics(update: dict[str, float]) -> dict[str, float]:
    """The update's MFU against a matmul timed now (call right after `Learner.step`, on its
    thread): per wall second, and per CPU second (steadier on a shared machine)."""
    wall, cpu = matmul_flops_per_s()
    out = {"learner/matmul_gflop_per_s": wall / 1e9, "learner/mfu": 0.0, "learner/mfu_cpu": 0.0}
    if update.get("learner/time_s"):
        out["learner/mfu"] = update["learner/gflops"] * 1e9 / update["learner/time_s"] / wall
    if update.get("learner/cpu_s"):
        out["learner/mfu_cpu"] = update["learner/gflops"] * 1e9 / update["learner/cpu_s"] / cpu
    return out


def linear_params(causal_lm: Any) -> int:
    """Weights of the decoder's linear layers (LoRA matrices and the LM head excluded)."""
    head = causal_lm.get_output_embeddings()
    return sum(
        m.weight.numel()
        for name, m in causal_lm.named_modules()
        if isinstance(m, torch.nn.Linear) and m is not head and "lora_" not in name
    )


def forward_flops(config: Any, params: int, mb: MicroBatch) -> float:
    """Model FLOPs of one forward pass over `mb`: 2 per weight per real token, attention
    (q.k and the weighted sum of values: 4 x heads x head_dim per attended pair and layer) and
    the LM head on the scored positions only (padding is not counted)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    attention = 4 * heads * head_dim * text.num_hidden_layers * mb.attended
    head = 2 * text.hidden_size * text.vocab_size * mb.targets.numel()
    return 2.0 * params * mb.tokens + attention + head


def pass_flops(
    model: Any, causal_lm: Any, mb: MicroBatch, full: bool, cache: dict[int, int]
) -> float:
    """Model FLOPs of one learner pass over `mb`: the forward, and with grad the backward
    (activation gradients, plus weight gradients when the whole model trains). `cache` keeps
    each causal LM's linear-layer weight count (by id) from pass to pass."""
    key = id(causal_lm)
    if key not in cache:
        cache[key] = linear_params(causal_lm)
    params = cache[key]
    if isinstance(model, PeftModel):  # the active adapter's matrices
        params += sum(p.numel() for p in model.parameters() if p.requires_grad)
    forward = forward_flops(causal_lm.config, params, mb)
    if not torch.is_grad_enabled():
        return forward
    return forward * (3.0 if full else 2.0)
