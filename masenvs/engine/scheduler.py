"""The scheduler: the engine thread that turns waiting requests into tokens.

One background thread owns the model (`LlamaForward`). Between decode steps it applies
adapter and weight updates and admits waiting requests, prefilling their prompts into free
KV-cache rows (identical prompts and shared prefixes run once; see `prefix_cache`); every
step then decodes one token for all running sequences at once, whatever their adapter,
samples it (`sampling`) and hands it to `output`. Finished sequences free their rows.
"""

from __future__ import annotations

import collections
import secrets
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from masenvs.engine import kernels
from masenvs.engine.forward import LlamaForward, Prefill
from masenvs.engine.lora import LoraAdapter, lora_rows, swap_adapter
from masenvs.engine.omp import set_thread_local_threads, wakeups_are_costly
from masenvs.engine.output import check_finished, generation, stream
from masenvs.engine.prefix_cache import MIN_PREFIX_HIT, PrefixCache, common_prefix
from masenvs.engine.protocol import BackendError
from masenvs.engine.sampling import RowSampling, sample
from masenvs.engine.sequence import EngineStats, Request, Sequence, send

PREFILL_TOKENS = 2048  # prompt tokens per prefill pass; bounds the attention mask
SINGLE_THREAD_ROWS = 4  # decode steps this small run on one thread where wake-ups are costly


@dataclass
class AdapterUpdate:
    """An adapter or weight change the engine thread applies between decode steps."""

    name: str | None  # None: only empty the prefix cache
    adapter: LoraAdapter | None  # None removes the adapter
    in_place: bool
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    # name None: (engine parameter, new value) pairs copied into the base model's weights
    base_weights: list[tuple[Tensor, Tensor]] = field(default_factory=list)


