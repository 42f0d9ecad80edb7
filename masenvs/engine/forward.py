"""A compact Llama-family forward pass over a slot KV cache, with per-row LoRA.

It runs the weights of a transformers model (Llama, Mistral, Qwen2, Qwen3): q/k/v and
gate/up are concatenated into one matmul each (copies rebuilt when the model's weights
change in place), the other weights are read as they are. It avoids the per-step work of
`model.generate` (growing the KV cache by concatenation, padding masks, logits
processors). Each sequence owns a slot (a row) of the cache; rows sit at different
positions. The projections and their low-bit copies are `quant`'s, the per-row LoRA
deltas `lora`'s, the native attention, norm and SwiGLU calls `kernels`'.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from masenvs.engine import kernels
from masenvs.engine.lora import LoraAdapter, LoraRows, add_lora, group_rows
from masenvs.engine.quant import Projection, check_quantize, fused_projection

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass
class _Layer:
    ln_attn: Tensor
    ln_mlp: Tensor
    linears: dict[str, Any]  # q_proj ... down_proj -> nn.Linear (weights read live)
    qkv: Projection
    o: Projection
    gate_up: Projection
    down: Projection
    q_norm: Tensor | None
    k_norm: Tensor | None


@dataclass
class Prefill:
    """A prompt (or a chunk of one) to run into a cache slot."""

    slot: int
    tokens: Tensor  # [T] token ids
    start: int = 0  # position of tokens[0]; the slot already caches positions 0..start-1
    lora: LoraAdapter | None = None


class LlamaForward:
    """Runs a Llama-family transformers model over a KV cache with `max_slots` rows."""

    def __init__(
        self,
        model: Any,
        max_slots: int,
        max_len: int,
        quantize: str | None = None,
        batch_invariant: bool | str = False,
    ) -> None:
        config = model.config
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"The embedded engine runs {', '.join(SUPPORTED_MODEL_TYPES)} models, not "
                f"{config.model_type!r}; serve this model with the vllm backend."
            )
        self.quantize = check_quantize(quantize, model)
        inner = model.model
        self.config = config
        self.n_heads = config.num_attention_heads
        self.n_kv = getattr(config, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.n_heads
        self.eps = config.rms_norm_eps
        self.embed = inner.embed_tokens.weight
        self.lm_head = fused_projection({"lm_head": model.lm_head}, ("lm_head",), self.quantize)
        self.norm = inner.norm.weight
        self.layers = [self._layer(layer) for layer in inner.layers]
        self.device = self.embed.device
        self.dtype = self.embed.dtype
        # Where the native kernels run (kernels), decode steps attend (and write the
        # cache) in one call per layer, 8-14x faster than the batched matmuls below; LoRA
        # deltas, RMSNorm (fused with the residual add before it) and SwiGLU are one call
        # each too.
        self.native = (
            self.device.type == "cpu"
            and self.dtype == torch.bfloat16
            and self.head_dim % 16 == 0
            and config.hidden_size % 16 == 0
            and kernels.enabled()
        )
        if batch_invariant not in (True, False, "auto"):
            raise ValueError(f"batch_invariant is True, False or 'auto', not {batch_invariant!r}")
        if batch_invariant == "auto":
            batch_invariant = self._invariant_as_it_is()
        self.batch_invariant = bool(batch_invariant)
        if self.batch_invariant:
            self._make_batch_invariant()
        # How prefills attend: torch's flash attention over each prompt ("sdpa"), or, where
        # batch-invariant, each token as a decode step would, through the native kernel
        # ("decode-kernel"). bench/prefill.py times both: alike on short prompts, sdpa
        # 1.1-1.4x faster on long ones.
        self.prefill_attention = "decode-kernel" if self.batch_invariant else "sdpa"
        self.gqa = self.n_kv != self.n_heads
        self.scale = self.head_dim**-0.5
        self.max_slots = max_slots
        self.max_len = max_len
        self._rope_tables(inner.rotary_emb, max_len)
        self.rows = 0  # slots allocated so far
        self.capacity = 0  # positions allocated per slot
        # Keys are stored transposed, [slot, kv head, dim, position], so that the decode
        # step's q @ K^T reads them in place; values as [slot, kv head, position, dim].
        self.k_cache: list[Tensor] = []
        self.v_cache: list[Tensor] = []

    def _layer(self, layer: Any) -> _Layer:
        """One decoder layer's weights, its projections fused (and packed where quantized)."""
        linears = {
            "q_proj": layer.self_attn.q_proj,
            "k_proj": layer.self_attn.k_proj,
            "v_proj": layer.self_attn.v_proj,
            "o_proj": layer.self_attn.o_proj,
            "gate_proj": layer.mlp.gate_proj,
            "up_proj": layer.mlp.up_proj,
            "down_proj": layer.mlp.down_proj,
        }
        return _Layer(
            ln_attn=layer.input_layernorm.weight,
            ln_mlp=layer.post_attention_layernorm.weight,
            linears=linears,
            qkv=fused_projection(linears, ("q_proj", "k_proj", "v_proj"), self.quantize),
            o=fused_projection(linears, ("o_proj",), self.quantize),
            gate_up=fused_projection(linears, ("gate_proj", "up_proj"), self.quantize),
            down=fused_projection(linears, ("down_proj",), self.quantize),
            q_norm=_weight(getattr(layer.self_attn, "q_norm", None)),
            k_norm=_weight(getattr(layer.self_attn, "k_norm", None)),
        )

    def _projections(self) -> list[Projection]:
        projections = [self.lm_head]
        for layer in self.layers:
            projections += [layer.qkv, layer.o, layer.gate_up, layer.down]
        return projections

    def _invariant_as_it_is(self) -> bool:
        """Whether batch_invariant 'auto' turns it on: where the native kernels run and
        already read every matrix, so that it changes no weight (SmolLM2's GGUF on any kernel
        set; on AVX2, every model with `quantize` auto). Elsewhere it stays off, silently."""
        if not self.native or self.quantize is None:
            return False
        return all(projection.native_copy() for projection in self._projections())

    def _make_batch_invariant(self) -> None:
        """Check that every step can run batch-invariant, and switch the projections over.

        A token's logits then depend on its own prompt only, never on the requests batched
        with it, on how its prompt was split (a cached prefix, a shared prefill) or on the
        thread count: every matmul reads the native low-bit kernels, whose rows are
        independent (the dense matmuls' blocking, and so their rounding, depends on the row
        count), and every token attends through `kernels.decode_attention`, prefill
        tokens included, in the same order of operations as a decode step.
        """
        if not self.native:
            raise ValueError(
                "batch_invariant needs the native CPU kernels (an x86-64 CPU with AVX2, FMA "
                "and F16C, or AVX-512 BF16, and gcc) and bfloat16 weights on the CPU "
                f"(this engine: {str(self.dtype).removeprefix('torch.')} on "
                f"{self.device.type}, kernels {kernels.kernel_set() or 'off'}); for "
                "bfloat16 pass dtype 'bfloat16' (--dtype bfloat16)"
            )
        if self.quantize is None:
            raise ValueError(
                "batch_invariant reads every matrix through the native low-bit kernels: use "
                "quantize 'auto', 'int8' or 'int4', not 'none'"
            )
        for projection in self._projections():
            projection.make_invariant()

    # ---- cache -------------------------------------------------------------------------

    @torch.inference_mode()
    def ensure(self, rows: int, length: int) -> None:
        """Grow the cache to hold `rows` slots of `length` positions (allocated on demand)."""
        if rows <= self.rows and length <= self.capacity:
            return
        if length > self.max_len:
            raise ValueError(f"length {length} exceeds the context window {self.max_len}")
        if rows > self.max_slots:
            raise ValueError(f"{rows} cache slots requested; the cache has {self.max_slots}")
        new_rows, new_cap = self.rows, self.capacity
        if rows > self.rows:  # doubling keeps the number of regrowths logarithmic
            new_rows = min(self.max_slots, max(rows, 2 * self.rows))
        if length > self.capacity:
            new_cap = min(self.max_len, max(256, -(-length // 256) * 256, 2 * self.capacity))
        for cache, keys in ((self.k_cache, True), (self.v_cache, False)):
            for i in range(len(self.layers)):
                # Zeros, not empty: masked-out keys still meet V in a matmul, and 0 * NaN = NaN.
                grown = torch.zeros(
                    (new_rows, self.n_kv, *_cached((new_cap, self.head_dim), keys)),
                    dtype=self.dtype,
                    device=self.device,
                )
                if self.rows:
                    old = _cached((slice(self.capacity), slice(None)), keys)
                    grown[(slice(self.rows), slice(None), *old)] = cache[i]
                if i < len(cache):
                    cache[i] = grown
                else:
                    cache.append(grown)
        self.rows, self.capacity = new_rows, new_cap

    @torch.inference_mode()
    def copy_slot(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` cached positions of slot `src` into slot `dst`."""
        self.ensure(max(src, dst) + 1, length)
        for cache, keys in ((self.k_cache, True), (self.v_cache, False)):
            span = _cached((slice(length), slice(None)), keys)
            for layer_cache in cache:
                layer_cache[(dst, slice(None), *span)] = layer_cache[(src, slice(None), *span)]

    # ---- forward -----------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, prompts: list[Prefill]) -> Tensor:
        """Run each prompt into its slot; return the logits after each prompt's last token [n, V].

        All prompts run packed into one forward pass (the matmuls see every token at once);
        attention runs per prompt, over its own keys only. A prompt that continues a cached
        prefix (`start` > 0) attends to that prefix as well.
        """
        lengths = [p.tokens.numel() for p in prompts]
        total = sum(lengths)
        self.ensure(
            max(p.slot for p in prompts) + 1, max(p.start + n for p, n in zip(prompts, lengths))
        )
        device = self.device
        tokens = torch.cat([p.tokens for p in prompts]).to(device)
        positions = torch.cat(
            [torch.arange(p.start, p.start + n) for p, n in zip(prompts, lengths)]
        )
        positions = positions.to(device)
        slots = torch.cat([torch.full((n,), p.slot) for p, n in zip(prompts, lengths)]).to(device)
        ends = torch.tensor(lengths, device=device).cumsum(0) - 1
        offsets = [0, *ends.add(1).tolist()[:-1]]
        spans = [slice(o, o + n) for o, n in zip(offsets, lengths)]

        def per_prompt(qk: Tensor, v: Tensor, index: int) -> Tensor:
            # Per prompt: one packed pass with a block-diagonal mask would cost
            # (sum of lengths)^2 instead of the sum of squares.
            # 4-D inputs with contiguous keys: torch's CPU flash attention takes only those
            # (3-D ones, or the cache's transposed keys, run ~6x slower at 1700 tokens).
            q, k = self._store(qk, v, index, slots, positions)
            out = torch.empty_like(q)
            for prompt, span in zip(prompts, spans):
                query = q[span].transpose(0, 1)[None]  # [1, H, n, D]
                if prompt.start == 0:
                    keys, values, mask = k[span].transpose(0, 1), v[span].transpose(0, 1), None
                else:
                    end = prompt.start + span.stop - span.start
                    keys = self.k_cache[index][prompt.slot, :, :, :end].mT.contiguous()
                    values = self.v_cache[index][prompt.slot, :, :end]
                    mask = torch.arange(end, device=device) <= positions[span, None]
                out[span] = F.scaled_dot_product_attention(
                    query,
                    keys[None],
                    values[None],
                    attn_mask=mask,
                    is_causal=mask is None,
                    enable_gqa=self.gqa,
                )[0].transpose(0, 1)
            return out.view(total, -1)

        def as_decoded(qk: Tensor, v: Tensor, index: int) -> Tensor:
            # Batch-invariant: each token attends as a decode step would (same kernel, same
            # order of operations), whatever the other prompts or the prefix it reused.
            self._store(qk, v, index, slots, positions)
            k_cache, v_cache = self.k_cache[index], self.v_cache[index]
            return kernels.decode_attention(
                qk, v, k_cache, v_cache, positions, self.n_kv, self.scale, slots, write=False
            )

        attend = as_decoded if self.prefill_attention == "decode-kernel" else per_prompt
        rows = group_rows([(p.lora, span) for p, span in zip(prompts, spans)], device)
        quantized = self.quantize is not None  # where few tokens: see QUANTIZED_MAX_ROWS
        return self._forward(tokens, positions, attend, rows, ends, quantized=quantized)

    @torch.inference_mode()
    def decode(self, tokens: Tensor, positions: Tensor, lora: LoraRows | None) -> Tensor:
        """One token for each of slots 0..B-1: `tokens` [B] at `positions` [B]; logits [B, V]."""
        batch = tokens.numel()
        kv_len = int(positions.max()) + 1
        self.ensure(batch, kv_len)
        quantized = self.quantize is not None
        if self.native:

            def attend(qk: Tensor, v: Tensor, index: int) -> Tensor:
                return kernels.decode_attention(
                    qk,
                    v,
                    self.k_cache[index],
                    self.v_cache[index],
                    positions,
                    self.n_kv,
                    self.scale,
                )

            return self._forward(tokens, positions, attend, lora, slice(None), quantized=quantized)

        if bool((positions == kv_len - 1).all()):
            mask = None  # every row sees all kv_len keys
        else:
            keys = torch.arange(kv_len, device=self.device)
            hidden = keys[None, :] > positions[:, None]
            mask = torch.zeros(hidden.shape, dtype=self.dtype, device=self.device)
            mask = mask.masked_fill_(hidden, float("-inf"))[:, None, None, :]  # [B, 1, 1, K]
        groups = self.n_heads // self.n_kv
        slots = torch.arange(batch, device=self.device)

        def attend(qk: Tensor, v: Tensor, index: int) -> Tensor:
            # Two batched matmuls beat scaled_dot_product_attention for one query token on
            # CPU; the query heads of a KV head share its keys without repeating them.
            q, _ = self._store(qk, v, index, slots, positions)
            q = q.view(batch, self.n_kv, groups, self.head_dim)
            scores = torch.matmul(q, self.k_cache[index][:batch, :, :, :kv_len])
            scores.mul_(self.scale)
            if mask is not None:
                scores.add_(mask)
            weights = torch.softmax(scores, dim=-1)
            return torch.matmul(weights, self.v_cache[index][:batch, :, :kv_len]).view(batch, -1)

        return self._forward(tokens, positions, attend, lora, slice(None), quantized=quantized)

    def _forward(
        self,
        tokens: Tensor,
        positions: Tensor,
        attend: Any,
        lora: LoraRows | None,
        last: Tensor | slice,
        quantized: bool = False,
    ) -> Tensor:
        """Tokens [N] (flat, one per row of x) at `positions` [N]; `attend(qk, v, layer)`
        stores each token's key and value in its cache slot and returns the attention
        output [N, heads * D].

        `quantized` lets matmuls over at most their kernel's `max_rows` rows read the
        quantized weights; larger ones read the dense weights.
        """
        n = tokens.numel()
        cos = self.cos[positions].unsqueeze(1)  # [N, 1, D]
        sin = self.sin[positions].unsqueeze(1)
        heads, dim = self.n_heads, self.head_dim
        x = F.embedding(tokens, self.embed)
        for index, layer in enumerate(self.layers):
            h = self._norm(x, layer.ln_attn)
            (qkv,) = self._project(h, layer.qkv, index, lora, quantized, split=False)
            qk = qkv[:, : (heads + self.n_kv) * dim].view(n, heads + self.n_kv, dim)
            v = qkv[:, (heads + self.n_kv) * dim :].view(n, self.n_kv, dim)
            if layer.q_norm is not None:
                q = F.rms_norm(qk[:, :heads], (dim,), layer.q_norm, self.eps)
                k = F.rms_norm(qk[:, heads:], (dim,), layer.k_norm, self.eps)
                qk = torch.cat([q, k], dim=1)
            qk = _rope(qk, cos, sin)  # queries and keys in one go
            attn = attend(qk, v, index)
            h = self._norm(x, layer.ln_mlp, self._project(attn, layer.o, index, lora, quantized)[0])
            (gate_up,) = self._project(h, layer.gate_up, index, lora, quantized, split=False)
            x += self._project(self._swiglu(gate_up), layer.down, index, lora, quantized)[0]
        return self.lm_head(self._norm(x[last], self.norm), quantized).float()

    def _norm(self, x: Tensor, weight: Tensor, residual: Tensor | None = None) -> Tensor:
        """RMSNorm(x) * weight, after `x += residual` (in place) if one is given."""
        if self.native and x.is_contiguous() and (residual is None or residual.is_contiguous()):
            return kernels.add_rms_norm(x, residual, weight, self.eps)
        if residual is not None:
            x += residual
        return F.rms_norm(x, (x.shape[-1],), weight, self.eps)

    def _swiglu(self, gate_up: Tensor) -> Tensor:
        """silu(gate) * up of the fused gate/up projection's output [N, 2I]."""
        if self.native and gate_up.shape[1] % 32 == 0:
            return kernels.silu_mul(gate_up.contiguous())
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def _store(
        self, qk: Tensor, v: Tensor, index: int, slots: Tensor, positions: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Write the tokens' keys and values into layer `index`'s cache at (`slots`,
        `positions`); the queries and keys, split out of `qk`."""
        q, k = qk[:, : self.n_heads], qk[:, self.n_heads :]
        self.k_cache[index][slots, :, :, positions] = k
        self.v_cache[index][slots, :, positions] = v
        return q, k

    def _project(
        self,
        x: Tensor,
        projection: Projection,
        index: int,
        lora: LoraRows | None,
        quantized: bool,
        split: bool = True,
    ) -> list[Tensor]:
        """The outputs of the projection's modules, each with its own LoRA delta (or, with
        `split` False, the one matrix holding them side by side)."""
        y = projection(x, quantized)
        if lora is not None:
            add_lora(y, x, index, projection.parts, lora, self.native)
        if len(projection.parts) == 1 or not split:
            return [y]
        return [y[:, start:end] for _, start, end in projection.parts]

    def _rope_tables(self, rotary: Any, max_len: int) -> None:
        # Reuse the model's own inverse frequencies and scaling so every rope type matches.
        inv_freq = rotary.inv_freq.float().to(self.device)
        scaling = float(getattr(rotary, "attention_scaling", 1.0))
        t = torch.arange(max_len, device=self.device, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * scaling).to(self.dtype)
        # Rotating half the lanes is x * cos + roll(x, D/2) * sin with the sine's first half
        # negated; storing it negated saves the negation at every step.
        half = inv_freq.numel()
        emb[:, :half] = -emb[:, :half]
        self.sin = (emb.sin() * scaling).to(self.dtype)


def _cached(dims: tuple, keys: bool) -> tuple:
    """(position, dim) sizes or indices in a cache's layout: keys keep positions last."""
    return dims[::-1] if keys else dims


def _weight(module: Any) -> Tensor | None:
    return None if module is None else module.weight


def _rope(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """Rotary embedding on the last dim, rotate-half layout; `signed_sin`'s first half negated."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)
