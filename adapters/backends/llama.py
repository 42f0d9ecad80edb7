"""A compact Llama-family forward pass over a slot KV cache, with per-row LoRA.

It reads the weights of a transformers model (Llama, Mistral, Qwen2, Qwen3) without
copying them, so it stays in step with in-place weight updates, and it costs a fraction
of the per-step Python overhead of `model.generate`, which dominates on small models.
Each sequence owns a slot (a row) of the cache; rows can sit at different positions.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_LORA_KEY = re.compile(
    r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj)\.lora_([AB])(?:\.[\w-]+)?\.weight$"
)


@dataclass
class _Layer:
    ln_attn: Tensor
    ln_mlp: Tensor
    linears: dict[str, Any]  # q_proj ... down_proj -> nn.Linear (weights read live)
    q_norm: Tensor | None
    k_norm: Tensor | None


@dataclass
class LoraAdapter:
    """One LoRA adapter: per (layer, module) the matrices A [r, in] and B*scale [out, r]."""

    name: str
    rank: int
    scale: float
    weights: dict[tuple[int, str], tuple[Tensor, Tensor]] = field(default_factory=dict)


@dataclass
class LoraRows:
    """Which rows of a batch use which adapter (rows not listed use the base model)."""

    groups: list[tuple[LoraAdapter, slice | Tensor]]


def lora_from_state_dict(
    name: str,
    state_dict: dict[str, Tensor],
    *,
    rank: int,
    alpha: float,
    use_rslora: bool = False,
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
    scale = alpha / (rank**0.5 if use_rslora else rank)
    adapter = LoraAdapter(name, rank, scale)
    for (layer, module), ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"Adapter {name!r} has only lora_{next(iter(ab))} for {module} of layer {layer}.")
        a = ab["A"].detach().to(device=device, dtype=dtype).contiguous()
        b = (ab["B"].detach().to(device=device, dtype=torch.float32) * scale).to(dtype).contiguous()
        adapter.weights[(layer, module)] = (a, b)
    return adapter


class LlamaForward:
    """Runs a Llama-family transformers model over a KV cache with `max_slots` rows."""

    def __init__(self, model: Any, max_slots: int, max_len: int) -> None:
        config = model.config
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"The embedded engine runs {', '.join(SUPPORTED_MODEL_TYPES)} models, not "
                f"{config.model_type!r}; serve this model with the vllm backend."
            )
        inner = model.model
        self.config = config
        self.n_heads = config.num_attention_heads
        self.n_kv = getattr(config, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.n_heads
        self.eps = config.rms_norm_eps
        self.embed = inner.embed_tokens.weight
        self.lm_head = model.lm_head
        self.norm = inner.norm.weight
        self.layers = [
            _Layer(
                ln_attn=layer.input_layernorm.weight,
                ln_mlp=layer.post_attention_layernorm.weight,
                linears={
                    "q_proj": layer.self_attn.q_proj,
                    "k_proj": layer.self_attn.k_proj,
                    "v_proj": layer.self_attn.v_proj,
                    "o_proj": layer.self_attn.o_proj,
                    "gate_proj": layer.mlp.gate_proj,
                    "up_proj": layer.mlp.up_proj,
                    "down_proj": layer.mlp.down_proj,
                },
                q_norm=_weight(getattr(layer.self_attn, "q_norm", None)),
                k_norm=_weight(getattr(layer.self_attn, "k_norm", None)),
            )
            for layer in inner.layers
        ]
        self.device = self.embed.device
        self.dtype = self.embed.dtype
        self.max_slots = max_slots
        self.max_len = max_len
        self._rope_tables(inner.rotary_emb, max_len)
        self.capacity = 0
        self.k_cache: list[Tensor] = []
        self.v_cache: list[Tensor] = []

    # ---- cache -------------------------------------------------------------------------

    def ensure_capacity(self, length: int) -> None:
        """Grow every slot's cache to hold `length` positions (in steps of 256)."""
        if length <= self.capacity:
            return
        if length > self.max_len:
            raise ValueError(f"length {length} exceeds the context window {self.max_len}")
        new_cap = min(self.max_len, max(256, -(-length // 256) * 256, self.capacity * 2))
        shape = (self.max_slots, self.n_kv, new_cap, self.head_dim)
        for cache in (self.k_cache, self.v_cache):
            for i in range(len(self.layers)):
                grown = torch.zeros(shape, dtype=self.dtype, device=self.device)
                if self.capacity:
                    grown[:, :, : self.capacity] = cache[i]
                if i < len(cache):
                    cache[i] = grown
                else:
                    cache.append(grown)
        self.capacity = new_cap

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` cached positions of slot `src` into slot `dst`."""
        for cache in (self.k_cache, self.v_cache):
            for layer_cache in cache:
                layer_cache[dst, :, :length] = layer_cache[src, :, :length]

    # ---- forward -----------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, slot: int, tokens: Tensor, start: int, lora: LoraAdapter | None) -> Tensor:
        """Run `tokens` [T] at positions start.. in `slot`; return the last position's logits [V]."""
        tokens = tokens.to(self.device)
        positions = torch.arange(start, start + tokens.numel(), device=self.device)[None]
        rows = LoraRows([(lora, slice(None))]) if lora is not None else None
        logits = self._forward(tokens[None], positions, slice(slot, slot + 1), rows)
        return logits[0]

    @torch.inference_mode()
    def decode(self, tokens: Tensor, positions: Tensor, lora: LoraRows | None) -> Tensor:
        """One token for each of slots 0..B-1: `tokens` [B] at `positions` [B]; logits [B, V]."""
        batch = tokens.numel()
        return self._forward(tokens[:, None], positions[:, None], slice(0, batch), lora)

    def _forward(self, tokens: Tensor, positions: Tensor, slots: slice, lora: LoraRows | None) -> Tensor:
        batch, length = tokens.shape
        kv_len = int(positions.max()) + 1
        self.ensure_capacity(kv_len)
        cos = self.cos[positions].unsqueeze(1)  # [B, 1, T, D]
        sin = self.sin[positions].unsqueeze(1)
        if batch == 1 and length > 1 and int(positions[0, 0]) == 0:
            mask, causal = None, True  # a fresh prompt: plain causal attention
        else:
            keys = torch.arange(kv_len, device=self.device)
            mask = (keys[None, None, :] <= positions[:, :, None]).unsqueeze(1)  # [B,1,T,K]
            causal = False
        slot_rows = torch.arange(slots.start, slots.stop, device=self.device)[:, None]
        x = F.embedding(tokens, self.embed)
        for index, layer in enumerate(self.layers):
            h = F.rms_norm(x, (x.shape[-1],), layer.ln_attn, self.eps)
            q = self._linear(h, layer, index, "q_proj", lora).view(batch, length, self.n_heads, self.head_dim)
            k = self._linear(h, layer, index, "k_proj", lora).view(batch, length, self.n_kv, self.head_dim)
            v = self._linear(h, layer, index, "v_proj", lora).view(batch, length, self.n_kv, self.head_dim)
            if layer.q_norm is not None:
                q = F.rms_norm(q, (self.head_dim,), layer.q_norm, self.eps)
                k = F.rms_norm(k, (self.head_dim,), layer.k_norm, self.eps)
            q = _rope(q.transpose(1, 2), cos, sin)
            k = _rope(k.transpose(1, 2), cos, sin)
            k_cache, v_cache = self.k_cache[index], self.v_cache[index]
            k_cache[slot_rows, :, positions] = k.transpose(1, 2)
            v_cache[slot_rows, :, positions] = v
            attn = F.scaled_dot_product_attention(
                q,
                k_cache[slots, :, :kv_len],
                v_cache[slots, :, :kv_len],
                attn_mask=mask,
                is_causal=causal,
                enable_gqa=self.n_kv != self.n_heads,
            )
            attn = attn.transpose(1, 2).reshape(batch, length, -1)
            x = x + self._linear(attn, layer, index, "o_proj", lora)
            h = F.rms_norm(x, (x.shape[-1],), layer.ln_mlp, self.eps)
            gate = self._linear(h, layer, index, "gate_proj", lora)
            up = self._linear(h, layer, index, "up_proj", lora)
            x = x + self._linear(F.silu(gate) * up, layer, index, "down_proj", lora)
        x = F.rms_norm(x[:, -1], (x.shape[-1],), self.norm, self.eps)
        return self.lm_head(x).float()

    def _linear(self, x: Tensor, layer: _Layer, index: int, name: str, lora: LoraRows | None) -> Tensor:
        linear = layer.linears[name]
        y = F.linear(x, linear.weight, linear.bias)
        if lora is None:
            return y
        for adapter, rows in lora.groups:
            ab = adapter.weights.get((index, name))
            if ab is None:
                continue
            a, b = ab
            if isinstance(rows, slice) and rows == slice(None):
                y = y + F.linear(F.linear(x, a), b)
            else:
                y[rows] += F.linear(F.linear(x[rows], a), b)
        return y

    def _rope_tables(self, rotary: Any, max_len: int) -> None:
        # Reuse the model's own inverse frequencies and scaling so every rope type matches.
        inv_freq = rotary.inv_freq.float().to(self.device)
        scaling = float(getattr(rotary, "attention_scaling", 1.0))
        t = torch.arange(max_len, device=self.device, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * scaling).to(self.dtype)
        self.sin = (emb.sin() * scaling).to(self.dtype)


def _weight(module: Any) -> Tensor | None:
    return None if module is None else module.weight


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