class Scheduler:
    """Runs the engine thread over `forward`: requests arrive by `submit`, updates by `apply`."""

    def __init__(
        self,
        forward: LlamaForward,
        tokenizer: Any,
        *,
        max_batch_size: int,
        prefix_rows: range,
        num_threads: int,
        single_thread_rows: int | None,
    ) -> None:
        self.forward = forward
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.num_threads = num_threads
        # None: measured on the engine thread when it starts (see `_loop`).
        self.single_thread_rows = single_thread_rows
        self.prefixes = PrefixCache(forward, prefix_rows)
        self.adapters: dict[str, LoraAdapter] = {}
        self.waiting: collections.deque[Request] = collections.deque()
        self.updates: collections.deque[AdapterUpdate] = collections.deque()
        self.running: list[Sequence] = []  # row i of the KV cache holds running[i]
        self.wakeup = threading.Condition()
        self.closed = False
        self.stats = EngineStats()
        self.thread = threading.Thread(target=self._loop, name="masenvs-engine", daemon=True)

    def start(self) -> None:
        """Start the engine thread."""
        self.thread.start()

    def submit(self, job: Request) -> None:
        """Queue `job` for the engine thread (an error once the engine is shut down)."""
        with self.wakeup:
            if self.closed:
                raise BackendError("The embedded engine is shut down.", 503, "engine_closed")
            self.waiting.append(job)
            self.wakeup.notify()

    def apply(self, update: AdapterUpdate) -> None:
        """Have the engine thread apply `update` between decode steps; wait until it has."""
        with self.wakeup:
            if self.closed:
                raise BackendError("The embedded engine is shut down.", 503, "engine_closed")
            self.updates.append(update)
            self.wakeup.notify()
        update.done.wait()
        if update.error is not None:
            raise update.error

    def close(self) -> None:
        """Stop the engine thread; waiting and running requests fail with status 503."""
        with self.wakeup:
            self.closed = True
            self.wakeup.notify_all()
        if threading.current_thread() is not self.thread:
            self.thread.join()

    def _loop(self) -> None:
        """The engine thread: apply updates, admit waiting requests, decode a step; repeat."""
        threads = self.num_threads
        if self.single_thread_rows is None:
            costly = self.num_threads > 1 and wakeups_are_costly(self.num_threads)
            self.single_thread_rows = SINGLE_THREAD_ROWS if costly else 0
        while True:
            with self.wakeup:
                while not (self.closed or self.waiting or self.updates or self.running):
                    self.wakeup.wait()
                if self.closed:
                    break
                updates = list(self.updates)
                self.updates.clear()
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
                if self.running:
                    small = len(self.running) <= self.single_thread_rows
                    threads = self._use_threads(1 if small else self.num_threads, threads)
                    self._step()
            except Exception as exc:  # a bug or OOM: fail what is running, keep serving
                error = BackendError(f"The embedded engine failed: {exc!r}", 500, "engine_error")
                for seq in self.running:
                    send(seq.request, error)
                self.running.clear()
        self._fail_all(BackendError("The embedded engine is shut down.", 503, "engine_closed"))

    @staticmethod
    def _use_threads(wanted: int, current: int) -> int:
        """Set this thread's OpenMP thread count (see `omp`); the count now in force."""
        if wanted == current or not set_thread_local_threads(wanted):
            return current
        return wanted

    def _fail_all(self, error: BackendError) -> None:
        """Fail every waiting and running request and every pending update with `error`."""
        with self.wakeup:
            waiting = list(self.waiting)
            self.waiting.clear()
            for update in self.updates:
                update.error = error
                update.done.set()
            self.updates.clear()
        for job in waiting:
            send(job, error)
        for seq in self.running:
            send(seq.request, error)
        self.running.clear()

    def _apply_update(self, update: AdapterUpdate) -> None:
        self.prefixes.forget(update.name)  # their KV was computed with the old weights
        if update.name is None:
            with torch.no_grad():  # the copy bumps each weight's version: see quant.Projection
                for param, value in update.base_weights:
                    param.copy_(value)
            return
        swap_adapter(self.adapters, update.name, update.adapter, update.in_place)

    def _admit(self) -> None:
        """Prefill waiting requests, several per forward pass, while cache rows are free."""
        jobs: list[Request] = []
        with self.wakeup:
            rows, tokens = len(self.running), 0
            while self.waiting:
                job = self.waiting[0]
                if job.cancelled:
                    self.waiting.popleft()
                    continue
                size = len(job.prompt_ids)
                if rows + job.request.params.n > self.max_batch_size or (
                    jobs and tokens + size > PREFILL_TOKENS
                ):
                    break
                jobs.append(self.waiting.popleft())
                rows, tokens = rows + job.request.params.n, tokens + size
        if not jobs:
            return
        try:
            self._prefill(jobs)
        except Exception as exc:
            failed = set(map(id, jobs))
            self.running = [seq for seq in self.running if id(seq.request) not in failed]
            for job in jobs:
                send(job, BackendError(f"The embedded engine failed: {exc!r}", 500, "engine_error"))

    def _prefill(self, jobs: list[Request]) -> None:
        """Prefill the prompts into new cache rows, then sample each choice's first token.

        Identical prompts (same adapter) run once: the n choices of a request, and the K
        separate requests a GRPO group often sends, copy one prefilled cache row. A prompt
        that extends a cached prefix (an agent's next turn) copies that prefix's KV and
        runs only the rest.
        """
        first_rows, row = [], len(self.running)
        for job in jobs:
            first_rows.append(row)
            row += job.request.params.n
        source: dict[tuple[int, tuple[int, ...]], int] = {}  # (adapter, prompt) -> unique index
        unique: list[Prefill] = []
        prompts: list[Request] = []  # the job behind each unique prefill
        which: list[int] = []
        for job, first in zip(jobs, first_rows):
            key = (id(job.adapter), tuple(job.prompt_ids))
            if key not in source:
                source[key] = len(unique)
                unique.append(
                    self.prefixes.reuse(first, job.prompt_ids, job.adapter, self.stats.decode_steps)
                )
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
                job.sequences.append(Sequence(job, choice, sampling, cached=length))
            self.running.extend(job.sequences)
            choice_logits.append(logits[index : index + 1].expand(params.n, -1))
            self.stats.requests += 1
            self.stats.prompt_tokens += length
            if first == unique[index].slot:
                self.stats.prefilled_tokens += unique[index].tokens.numel()
                self.stats.prefix_hit_tokens += unique[index].start
        self._accept([seq for job in jobs for seq in job.sequences], torch.cat(choice_logits))

    def _run_shared_prefills(self, prefills: list[Prefill], jobs: list[Request]) -> Tensor:
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
                    common_prefix(jobs[j].prompt_ids, job.prompt_ids), len(job.prompt_ids) - 1
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
        running = self.running
        for seq in running:
            seq.cached = seq.length  # this step feeds the last sampled token
        last = torch.tensor([seq.token_ids[-1] for seq in running], dtype=torch.long)
        positions = torch.tensor([seq.length - 1 for seq in running], dtype=torch.long)
        logits = self.forward.decode(
            last.to(self.forward.device),
            positions.to(self.forward.device),
            lora_rows([seq.request.adapter for seq in running]),
        )
        self.stats.decode_steps += 1
        self.stats.peak_batch = max(self.stats.peak_batch, len(running))
        self._accept(list(running), logits)

    def _accept(self, sequences: list[Sequence], logits: Tensor) -> None:
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
            check_finished(seq, self.tokenizer)
            if job.streaming and not job.cancelled:
                stream(seq, self.tokenizer)
        finished = [seq for seq in self.running if seq.finish_reason or seq.request.cancelled]
        if finished:
            self._retire(finished)

    def _retire(self, finished: list[Sequence]) -> None:
        """Keep finished sequences' prefixes, free their rows and send finished results."""
        done, step = set(map(id, finished)), self.stats.decode_steps
        rows = {id(seq): row for row, seq in enumerate(self.running)}
        for seq in finished:
            if not seq.request.cancelled:
                tokens = (seq.request.prompt_ids + seq.token_ids)[: seq.cached]
                self.prefixes.keep(rows[id(seq)], tokens, seq.request.adapter, step)
        keep = [seq for seq in self.running if id(seq) not in done]
        # Compact the cache: the last survivors move into the holes, so that running
        # sequences always sit in rows 0..len(keep)-1.
        holes = sorted(rows[id(seq)] for seq in finished if rows[id(seq)] < len(keep))
        movers = [seq for seq in keep if rows[id(seq)] >= len(keep)]
        for hole, seq in zip(holes, movers):
            self.forward.copy_slot(rows[id(seq)], hole, seq.cached)
            rows[id(seq)] = hole
        self.running = sorted(keep, key=lambda seq: rows[id(seq)])
        for job in {id(seq.request): seq.request for seq in finished}.values():
            if not job.cancelled and all(seq.finish_reason for seq in job.sequences):
                send(job, generation(job, self.tokenizer))


def _choice_seeds(seed: int | None, n: int) -> list[int]:
    """One independent 63-bit seed per choice, derived from the request seed."""
    base = secrets.randbits(63) if seed is None else seed
    state = np.random.SeedSequence([abs(base), int(base < 0)]).generate_state(n, dtype=np.uint64)
    return [int(s) >> 1 for s in state]
