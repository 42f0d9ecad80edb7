"""The embedded backend: an in-process PyTorch engine with continuous batching.

One background thread owns the model. Between decode steps it admits waiting requests
(prefilling their prompts into free KV-cache slots) and applies adapter updates; every
step then decodes one token for all running sequences at once, whatever their adapter.
Requests come in from asyncio code and get their tokens back through asyncio queues.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import contextlib
import hashlib
import json
import secrets
import threading
import weakref
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from masenvs.engine import kernels
from masenvs.engine.forward import (
    LlamaForward,
    LoraAdapter,
    LoraRows,
    Prefill,
    lora_from_state_dict,
    lora_scale,
)
from masenvs.engine.loading import LoadedModel, engine_dtype, load_model
from masenvs.engine.omp import (
    run_off_thread,
    set_thread_local_threads,
    wakeups_are_costly,
)
from masenvs.engine.protocol import (
    BackendError,
    Completion,
    GenerateRequest,
    Generation,
    SamplingParams,
    StreamDelta,
)
from masenvs.engine.sampling import RowSampling, sample

BASE_NAMES = ("", "base")
MAX_TOP_LOGPROBS = 20
MIN_PREFIX_HIT = 16  # shorter shared prefixes are cheaper to recompute than to copy
PREFILL_TOKENS = 2048  # prompt tokens per prefill pass; bounds the attention mask
SINGLE_THREAD_ROWS = 4  # decode steps this small run on one thread where wake-ups are costly


@dataclass(eq=False)
class _Request:
    request: GenerateRequest
    prompt_ids: list[int]
    adapter: LoraAdapter | None
    model_name: str
    stops: list[str]
    stop_token_ids: frozenset[int]
    max_tokens: int
    streaming: bool
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    sequences: list[_Sequence] = field(default_factory=list)
    cancelled: bool = False


@dataclass(eq=False)
class _Sequence:
    """One choice of a request while it decodes."""

    request: _Request
    index: int
    sampling: RowSampling
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text: str = ""  # decode of token_ids, kept current only when stop strings need it
    cached: int = 0  # cache positions holding this sequence's prompt and fed tokens
    sent_tokens: int = 0  # streamed so far
    sent_text: str = ""

    @property
    def length(self) -> int:
        """Tokens in the KV cache once the last sampled token has been fed."""
        return len(self.request.prompt_ids) + len(self.token_ids)


@dataclass(eq=False)
class _Prefix:
    """A cache row kept after its sequence finished: the KV of `tokens` under `adapter`."""

    tokens: list[int]
    adapter: LoraAdapter | None
    last_used: int  # decode step, for least-recently-used eviction


@dataclass
class EngineStats:
    """Counters since start: how much work ran and how well it batched."""

    requests: int = 0
    decode_steps: int = 0
    generated_tokens: int = 0
    prompt_tokens: int = 0
    prefilled_tokens: int = 0  # prompt tokens actually run (identical prompts run once)
    prefix_hit_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    peak_batch: int = 0  # most sequences decoded in one step


@dataclass
class _AdapterUpdate:
    name: str | None  # None: only empty the prefix cache
    adapter: LoraAdapter | None  # None removes the adapter
    in_place: bool
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    # name None: (engine parameter, new value) pairs copied into the base model's weights
    base_weights: list[tuple[Tensor, Tensor]] = field(default_factory=list)


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

    `batch_invariant` True makes each answer independent of the requests batched with it
    (an error where it cannot run); 'auto' turns it on where that changes no weight (see
    `LlamaForward`); `forward.batch_invariant` says which.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        max_batch_size: int = 32,
        max_model_len: int | None = None,
        num_threads: int | None = None,
        prefix_cache_rows: int = 4,
        quantize: str | None = "auto",
        single_thread_rows: int | None = None,
        batch_invariant: bool | str = False,
    ) -> None:
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        self.num_threads = torch.get_num_threads()
        # None: measured on the engine thread when it starts (see `_loop`).
        self.single_thread_rows = single_thread_rows
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.name = loaded.name
        self.max_batch_size = max_batch_size
        self.max_model_len = min(max_model_len or loaded.context_length, loaded.context_length)
        # No token spans more characters than the vocabulary's longest, so a prompt longer
        # than this cannot fit the context: it is refused before the tokenizer (whose memory
        # grows ~75x the text) ever sees it.
        self.max_prompt_chars = _longest_token(self.tokenizer) * self.max_model_len
        # Rows 0..max_batch_size-1 hold running sequences; the rows after them keep the
        # KV of recently finished sequences, so a prompt that extends one skips its prefill.
        try:
            self.forward = LlamaForward(
                self.model,
                max_batch_size + prefix_cache_rows,
                self.max_model_len,
                quantize,
                batch_invariant,
            )
        except ValueError as exc:
            raise BackendError(str(exc)) from exc
        self._prefix_rows = range(max_batch_size, max_batch_size + prefix_cache_rows)
        self._prefixes: dict[int, _Prefix] = {}  # cache row -> what it holds
        self.eos_token_ids = _eos_ids(loaded)
        self._tokenizer_id = _fingerprint(self.tokenizer)
        self._adapters: dict[str, LoraAdapter] = {}
        self._waiting: collections.deque[_Request] = collections.deque()
        self._updates: collections.deque[_AdapterUpdate] = collections.deque()
        self._running: list[_Sequence] = []  # row i of the KV cache holds _running[i]
        self._wakeup = threading.Condition()
        self._closed = False
        self.stats = EngineStats()
        self._thread = threading.Thread(target=self._loop, name="masenvs-engine", daemon=True)
        self._thread.start()
        _LIVE.add(self)

    @classmethod
    def from_spec(
        cls,
        spec: str = "smollm2-135m",
        *,
        device: str = "cpu",
        dtype: torch.dtype | str | None = None,
        **kwargs: Any,
    ) -> EmbeddedBackend:
        """Load `spec` (see `load_model`) and serve it; `dtype` None or "auto" picks
        `engine_dtype`.

        Loading runs on a short-lived thread: the calling thread then never starts an
        OpenMP pool of its own, so the engine thread's pool can be the process's only one
        (see `omp`), which makes every decode step cheaper.
        """
        return run_off_thread(
            lambda: cls(
                load_model(
                    spec,
                    device=device,
                    dtype=engine_dtype(device) if dtype in (None, "auto") else dtype,
                ),
                **kwargs,
            )
        )

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
        return [self.name, *self._adapters]

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)

    def tokenizer_id(self) -> str:
        return self._tokenizer_id

    async def load_adapter(self, name: str, path: str) -> None:
        """Load or replace a LoRA adapter from a peft directory."""
        state_dict, config = await asyncio.to_thread(_read_peft_dir, Path(path))
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
        self._apply(_AdapterUpdate(name, adapter, in_place=False))

    def set_adapter_weights(self, name: str, state_dict: Mapping[str, Tensor]) -> None:
        """Replace adapter `name`'s weights in place (same rank and alpha), between decode steps."""
        current = self._adapters.get(name)
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
        self._apply(_AdapterUpdate(name, adapter, in_place=True))

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
        self._apply(_AdapterUpdate(None, None, in_place=True, base_weights=pairs))

    def reset_prefix_cache(self) -> None:
        """Forget cached prefixes; call after changing the base model's weights in place."""
        self._apply(_AdapterUpdate(None, None, in_place=False))

    def remove_adapter(self, name: str) -> None:
        """Forget adapter `name`; requests already running with it finish with its weights."""
        if name not in self._adapters:
            raise BackendError(f"No adapter named {name!r}.", 404, "model_not_found")
        self._apply(_AdapterUpdate(name, None, in_place=False))

    def shutdown(self) -> None:
        """Stop the engine thread; waiting and running requests fail with status 503."""
        with self._wakeup:
            self._closed = True
            self._wakeup.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join()

    # ---- request intake (event-loop side) ----------------------------------------------------

    async def _run(
        self, request: GenerateRequest, streaming: bool
    ) -> AsyncIterator[StreamDelta | Generation]:
        job = self._prepare(request, streaming)
        with self._wakeup:
            if self._closed:
                raise BackendError("The embedded engine is shut down.", 503, "engine_closed")
            self._waiting.append(job)
            self._wakeup.notify()
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

    def _prepare(self, request: GenerateRequest, streaming: bool) -> _Request:
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
        return _Request(
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
        adapter = self._adapters.get(model)
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

    def _apply(self, update: _AdapterUpdate) -> None:
        with self._wakeup:
            if self._closed:
                raise BackendError("The embedded engine is shut down.", 503, "engine_closed")
            self._updates.append(update)
            self._wakeup.notify()
        update.done.wait()
        if update.error is not None:
            raise update.error

    # ---- engine thread ---------------------------------------------------------------------

    def _loop(self) -> None:
        threads = self.num_threads
        if self.single_thread_rows is None:
            costly = self.num_threads > 1 and wakeups_are_costly(self.num_threads)
            self.single_thread_rows = SINGLE_THREAD_ROWS if costly else 0
        while True:
            with self._wakeup:
                while not (self._closed or self._waiting or self._updates or self._running):
                    self._wakeup.wait()
                if self._closed:
                    break
                updates = list(self._updates)
                self._updates.clear()
            for update in updates:
                try:
                    self._apply_update(update)
                except Exception as exc:
                    update.error = BackendError(f"Cannot apply the adapter update: {exc!r}", 500)
                finally:
                    update.done.set()
            try:
                threads = self._use_threads(self.num_threads, threads)
                self._admit()
                if self._running:
                    small = len(self._running) <= self.single_thread_rows
                    threads = self._use_threads(1 if small else self.num_threads, threads)
                    self._step()
            except Exception as exc:  # a bug or OOM: fail what is running, keep serving
                error = BackendError(f"The embedded engine failed: {exc!r}", 500, "engine_error")
                for seq in self._running:
                    _send(seq.request, error)
                self._running.clear()
        self._fail_all(BackendError("The embedded engine is shut down.", 503, "engine_closed"))

    @staticmethod
    def _use_threads(wanted: int, current: int) -> int:
        """Set this thread's OpenMP thread count (see `omp`); the count now in force."""
        if wanted == current or not set_thread_local_threads(wanted):
            return current
        return wanted

    def _fail_all(self, error: BackendError) -> None:
        with self._wakeup:
            waiting = list(self._waiting)
            self._waiting.clear()
            for update in self._updates:
                update.error = error
                update.done.set()
            self._updates.clear()
        for job in waiting:
            _send(job, error)
        for seq in self._running:
            _send(seq.request, error)
        self._running.clear()

    def _apply_update(self, update: _AdapterUpdate) -> None:
        # Cached prefixes computed with the old weights are stale.
        stale = [
            row
            for row, prefix in self._prefixes.items()
            if update.name is None
            or (prefix.adapter is not None and prefix.adapter.name == update.name)
        ]
        for row in stale:
            del self._prefixes[row]
        if update.name is None:
            with torch.no_grad():  # the copy bumps each weight's version: see _Projection
                for param, value in update.base_weights:
                    param.copy_(value)
            return
        current = self._adapters.get(update.name)
        if update.adapter is None:
            self._adapters.pop(update.name, None)
        elif update.in_place and current is not None and _same_shapes(current, update.adapter):
            for key, (a, b) in update.adapter.weights.items():
                current.weights[key][0].copy_(a)
                current.weights[key][1].copy_(b)
            current.version += 1
        else:
            self._adapters[update.name] = update.adapter

    def _admit(self) -> None:
        """Prefill waiting requests, several per forward pass, while cache rows are free."""
        jobs: list[_Request] = []
        with self._wakeup:
            rows, tokens = len(self._running), 0
            while self._waiting:
                job = self._waiting[0]
                if job.cancelled:
                    self._waiting.popleft()
                    continue
                size = len(job.prompt_ids)
                if rows + job.request.params.n > self.max_batch_size or (
                    jobs and tokens + size > PREFILL_TOKENS
                ):
                    break
                jobs.append(self._waiting.popleft())
                rows, tokens = rows + job.request.params.n, tokens + size
        if not jobs:
            return
        try:
            self._prefill(jobs)
        except Exception as exc:
            failed = set(map(id, jobs))
            self._running = [seq for seq in self._running if id(seq.request) not in failed]
            for job in jobs:
                _send(
                    job, BackendError(f"The embedded engine failed: {exc!r}", 500, "engine_error")
                )

    def _prefill(self, jobs: list[_Request]) -> None:
        """Prefill the prompts into new cache rows, then sample each choice's first token.

        Identical prompts (same adapter) run once: the n choices of a request, and the K
        separate requests a GRPO group often sends, copy one prefilled cache row. A prompt
        that extends a cached prefix (an agent's next turn) copies that prefix's KV and
        runs only the rest.
        """
        first_rows, row = [], len(self._running)
        for job in jobs:
            first_rows.append(row)
            row += job.request.params.n
        source: dict[tuple[int, tuple[int, ...]], int] = {}  # (adapter, prompt) -> unique index
        unique: list[Prefill] = []
        prompts: list[_Request] = []  # the job behind each unique prefill
        which: list[int] = []
        for job, first in zip(jobs, first_rows):
            key = (id(job.adapter), tuple(job.prompt_ids))
            if key not in source:
                source[key] = len(unique)
                unique.append(self._reuse_prefix(first, job))
                prompts.append(job)
            which.append(source[key])
        logits = self._run_shared_prefills(unique, prompts)
        choice_logits = []
        for job, first, index in zip(jobs, first_rows, which):
            params = job.request.params
            length = len(job.prompt_ids)
            for extra in range(params.n):
                if first + extra != unique[index].slot:
                    self.forward.copy_slot(unique[index].slot, first + extra, length)
            seeds = _choice_seeds(params.seed, params.n)
            for choice in range(params.n):
                generator = torch.Generator().manual_seed(seeds[choice])
                sampling = RowSampling(
                    params.temperature, params.top_p, params.top_k, params.top_logprobs, generator
                )
                if params.repetition_penalty != 1.0:  # over the prompt and the answer
                    sampling.repetition_penalty = params.repetition_penalty
                    sampling.seen = set(job.prompt_ids)
                job.sequences.append(_Sequence(job, choice, sampling, cached=length))
            self._running.extend(job.sequences)
            choice_logits.append(logits[index : index + 1].expand(params.n, -1))
            self.stats.requests += 1
            self.stats.prompt_tokens += length
            if first == unique[index].slot:
                self.stats.prefilled_tokens += unique[index].tokens.numel()
                self.stats.prefix_hit_tokens += unique[index].start
        self._accept([seq for job in jobs for seq in job.sequences], torch.cat(choice_logits))

    def _reuse_prefix(self, row: int, job: _Request) -> Prefill:
        """The prefill of `job` into `row`, starting after the longest cached prefix of its prompt."""
        prompt = job.prompt_ids
        best_row, best = None, 0
        for prefix_row, prefix in self._prefixes.items():
            if prefix.adapter is not job.adapter:
                continue
            shared = _common_prefix(prefix.tokens, prompt)
            if shared > best:
                best_row, best = prefix_row, shared
        best = min(best, len(prompt) - 1)  # the last prompt token must run to give logits
        if best_row is None or best < MIN_PREFIX_HIT:
            return Prefill(row, torch.tensor(prompt, dtype=torch.long), 0, job.adapter)
        self.forward.copy_slot(best_row, row, best)
        self._prefixes[best_row].last_used = self.stats.decode_steps
        return Prefill(row, torch.tensor(prompt[best:], dtype=torch.long), best, job.adapter)

    def _run_shared_prefills(self, prefills: list[Prefill], jobs: list[_Request]) -> Tensor:
        """`_run_prefills`, with prompts that share a long prefix running it once.

        Different prompts arriving together often share most of their tokens: the K branches
        of a later agent's turn differ only in the earlier agent's answer, and validation
        tasks share the system prompt. The first prompt of each such family (the leader)
        prefills whole in a first pass; the others copy the common prefix's KV from the
        leader's row and prefill only their own tail in a second pass.
        """
        followers: dict[int, tuple[int, int]] = {}  # index -> (leader index, shared tokens)
        leaders: list[int] = []
        for i, (prefill, job) in enumerate(zip(prefills, jobs)):
            best, best_shared = None, prefill.start
            for j in leaders:
                if jobs[j].adapter is not job.adapter:
                    continue
                shared = min(
                    _common_prefix(jobs[j].prompt_ids, job.prompt_ids), len(job.prompt_ids) - 1
                )
                if shared > best_shared:
                    best, best_shared = j, shared
            if best is not None and best_shared - prefill.start >= MIN_PREFIX_HIT:
                followers[i] = (best, best_shared)
            else:
                leaders.append(i)
        if not followers:
            return self._run_prefills(prefills)
        logits: list[Tensor] = [torch.empty(0)] * len(prefills)
        for i, row in zip(leaders, self._run_prefills([prefills[i] for i in leaders])):
            logits[i] = row.unsqueeze(0)
        tails = []
        for i, (leader, shared) in followers.items():
            prefill = prefills[i]
            self.forward.copy_slot(prefills[leader].slot, prefill.slot, shared)
            tokens = torch.tensor(jobs[i].prompt_ids[shared:], dtype=torch.long)
            tails.append(Prefill(prefill.slot, tokens, shared, prefill.lora))
            prefills[i] = tails[-1]  # the stats count what really ran
        for i, row in zip(followers, self._run_prefills(tails)):
            logits[i] = row.unsqueeze(0)
        return torch.cat(logits)

    def _run_prefills(self, prefills: list[Prefill]) -> Tensor:
        """Logits after each prompt [n, V]: prompts up to PREFILL_TOKENS long packed into one
        pass, longer ones in chunks of PREFILL_TOKENS."""
        logits: list[Tensor | None] = [None] * len(prefills)
        packed = [i for i, p in enumerate(prefills) if p.tokens.numel() <= PREFILL_TOKENS]
        if packed:
            rows = self.forward.prefill([prefills[i] for i in packed])
            for row, i in enumerate(packed):
                logits[i] = rows[row : row + 1]
        for i, p in enumerate(prefills):
            if logits[i] is not None:
                continue
            for begin in range(0, p.tokens.numel(), PREFILL_TOKENS):
                chunk = p.tokens[begin : begin + PREFILL_TOKENS]
                logits[i] = self.forward.prefill([Prefill(p.slot, chunk, p.start + begin, p.lora)])
        return torch.cat(logits)

    def _step(self) -> None:
        """Decode one token for every running sequence."""
        running = self._running
        for seq in running:
            seq.cached = seq.length  # this step feeds the last sampled token
        last = torch.tensor([seq.token_ids[-1] for seq in running], dtype=torch.long)
        positions = torch.tensor([seq.length - 1 for seq in running], dtype=torch.long)
        logits = self.forward.decode(
            last.to(self.forward.device), positions.to(self.forward.device), _lora_rows(running)
        )
        self.stats.decode_steps += 1
        self.stats.peak_batch = max(self.stats.peak_batch, len(running))
        self._accept(list(running), logits)

    def _accept(self, sequences: list[_Sequence], logits: Tensor) -> None:
        """Record the sampled tokens, stream them, and retire finished sequences."""
        totals = kernels.logsumexp(logits) if self.forward.batch_invariant else None
        drawn = sample(logits, [seq.sampling for seq in sequences], totals)
        for row, seq in enumerate(sequences):
            job = seq.request
            seq.token_ids.append(drawn.tokens[row])
            if seq.sampling.repetition_penalty != 1.0:
                seq.sampling.seen.add(drawn.tokens[row])
            self.stats.generated_tokens += 1
            seq.logprobs.append(drawn.logprobs[row])
            if seq.sampling.top_logprobs:
                seq.top_logprobs.append(drawn.top_logprobs[row])
            self._check_finished(seq, job)
            if job.streaming and not job.cancelled:
                self._stream(seq)
        finished = [seq for seq in self._running if seq.finish_reason or seq.request.cancelled]
        if finished:
            self._retire(finished)

    def _check_finished(self, seq: _Sequence, job: _Request) -> None:
        token = seq.token_ids[-1]
        if token in job.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
            return
        if job.stops:
            self._check_stop_strings(seq, job)
            if seq.finish_reason:
                return
        if len(seq.token_ids) >= job.max_tokens:
            seq.finish_reason = "length"

    def _check_stop_strings(self, seq: _Sequence, job: _Request) -> None:
        searched = len(seq.text)
        seq.text = self.tokenizer.decode(seq.token_ids)
        longest = max(len(s) for s in job.stops)
        begin = max(0, searched - longest + 1)
        hits = [(seq.text.find(s, begin), s) for s in job.stops]
        hits = [(pos, s) for pos, s in hits if pos >= 0]
        if not hits:
            return
        cut, stop = min(hits)
        # Keep the longest run of whole tokens whose text ends before the stop string, so
        # that token ids and text stay consistent (a token straddling it is dropped).
        keep = len(seq.token_ids) - 1
        while keep > 0:
            text = self.tokenizer.decode(seq.token_ids[:keep])
            if len(text) <= cut and seq.text.startswith(text) and not text.endswith("\ufffd"):
                break
            keep -= 1
        del seq.token_ids[keep:], seq.logprobs[keep:]
        del seq.top_logprobs[keep:]
        seq.text = self.tokenizer.decode(seq.token_ids)
        seq.finish_reason, seq.stop_reason = "stop", stop

    def _stream(self, seq: _Sequence) -> None:
        """Send the tokens that can no longer be cut by a stop string, as one delta."""
        if seq.finish_reason:
            ids, text = seq.token_ids, self._text(seq)
            upto = len(ids)
        else:
            full = seq.text if seq.request.stops else self.tokenizer.decode(seq.token_ids)
            hold = max((len(s) for s in seq.request.stops), default=1) - 1
            safe = len(full) - hold
            upto, text = seq.sent_tokens, seq.sent_text
            for k in range(len(seq.token_ids), max(seq.sent_tokens, len(seq.token_ids) - 8), -1):
                candidate = (
                    full if k == len(seq.token_ids) else self.tokenizer.decode(seq.token_ids[:k])
                )
                if (
                    len(candidate) <= safe
                    and not candidate.endswith("\ufffd")
                    and candidate.startswith(seq.sent_text)
                ):
                    upto, text = k, candidate
                    break
            if upto == seq.sent_tokens:
                return
        delta = StreamDelta(
            index=seq.index,
            token_ids=seq.token_ids[seq.sent_tokens : upto],
            text=text[len(seq.sent_text) :],
            logprobs=seq.logprobs[seq.sent_tokens : upto],
            finish_reason=seq.finish_reason,
            top_logprobs=seq.top_logprobs[seq.sent_tokens : upto]
            if seq.sampling.top_logprobs
            else None,
        )
        seq.sent_tokens, seq.sent_text = upto, text
        _send(seq.request, delta)

    def _text(self, seq: _Sequence) -> str:
        """The completion text: the decoded ids, without a final stop token."""
        ids = seq.token_ids
        if isinstance(seq.stop_reason, int):
            ids = ids[:-1]
        return self.tokenizer.decode(ids)

    def _retire(self, finished: list[_Sequence]) -> None:
        done = set(map(id, finished))
        rows = {id(seq): row for row, seq in enumerate(self._running)}
        for seq in finished:
            if not seq.request.cancelled:
                self._keep_prefix(rows[id(seq)], seq)
        keep = [seq for seq in self._running if id(seq) not in done]
        # Compact the cache: the last survivors move into the holes, so that running
        # sequences always sit in rows 0..len(keep)-1.
        holes = sorted(rows[id(seq)] for seq in finished if rows[id(seq)] < len(keep))
        movers = [seq for seq in keep if rows[id(seq)] >= len(keep)]
        for hole, seq in zip(holes, movers):
            self.forward.copy_slot(rows[id(seq)], hole, seq.cached)
            rows[id(seq)] = hole
        self._running = sorted(keep, key=lambda seq: rows[id(seq)])
        for job in {id(seq.request): seq.request for seq in finished}.values():
            if not job.cancelled and all(seq.finish_reason for seq in job.sequences):
                _send(job, self._generation(job))

    def _keep_prefix(self, row: int, seq: _Sequence) -> None:
        """Copy a finished sequence's KV into a prefix row (evicting the least recently used)."""
        if not self._prefix_rows:
            return
        tokens = (seq.request.prompt_ids + seq.token_ids)[: seq.cached]
        if len(tokens) < MIN_PREFIX_HIT:
            return
        adapter = seq.request.adapter
        same = [r for r, p in self._prefixes.items() if p.adapter is adapter]
        if any(_common_prefix(self._prefixes[r].tokens, tokens) == len(tokens) for r in same):
            return  # already cached (another choice of the same prompt, say)
        # A cached prefix of these tokens is now redundant: reuse its row.
        covered = [
            r
            for r in same
            if _common_prefix(self._prefixes[r].tokens, tokens) == len(self._prefixes[r].tokens)
        ]
        free = [r for r in self._prefix_rows if r not in self._prefixes]
        if covered:
            target = covered[0]
        elif free:
            target = free[0]
        else:
            target = min(self._prefixes, key=lambda r: self._prefixes[r].last_used)
        self.forward.copy_slot(row, target, len(tokens))
        self._prefixes[target] = _Prefix(tokens, adapter, self.stats.decode_steps)

    def _generation(self, job: _Request) -> Generation:
        completions = [
            Completion(
                token_ids=list(seq.token_ids),
                text=self._text(seq),
                logprobs=list(seq.logprobs),
                finish_reason=seq.finish_reason or "length",
                top_logprobs=list(seq.top_logprobs) if seq.sampling.top_logprobs else None,
                stop_reason=seq.stop_reason,
            )
            for seq in job.sequences
        ]
        return Generation(list(job.prompt_ids), completions, job.model_name)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _send(job: _Request, item: Any) -> None:
    try:
        job.loop.call_soon_threadsafe(job.queue.put_nowait, item)
    except RuntimeError:  # the caller's event loop is gone
        job.cancelled = True


def _lora_rows(running: list[_Sequence]) -> LoraRows | None:
    groups: dict[int, tuple[LoraAdapter, list[int]]] = {}
    for row, seq in enumerate(running):
        adapter = seq.request.adapter
        if adapter is not None:
            groups.setdefault(id(adapter), (adapter, []))[1].append(row)
    if not groups:
        return None
    result = []
    for adapter, rows in groups.values():
        if len(rows) == len(running):
            result.append((adapter, slice(None)))
        elif rows == list(range(rows[0], rows[-1] + 1)):
            result.append((adapter, slice(rows[0], rows[-1] + 1)))
        else:
            result.append((adapter, torch.tensor(rows, dtype=torch.long)))
    return LoraRows(result)


def _validate(params: SamplingParams, max_batch_size: int) -> None:
    problems = []
    if params.max_tokens < 1:
        problems.append("max_tokens must be at least 1")
    if params.temperature < 0:
        problems.append("temperature must be >= 0")
    if not 0 < params.top_p <= 1:
        problems.append("top_p must be in (0, 1]")
    if params.top_k < 0:
        problems.append("top_k must be >= 0 (0 turns it off)")
    if params.repetition_penalty <= 0:
        problems.append("repetition_penalty must be > 0 (1.0 turns it off)")
    if not 1 <= params.n <= max_batch_size:
        problems.append(f"n must be between 1 and {max_batch_size}")
    if not 0 <= params.top_logprobs <= MAX_TOP_LOGPROBS:
        problems.append(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}")
    if problems:
        raise BackendError("; ".join(problems) + ".")


def _choice_seeds(seed: int | None, n: int) -> list[int]:
    """One independent 63-bit seed per choice, derived from the request seed."""
    base = secrets.randbits(63) if seed is None else seed
    state = np.random.SeedSequence([abs(base), int(base < 0)]).generate_state(n, dtype=np.uint64)
    return [int(s) >> 1 for s in state]


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


def _same_shapes(a: LoraAdapter, b: LoraAdapter) -> bool:
    return a.weights.keys() == b.weights.keys() and all(
        a.weights[k][0].shape == b.weights[k][0].shape
        and a.weights[k][1].shape == b.weights[k][1].shape
        for k in a.weights
    )


def _read_peft_dir(path: Path) -> tuple[dict[str, Tensor], dict[str, Any]]:
    config_file = path / "adapter_config.json"
    if not config_file.is_file():
        raise BackendError(f"{path} is not a peft adapter directory (no adapter_config.json).")
    config = json.loads(config_file.read_text())
    if config.get("peft_type", "LORA") != "LORA" or config.get("use_dora"):
        raise BackendError(
            f"{path} holds a {config.get('peft_type')} adapter; the embedded engine runs plain LoRA."
        )
    if (path / "adapter_model.safetensors").is_file():
        from safetensors.torch import load_file

        return load_file(str(path / "adapter_model.safetensors")), config
    if (path / "adapter_model.bin").is_file():
        return torch.load(path / "adapter_model.bin", map_location="cpu", weights_only=True), config
    raise BackendError(f"{path} has no adapter_model.safetensors.")
