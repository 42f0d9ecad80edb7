"""A pool of engines: several replicas of the same model(s) behind one `Backend`.

Every replica serves every adapter. Routing: with affinity 'rollout' the calls of one
rollout (`GenerateRequest.affinity`, which the endpoint sets to the rollout id) stay on the
engine its first call went to, so its prefix stays cached there, and a new rollout goes
to the engine with the fewest calls in flight; with 'least_loaded' every call goes there.

Updates (`load_adapter`, `update_weights`, or several inside `async with pool.updating(v)`)
reach every replica concurrently. What holds:

- a call never runs while an update is applied: the update waits for the calls in flight,
  and calls that arrive meanwhile wait for it, so each call runs wholly under one version,
  which it reports as `Generation.policy_version` (the endpoint records it);
- unless `allow_mixed_versions`, a rollout (an affinity seen since the last update and not
  ended with `end_rollout`/`end_rollouts`) never straddles an update: new rollouts wait
  while an update is pending, and the update waits until running rollouts end;
- a replica that stops answering (connection refused, timeout) is restarted through its
  `restart` callable (up to `max_restarts`; the adapters and full weights it served are
  loaded again) and the calls it had in flight are retried on another replica; a replica
  without one (given by URL) stops the pool: every later call and update raises a
  `BackendError` naming it.

Synchronisation uses a thread lock and short polls, not asyncio primitives: the endpoint
serves on its own event loop while the trainer updates from another.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import dataclasses
import json
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from masenvs.engine.protocol import (
    Backend,
    BackendError,
    GenerateRequest,
    Generation,
    StreamDelta,
    honours_seed,
)

# Error codes of a replica that did not answer (VLLMBackend: connection failed, timed out).
UNREACHABLE = ("backend_unavailable", "backend_timeout")
MAX_PINS = 1 << 16  # rollouts remembered for affinity; the oldest are forgotten first
POLL_S = 0.002
# The pools whose update the current task is applying (their own loads then go straight on).
_IN_UPDATE: contextvars.ContextVar[frozenset[int]] = contextvars.ContextVar(
    "pool_updates", default=frozenset()
)


@dataclass
class Engine:
    """One replica: its backend, how to start a fresh one, and what it is doing."""

    name: str
    backend: Backend
    restart: Callable[[], Backend] | None = None  # None: given by URL, not restartable here
    state: Literal["up", "restarting", "dead"] = "up"
    inflight: int = 0
    served: int = 0
    restarts: int = 0

    @property
    def where(self) -> str:
        url = getattr(self.backend, "url", None)
        return f"{self.name} ({url})" if url else self.name


class EnginePool:
    """The `Backend` protocol over `engines`, replicas of one model (see the module doc)."""

    def __init__(
        self,
        engines: Sequence[Backend],
        *,
        restart: Sequence[Callable[[], Backend] | None] | None = None,
        names: Sequence[str] | None = None,
        affinity: Literal["rollout", "least_loaded"] = "rollout",
        allow_mixed_versions: bool = False,
        max_restarts: int = 3,
        update_timeout: float = 600.0,
        report: str | Path | None = None,
    ) -> None:
        if not engines:
            raise BackendError("A pool of engines needs at least one engine.")
        restart = list(restart) if restart is not None else [None] * len(engines)
        names = list(names) if names is not None else [f"engine-{i}" for i in range(len(engines))]
        ids = {b.tokenizer_id() for b in engines}
        if len(ids) > 1:
            raise BackendError(
                "The engines of a pool use different tokenizers; give it replicas of one model."
            )
        self.engines = [Engine(n, b, r) for n, b, r in zip(names, engines, restart, strict=True)]
        self.affinity = affinity
        self.allow_mixed_versions = allow_mixed_versions
        self.max_restarts = max_restarts
        self.update_timeout = update_timeout  # seconds an update or a waiting call may wait
        self.report = Path(report) if report is not None else None  # stats JSON at shutdown
        self.version = 0
        self.failure: BackendError | None = None  # set when the pool cannot go on
        self.name = getattr(engines[0], "name", type(engines[0]).__name__)
        self.chat_template = getattr(engines[0], "chat_template", None)
        self.history: collections.deque[tuple[str | None, str]] = collections.deque(maxlen=4096)
        self._first = engines[0]  # decodes locally; stays valid after its server is replaced
        self._lock = threading.Lock()
        self._update_lock = threading.Lock()
        self._pins: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._active: dict[str, int] = {}  # rollout -> version it started under
        self._inflight = 0
        self._draining = False  # an update waits for calls (and rollouts) to end
        self._applying = False  # an update is being applied: every call waits
        self._adapters: dict[str, str] = {}  # what a restarted replica loads again
        self._weights: str | None = None
        self._loads = 0  # bumps whenever _adapters / _weights change
        self._rr = 0

    @property
    def honours_seed(self) -> bool:
        """Whether every replica samples a request's seed (base.honours_seed)."""
        return all(honours_seed(e.backend) for e in self.engines)

    # ---- Backend protocol ----------------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> Generation:
        version = await self._admit(request.affinity)
        try:
            for attempt in self._attempts():
                engine, backend = await self._choose(request.affinity)
                try:
                    generation = await backend.generate(request)
                except BackendError as exc:
                    failed = exc
                else:
                    return dataclasses.replace(generation, policy_version=version)
                finally:
                    self._done(engine)
                self._check_failed(engine, backend, failed, attempt)
            raise AssertionError("unreachable")  # _attempts ends by raising
        finally:
            self._release()

    def stream(self, request: GenerateRequest) -> AsyncIterator[StreamDelta | Generation]:
        return self._stream(request)

    async def _stream(self, request: GenerateRequest) -> AsyncIterator[StreamDelta | Generation]:
        version = await self._admit(request.affinity)
        try:
            for attempt in self._attempts():
                engine, backend = await self._choose(request.affinity)
                events = backend.stream(request)
                try:
                    try:
                        first = await anext(events)
                    except BackendError as exc:
                        self._check_failed(engine, backend, exc, attempt)
                        continue  # nothing was sent yet: retry on another engine
                    if isinstance(first, Generation):
                        first = dataclasses.replace(first, policy_version=version)
                    yield first
                    async for event in events:
                        if isinstance(event, Generation):
                            event = dataclasses.replace(event, policy_version=version)
                        yield event
                    return
                except BackendError as exc:
                    if exc.code in UNREACHABLE:  # mid-stream: restart it, but this call fails
                        with contextlib.suppress(BackendError):
                            self._check_failed(engine, backend, exc, attempt)
                        raise BackendError(
                            f"Engine {engine.where} stopped answering in the middle of a "
                            f"streamed call ({exc}); retry the call.",
                            503,
                            "engine_failed",
                        ) from exc
                    raise
                finally:
                    self._done(engine)
                    with contextlib.suppress(Exception):
                        await events.aclose()  # type: ignore[attr-defined]
        finally:
            self._release()

    def model_names(self) -> list[str]:
        return self._up_backend().model_names()

    def decode(self, token_ids: list[int]) -> str:
        return self._first.decode(token_ids)

    def tokenizer_id(self) -> str:
        return self._first.tokenizer_id()

    async def load_adapter(self, name: str, path: str) -> None:
        """Load or replace adapter `name` on every replica (an update: see the module doc)."""
        async with self._update_scope():
            with self._lock:
                self._adapters[name] = str(path)
                self._loads += 1
            await self._fan_out("load_adapter", name, str(path))

    async def update_weights(self, path: Any) -> None:
        """New full weights (a safetensors file or directory) on every replica."""
        async with self._update_scope():
            with self._lock:
                self._weights = str(path)
                self._loads += 1
            await self._fan_out("update_weights", str(path))

    async def close(self) -> None:
        await asyncio.gather(*(e.backend.close() for e in self.engines), return_exceptions=True)

    def shutdown(self) -> None:
        """Stop every replica (and the servers the pool started); write the report if asked."""
        if self.report is not None:
            self.report.write_text(json.dumps(self.stats(), indent=1) + "\n")
        for engine in self.engines:
            shutdown = getattr(engine.backend, "shutdown", None)
            if shutdown is not None:
                shutdown()
            else:
                asyncio.run(engine.backend.close())
            engine.state = "dead"

    # ---- rollouts and versions -------------------------------------------------------------

    def end_rollout(self, rollout_id: str) -> None:
        """`rollout_id` ended: it no longer holds back updates nor keeps its engine."""
        with self._lock:
            self._active.pop(rollout_id, None)
            self._pins.pop(rollout_id, None)

    def end_rollouts(self) -> None:
        """Every rollout so far ended (the trainer says so between steps)."""
        with self._lock:
            self._active.clear()
            self._pins.clear()

    @contextlib.asynccontextmanager
    async def updating(self, version: int | None = None) -> AsyncIterator[None]:
        """Apply the updates made inside as one: calls wait, then see `version` (if given)."""
        if id(self) in _IN_UPDATE.get():
            yield
            if version is not None:
                self.version = version
            return
        await self._wait(self._update_lock.acquire, "another update to finish", blocking=False)
        token = _IN_UPDATE.set(_IN_UPDATE.get() | {id(self)})
        try:
            with self._lock:
                self._draining = True
            await self._wait(self._drained, "running calls and rollouts to end")
            with self._lock:
                self._applying = True
            if self.failure is not None:
                raise self.failure
            yield
            if version is not None:
                self.version = version
        finally:
            with self._lock:
                self._draining = self._applying = False
            _IN_UPDATE.reset(token)
            self._update_lock.release()

    def _update_scope(self) -> contextlib.AbstractAsyncContextManager[None]:
        return self.updating(None)

    def _drained(self) -> bool:
        with self._lock:
            if self.failure is not None:
                raise self.failure
            restarting = any(e.state == "restarting" for e in self.engines)
            rollouts = not self.allow_mixed_versions and bool(self._active)
            return self._inflight == 0 and not rollouts and not restarting

    async def _admit(self, affinity: str | None) -> int:
        """Wait until the call may start; count it in flight; its version."""
        version: list[int] = []

        def admitted() -> bool:
            with self._lock:
                if self.failure is not None:
                    raise self.failure
                running = affinity is not None and affinity in self._active
                held = self._applying or (
                    self._draining and (self.allow_mixed_versions or not running)
                )
                if held:
                    return False
                self._inflight += 1
                if affinity is not None and not running:
                    self._active[affinity] = self.version
                    if len(self._active) > MAX_PINS:
                        del self._active[next(iter(self._active))]
                version.append(self.version)
                return True

        await self._wait(admitted, "a weight update to be applied")
        return version[0]

    def _release(self) -> None:
        with self._lock:
            self._inflight -= 1

    async def _wait(self, ready: Callable[..., bool], what: str, **kwargs: Any) -> None:
        if ready(**kwargs):
            return
        deadline = time.monotonic() + self.update_timeout
        while not ready(**kwargs):
            if time.monotonic() > deadline:
                with self._lock:
                    rollouts = ", ".join(list(self._active)[:5])
                raise BackendError(
                    f"The pool of engines waited {self.update_timeout:g} s for {what} "
                    f"(rollouts running: {rollouts or 'none'}); end finished rollouts "
                    "(Endpoint.end_rollout), or set distributed.engines.allow_mixed_versions.",
                    503,
                    "engine_update_timeout",
                )
            await asyncio.sleep(POLL_S)

    # ---- routing -----------------------------------------------------------------------------

    def _attempts(self) -> Any:
        """Attempt numbers for one call: each engine once, plus one per possible restart."""
        return range(len(self.engines) * (1 + self.max_restarts))

    async def _choose(self, affinity: str | None) -> tuple[Engine, Backend]:
        """The engine for this call (counted in flight), waiting while all are restarting."""
        picked: list[tuple[Engine, Backend]] = []

        def pick() -> bool:
            with self._lock:
                if self.failure is not None:
                    raise self.failure
                up = [i for i, e in enumerate(self.engines) if e.state == "up"]
                if not up:
                    return False
                pinned = self._pins.get(affinity) if affinity is not None else None
                if self.affinity == "rollout" and pinned in up:
                    index = pinned
                else:
                    start = self._rr
                    self._rr += 1
                    order = up[start % len(up) :] + up[: start % len(up)]
                    index = min(order, key=lambda i: self.engines[i].inflight)
                    if self.affinity == "rollout" and affinity is not None:
                        self._pins[affinity] = index
                        if len(self._pins) > MAX_PINS:
                            self._pins.popitem(last=False)
                engine = self.engines[index]
                engine.inflight += 1
                engine.served += 1
                self.history.append((affinity, engine.name))
                picked.append((engine, engine.backend))
                return True

        await self._wait(pick, "an engine to come back")
        return picked[0]

    def _done(self, engine: Engine) -> None:
        with self._lock:
            engine.inflight -= 1

    def _up_backend(self) -> Backend:
        for engine in self.engines:
            if engine.state == "up":
                return engine.backend
        return self._first

    # ---- failures ------------------------------------------------------------------------

    def _check_failed(
        self, engine: Engine, backend: Backend, exc: BackendError, attempt: int
    ) -> None:
        """Re-raise `exc` unless it says the engine is gone; then restart it (or stop)."""
        if exc.code not in UNREACHABLE:
            raise exc
        self._engine_failed(engine, backend, exc)
        if attempt + 1 >= len(self.engines) * (1 + self.max_restarts):
            raise BackendError(
                f"Engine {engine.where} did not answer ({exc}) and no retry is left.",
                503,
                "engine_failed",
            ) from exc

    def _engine_failed(self, engine: Engine, backend: Backend, exc: BackendError) -> None:
        with self._lock:
            if engine.backend is not backend or engine.state != "up":
                return  # another call saw it first
            if engine.restart is None:
                engine.state = "dead"
                self.failure = BackendError(
                    f"Engine {engine.where} stopped answering ({exc}); it was given by URL "
                    "(or distributed.engines.restart is off), so masenvs does not restart it "
                    "and the run stops: restart that server and resume from the last "
                    "checkpoint.",
                    503,
                    "engine_failed",
                )
                raise self.failure from exc
            if engine.restarts >= self.max_restarts:
                engine.state = "dead"
                self.failure = BackendError(
                    f"Engine {engine.where} stopped answering ({exc}) after {engine.restarts} "
                    f"restarts (distributed.engines.max_restarts); the run stops: see its log.",
                    503,
                    "engine_failed",
                )
                raise self.failure from exc
            engine.state = "restarting"
            engine.restarts += 1
        threading.Thread(target=self._restart, args=(engine, backend), daemon=True).start()

    def _restart(self, engine: Engine, old: Backend) -> None:
        """Replace a dead replica by a fresh one serving the same adapters and weights."""
        with contextlib.suppress(Exception):
            getattr(old, "shutdown", lambda: None)()
        try:
            assert engine.restart is not None
            fresh = engine.restart()
            while True:
                with self._lock:
                    adapters, weights, loads = dict(self._adapters), self._weights, self._loads

                async def reload(
                    adapters: dict[str, str] = adapters, weights: Any = weights
                ) -> None:
                    if weights is not None:
                        await fresh.update_weights(weights)  # type: ignore[attr-defined]
                    for name, path in adapters.items():
                        await fresh.load_adapter(name, path)
                    await fresh.close()

                asyncio.run(reload())
                with self._lock:
                    if loads == self._loads:  # nothing changed while it reloaded
                        engine.backend, engine.state = fresh, "up"
                        return
        except Exception as exc:  # noqa: BLE001 - any failure to restart stops the pool
            with self._lock:
                engine.state = "dead"
                self.failure = BackendError(
                    f"Engine {engine.name} died and could not be restarted ({exc}); the run stops.",
                    503,
                    "engine_failed",
                )

    async def _fan_out(self, method: str, *args: Any) -> None:
        with self._lock:
            targets = [(e, e.backend) for e in self.engines if e.state == "up"]

        async def one(engine: Engine, backend: Backend) -> None:
            try:
                await getattr(backend, method)(*args)
            except BackendError as exc:
                if exc.code not in UNREACHABLE:
                    raise
                self._engine_failed(engine, backend, exc)  # its restart loads the new state

        if any(not hasattr(b, method) for _, b in targets):
            raise BackendError(f"An engine of this pool has no {method}.", 501)
        await asyncio.gather(*(one(e, b) for e, b in targets))

    # ---- what tests and benchmarks read ------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Per engine: calls served, restarts, state; and the version served last."""
        with self._lock:
            engines = {
                e.name: {"served": e.served, "restarts": e.restarts, "state": e.state}
                for e in self.engines
            }
        return {"version": self.version, "affinity": self.affinity, "engines": engines}

    def pinned(self, rollout_id: str) -> str | None:
        """The engine a rollout's calls go to, if it is pinned."""
        with self._lock:
            index = self._pins.get(rollout_id)
        return None if index is None else self.engines[index].name
