"""The embedded engine's front door: `EmbeddedBackend`, an in-process PyTorch engine.

A request's path: `generate`/`stream` check it and turn its messages into prompt ids here
(`sequence.Request`); the scheduler's thread (`scheduler`) prefills it into the KV cache
(`forward`, reusing cached prefixes: `prefix_cache`), decodes a token per step for every
running sequence at once, samples (`sampling`) and detokenizes it (`output`); tokens come
back through an asyncio queue. LoRA adapters (`lora`) and base weights change between
decode steps. The model comes from `loading`; the matmuls and attention run in `kernels`.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import contextlib
import hashlib
import json
import threading
import weakref
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from masenvs.cache import DEFAULT_MODEL
from masenvs.engine.args import EngineArgs
from masenvs.engine.forward import LlamaForward
from masenvs.engine.loading import LoadedModel, engine_dtype, load_model
from masenvs.engine.lora import LoraAdapter, lora_from_state_dict, lora_scale, read_peft_dir
from masenvs.engine.omp import run_off_thread
from masenvs.engine.protocol import (
    BackendError,
    GenerateRequest,
    Generation,
    SamplingParams,
    StreamDelta,
)
from masenvs.engine.scheduler import AdapterUpdate, Scheduler
from masenvs.engine.sequence import Request, Sequence
from masenvs.sampling_args import SamplingArgs

BASE_NAMES = ("", "base")
MAX_TOP_LOGPROBS = 20

# Engines not shut down by their owner are stopped at interpreter exit: a daemon engine
# thread still alive (with its OpenMP pool) when the runtime tears down aborts the process
# ("terminate called without an active exception", exit 134).
_LIVE: weakref.WeakSet[EmbeddedBackend] = weakref.WeakSet()


@atexit.register
def _shutdown_live_engines() -> None:
    for engine in list(_LIVE):
        engine.shutdown()


class EmbeddedBackend:
    """Serves a transformers causal LM and its LoRA adapters from a background thread.

    Built from `EngineArgs` (`from_args`, or `from_spec` with its fields); its
    `batch_invariant` True makes each answer independent of the requests batched with it
    (an error where it cannot run); 'auto' turns it on where that changes no weight (see
    `LlamaForward`); `forward.batch_invariant` says which.
    """

    def __init__(self, loaded: LoadedModel, args: EngineArgs | None = None) -> None:
        """Serve `loaded` with the serving options of `args` (its device and dtype matter
        only to `from_args`, which loads the model by them)."""
        args = args or EngineArgs()
        self.args = args
        if args.threads is not None:
            torch.set_num_threads(args.threads)
        self.num_threads = torch.get_num_threads()
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.name = loaded.name
        self.max_batch_size = rows = args.max_batch_size
        self.max_model_len = min(args.max_model_len or loaded.context_length, loaded.context_length)
        # No token spans more characters than the vocabulary's longest, so a prompt longer
        # than this cannot fit the context: it is refused before the tokenizer (whose memory
        # grows ~75x the text) ever sees it.
        self.max_prompt_chars = _longest_token(self.tokenizer) * self.max_model_len
        # Rows 0..max_batch_size-1 hold running sequences; the rows after them keep the
        # KV of recently finished sequences, so a prompt that extends one skips its prefill.
        cached = args.prefix_cache_rows
        try:
            self.forward = LlamaForward(
                self.model, rows + cached, self.max_model_len, args.quantize, args.batch_invariant
            )
        except ValueError as exc:
            raise BackendError(str(exc)) from exc
        self.eos_token_ids = _eos_ids(loaded)
        self._tokenizer_id = _fingerprint(self.tokenizer)
        self.scheduler = Scheduler(
            self.forward,
            self.tokenizer,
            max_batch_size=rows,
            prefix_rows=range(rows, rows + cached),
            num_threads=self.num_threads,
            single_thread_rows=args.single_thread_rows,
        )
        self.stats = self.scheduler.stats
        self.scheduler.start()
        _LIVE.add(self)

    @classmethod
    def from_args(cls, model: str, args: EngineArgs) -> EmbeddedBackend:
        """Load `model` (see `load_model`) on `args.device` in `args.dtype` ('auto':
        `engine_dtype`) and serve it as `args` say.

        Loading runs on a short-lived thread: the calling thread then never starts an
        OpenMP pool of its own, so the engine thread's pool can be the process's only one
        (see `omp`), which makes every decode step cheaper.
        """
        dtype = engine_dtype(args.device) if args.dtype == "auto" else args.dtype
        return run_off_thread(lambda: cls(load_model(model, device=args.device, dtype=dtype), args))

    @classmethod
    def from_spec(cls, spec: str = DEFAULT_MODEL, **options: Any) -> EmbeddedBackend:
        """`from_args(spec, EngineArgs(**options))`: `options` are `EngineArgs` fields
        (max_batch_size=8, dtype="float32", ...)."""
        return cls.from_args(spec, EngineArgs(**options))

    @property
    def single_thread_rows(self) -> int | None:
        """Decode steps of at most this many rows run on one thread (None until measured)."""
        return self.scheduler.single_thread_rows

    # The scheduler's state under the names it had when the engine was one class.
    @property
    def _adapters(self) -> dict[str, LoraAdapter]:
        return self.scheduler.adapters

    @property
    def _waiting(self) -> collections.deque[Request]:
        return self.scheduler.waiting

    @property
    def _running(self) -> list[Sequence]:
        return self.scheduler.running

    @property
    def _wakeup(self) -> threading.Condition:
        return self.scheduler.wakeup

    # ---- Backend protocol ----------------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> Generation:
        async with contextlib.aclosing(self._run(request, streaming=False)) as items:
            async for item in items:
                if isinstance(item, Generation):
                    return item
        raise BackendError(
            "The embedded engine ended a request without a result.", 500, "engine_error"
        )

    def stream(self, request: GenerateRequest) -> AsyncIterator[StreamDelta | Generation]:
        """Yield deltas as tokens are produced, then the full `Generation` last."""
        return self._run(request, streaming=True)

    def model_names(self) -> list[str]:
        return [self.name, *self.scheduler.adapters]

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)

    def tokenizer_id(self) -> str:
        return self._tokenizer_id

    async def load_adapter(self, name: str, path: str) -> None:
        """Load or replace a LoRA adapter from a peft directory."""
        state_dict, config = await asyncio.to_thread(read_peft_dir, Path(path))
        await asyncio.to_thread(
            self.add_adapter,
            name,
            state_dict,
            rank=int(config["r"]),
            alpha=float(config.get("lora_alpha", config["r"])),
            use_rslora=bool(config.get("use_rslora", False)),
        )

    async def close(self) -> None:
        await asyncio.to_thread(self.shutdown)

    # ---- adapters, synchronous (for the trainer) ----------------------------------------------

    def add_adapter(
        self,
        name: str,
        state_dict: Mapping[str, Tensor],
        *,
        rank: int,
        alpha: float,
        use_rslora: bool = False,
    ) -> None:
        """Add adapter `name` from a peft LoRA state dict, or replace it if it exists."""
        if name in BASE_NAMES or name == self.name:
            raise BackendError(f"{name!r} names the base model; pick another adapter name.")
        try:
            adapter = lora_from_state_dict(
                name,
                dict(state_dict),
                rank=rank,
                scale=lora_scale(rank, alpha, use_rslora),
                device=self.forward.device,
                dtype=self.forward.dtype,
            )
        except ValueError as exc:
            raise BackendError(str(exc)) from exc
        self._check_adapter_shapes(adapter)
        self.scheduler.apply(AdapterUpdate(name, adapter, in_place=False))

    def set_adapter_weights(self, name: str, state_dict: Mapping[str, Tensor]) -> None:
        """Replace adapter `name`'s weights in place (same rank and alpha), between decode steps."""
        current = self.scheduler.adapters.get(name)
        if current is None:
            raise BackendError(
                f"No adapter named {name!r}; add it first with add_adapter.", 404, "model_not_found"
            )
        try:
            adapter = lora_from_state_dict(
                name,
                dict(state_dict),
                rank=current.rank,
                scale=current.scale,
                device=self.forward.device,
                dtype=self.forward.dtype,
            )
        except ValueError as exc:
            raise BackendError(str(exc)) from exc
        self._check_adapter_shapes(adapter)
        self.scheduler.apply(AdapterUpdate(name, adapter, in_place=True))

    def set_base_weights(self, model_name: str, state_dict: Mapping[str, Tensor]) -> None:
        """Replace base-model weights in place (full fine-tuning), between decode steps.

        `state_dict` is keyed like the model's safetensors (`model.layers.0.mlp.up_proj.weight`;
        a subset is fine) and is cast to the engine's dtype. The concatenated and quantized
        copies the forward pass reads are rebuilt from the new weights at their next use, and
        cached prefixes are forgotten. With quantize 'auto', matrices that are no longer
        exactly 4- or 8-bit after training are then read dense.
        """
        if model_name not in BASE_NAMES and model_name != self.name:
            raise BackendError(
                f"{model_name!r} is not this engine's base model {self.name!r}.",
                404,
                "model_not_found",
            )
        params = self.model.state_dict(keep_vars=True)
        unknown = sorted(set(state_dict) - set(params))
        if unknown:
            raise BackendError(
                f"The weights {unknown[:3]} are not in {self.name} (a different architecture, "
                "or peft names? pass names as in the model's safetensors)."
            )
        pairs = []
        for name, value in state_dict.items():
            if value.shape != params[name].shape:
                raise BackendError(
                    f"{name} has shape {tuple(value.shape)}; {self.name} needs "
                    f"{tuple(params[name].shape)}."
                )
            pairs.append((params[name], value))
        self.scheduler.apply(AdapterUpdate(None, None, in_place=True, base_weights=pairs))

    def reset_prefix_cache(self) -> None:
        """Forget cached prefixes; call after changing the base model's weights in place."""
        self.scheduler.apply(AdapterUpdate(None, None, in_place=False))

    def remove_adapter(self, name: str) -> None:
        """Forget adapter `name`; requests already running with it finish with its weights."""
        if name not in self.scheduler.adapters:
            raise BackendError(f"No adapter named {name!r}.", 404, "model_not_found")
        self.scheduler.apply(AdapterUpdate(name, None, in_place=False))

    def shutdown(self) -> None:
        """Stop the engine thread; waiting and running requests fail with status 503."""
        self.scheduler.close()

    # ---- request intake (event-loop side) ----------------------------------------------------

    async def _run(
        self, request: GenerateRequest, streaming: bool
    ) -> AsyncIterator[StreamDelta | Generation]:
        job = self._prepare(request, streaming)
        self.scheduler.submit(job)
        try:
            while True:
                item = await job.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if isinstance(item, Generation):
                    return
        finally:
            job.cancelled = True  # the engine drops the sequences if they still run

    def _prepare(self, request: GenerateRequest, streaming: bool) -> Request:
        params = request.params
        _validate(params, self.max_batch_size)
        adapter = self._resolve(request.model)
        prompt_ids = self._prompt_ids(request)
        room = self.max_model_len - len(prompt_ids)
        if room < 1:
            raise BackendError(
                f"The prompt has {len(prompt_ids)} tokens but the context window is "
                f"{self.max_model_len}; shorten the prompt.",
                400,
                "context_length_exceeded",
            )
        return Request(
            request=request,
            prompt_ids=prompt_ids,
            adapter=adapter,
            model_name=request.model or self.name,
            stops=[s for s in params.stop if s],
            stop_token_ids=frozenset(params.stop_token_ids)
            | (frozenset() if params.ignore_eos else self.eos_token_ids),
            max_tokens=min(params.max_tokens, room),  # clamped to the context window
            streaming=streaming,
            loop=asyncio.get_running_loop(),
            queue=asyncio.Queue(),
        )

    def _resolve(self, model: str) -> LoraAdapter | None:
        if model in BASE_NAMES or model == self.name:
            return None
        adapter = self.scheduler.adapters.get(model)
        if adapter is None:
            raise BackendError(
                f"The model {model!r} does not exist; this backend serves {self.model_names()}.",
                404,
                "model_not_found",
            )
        return adapter

    def _prompt_ids(self, request: GenerateRequest) -> list[int]:
        if (request.messages is None) == (request.prompt is None):
            raise BackendError("Give either chat messages or a prompt, not both or neither.")
        chars = _text_chars([request.messages, request.tools, request.prompt])
        if chars > self.max_prompt_chars:
            raise BackendError(
                f"The prompt has {chars} characters, more than fit the context window of "
                f"{self.max_model_len} tokens ({self.max_prompt_chars} characters at most); "
                "shorten the prompt.",
                400,
                "context_length_exceeded",
            )
        if request.messages is not None:
            if not request.messages:
                raise BackendError("messages is empty; give at least one message.")
            try:
                ids = self.tokenizer.apply_chat_template(
                    [_plain_message(m) for m in request.messages],
                    tools=request.tools,
                    add_generation_prompt=True,
                    tokenize=True,
                    return_dict=False,
                    **request.chat_template_kwargs,
                )
            except Exception as exc:  # jinja errors of any kind: the template rejected the input
                raise BackendError(
                    f"The chat template cannot render these messages: {exc}"
                ) from exc
            return list(ids)
        if isinstance(request.prompt, str):
            ids = self.tokenizer(request.prompt)["input_ids"]
        else:
            ids = list(request.prompt)
            vocab = len(self.tokenizer)
            if not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
                raise BackendError(f"Prompt token ids must be integers in [0, {vocab}).")
        if not ids:
            raise BackendError("The prompt is empty; give at least one token.")
        return ids

    def _check_adapter_shapes(self, adapter: LoraAdapter) -> None:
        layers = self.forward.layers
        for (index, module), (a, b) in adapter.weights.items():
            if index >= len(layers):
                raise BackendError(
                    f"Adapter {adapter.name!r} has layer {index}; the model has {len(layers)}."
                )
            weight = layers[index].linears[module].weight
            if (
                a.shape[1] != weight.shape[1]
                or b.shape[0] != weight.shape[0]
                or a.shape[0] != b.shape[1]
            ):
                raise BackendError(
                    f"Adapter {adapter.name!r} does not fit {module} of layer {index}: "
                    f"A {tuple(a.shape)}, B {tuple(b.shape)}, weight {tuple(weight.shape)}."
                )


