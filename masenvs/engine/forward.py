"""A compact Llama-family forward pass over a slot KV cache, with per-row LoRA.

It runs the weights of a transformers model (Llama, Mistral, Qwen2, Qwen3): q/k/v and
gate/up are concatenated into one matmul each (copies rebuilt when the model's weights
change in place), the other weights are read as they are. It avoids the per-step work of
`model.generate` (growing the KV cache by concatenation, padding masks, logits
processors). Each sequence owns a slot (a row) of the cache; rows sit at different
positions.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from masenvs.engine import kernels

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
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
_LORA_KEY = re.compile(
    r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj)\.lora_([AB])(?:\.[\w-]+)?\.weight$"
)


@dataclass
class _Projection:
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


@dataclass
class _Layer:
    ln_attn: Tensor
    ln_mlp: Tensor
    linears: dict[str, Any]  # q_proj ... down_proj -> nn.Linear (weights read live)
    qkv: _Projection
    o: _Projection
    gate_up: _Projection
    down: _Projection
    q_norm: Tensor | None
    k_norm: Tensor | None


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
        """For the modules of one projection (`parts`, as in `_Projection`) of layer `index`:
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
class Prefill:
    """A prompt (or a chunk of one) to run into a cache slot."""

    slot: int
    tokens: Tensor  # [T] token ids
    start: int = 0  # position of tokens[0]; the slot already caches positions 0..start-1
    lora: LoraAdapter | None = None


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
        self.quantize = _check_quantize(quantize, model)
        inner = model.model
        self.config = config
        self.n_heads = config.num_attention_heads
        self.n_kv = getattr(config, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.n_heads
        self.eps = config.rms_norm_eps
        self.embed = inner.embed_tokens.weight
        self.lm_head = _project({"lm_head": model.lm_head}, ("lm_head",), self.quantize)
        self.norm = inner.norm.weight
        self.layers = []
        for layer in inner.layers:
            linears = {
                "q_proj": layer.self_attn.q_proj,
                "k_proj": layer.self_attn.k_proj,
                "v_proj": layer.self_attn.v_proj,
                "o_proj": layer.self_attn.o_proj,
                "gate_proj": layer.mlp.gate_proj,
                "up_proj": layer.mlp.up_proj,
                "down_proj": layer.mlp.down_proj,
            }
            self.layers.append(
                _Layer(
                    ln_attn=layer.input_layernorm.weight,
                    ln_mlp=layer.post_attention_layernorm.weight,
                    linears=linears,
                    qkv=_project(linears, ("q_proj", "k_proj", "v_proj"), self.quantize),
                    o=_project(linears, ("o_proj",), self.quantize),
                    gate_up=_project(linears, ("gate_proj", "up_proj"), self.quantize),
                    down=_project(linears, ("down_proj",), self.quantize),
                    q_norm=_weight(getattr(layer.self_attn, "q_norm", None)),
                    k_norm=_weight(getattr(layer.self_attn, "k_norm", None)),
                )
            )
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

    def _projections(self) -> list[_Projection]:
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
        rows = _group_rows([(p.lora, span) for p, span in zip(prompts, spans)], device)
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
        projection: _Projection,
        index: int,
        lora: LoraRows | None,
        quantized: bool,
        split: bool = True,
    ) -> list[Tensor]:
        """The outputs of the projection's modules, each with its own LoRA delta (or, with
        `split` False, the one matrix holding them side by side)."""
        y = projection(x, quantized)
        if lora is not None:
            _add_lora(y, x, index, projection.parts, lora, self.native)
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


def _group_rows(
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


def _add_lora(
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


def _project(linears: dict[str, Any], names: tuple[str, ...], quantize: str | None) -> _Projection:
    parts, start = [], 0
    for name in names:
        end = start + linears[name].weight.shape[0]
        parts.append((name, start, end))
        start = end
    return _Projection([linears[name] for name in names], parts, quantize)


def _check_quantize(quantize: str | None, model: Any) -> str | None:
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


def _cached(dims: tuple, keys: bool) -> tuple:
    """(position, dim) sizes or indices in a cache's layout: keys keep positions last."""
    return dims[::-1] if keys else dims


def _weight(module: Any) -> Tensor | None:
    return None if module is None else module.weight


def _rope(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """Rotary embedding on the last dim, rotate-half layout; `signed_sin`'s first half negated."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)