def _validate(params: SamplingParams, max_batch_size: int) -> None:
    problems = SamplingArgs.problems(params)  # temperature, top_p, ...: their declared bounds
    if not 1 <= params.n <= max_batch_size:
        problems.append(f"n must be between 1 and {max_batch_size}")
    if not 0 <= params.top_logprobs <= MAX_TOP_LOGPROBS:
        problems.append(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}")
    if problems:
        raise BackendError("; ".join(problems) + ".")


def _longest_token(tokenizer: Any) -> int:
    """Characters of the vocabulary's longest token (special tokens included)."""
    return max((len(token) for token in tokenizer.get_vocab()), default=1) or 1


def _text_chars(value: Any) -> int:
    """Characters of the strings in `value` (nested lists and dicts; a token id counts 1)."""
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif item is not None:
            total += 1
    return total


def _plain_message(message: dict[str, Any]) -> dict[str, Any]:
    """OpenAI content parts ([{"type": "text", ...}]) become one string for the template."""
    content = message.get("content")
    if isinstance(content, list):
        text = "".join(part.get("text", "") for part in content if isinstance(part, dict))
        return {**message, "content": text}
    if content is None:
        return {**message, "content": ""}
    return message


def _eos_ids(loaded: LoadedModel) -> frozenset[int]:
    ids: set[int] = set()
    for source in (loaded.model.generation_config, loaded.model.config):
        eos = getattr(source, "eos_token_id", None)
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if loaded.tokenizer.eos_token_id is not None:
        ids.add(loaded.tokenizer.eos_token_id)
    return frozenset(ids)


def _fingerprint(tokenizer: Any) -> str:
    """A hash of the vocabulary, merges and chat template: equal ids mean interchangeable ids."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    body = (
        backend.to_str()
        if backend is not None
        else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    )
    digest = hashlib.sha256(body.encode())
    digest.update((tokenizer.chat_template or "").encode())
    return f"sha256:{digest.hexdigest()[:16]}"
