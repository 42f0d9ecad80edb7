"""Trace records and their durable store.

One `CallRecord` per LLM call (written by the endpoint), one `EpisodeRecord` per finished
rollout (written by the policy or trainer). Records append to JSON-lines segment files in a
directory; the trainer, evaluator and viewer read them back or export a Hugging Face dataset.

Durability: every record is handed to the OS with one `write` on an `O_APPEND` descriptor
before `append` returns, so it survives the writing process being killed (`kill -9`); with
`durability="fsync"` it is also on the disk itself and survives a power loss.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import datasets

log = logging.getLogger(__name__)

Durability = Literal["flush", "fsync"]
INLINE_TOKENS = 4096  # records with more token entries than this are encoded off the loop


@dataclass
class ChoiceRecord:
    """One sampled continuation of a call, with the ids the backend generated."""

    index: int
    text: str  # decode(token_ids), without a final stop token
    token_ids: list[int]
    logprobs: list[float]  # log-probability of each token under the raw model (T=1)
    finish_reason: str  # "stop", "length" or "tool_calls"
    top_logprobs: list[dict[int, float]] | None = None  # per position: token id -> logprob
    tool_calls: list[dict[str, Any]] | None = None  # as returned to the client, if any
    # A stop token id (the last of `token_ids`, not in `text`) or a stop string (in neither).
    stop_reason: int | str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "text": self.text,
            "token_ids": self.token_ids,
            "logprobs": self.logprobs,
            "finish_reason": self.finish_reason,
            "top_logprobs": self.top_logprobs,
            "tool_calls": self.tool_calls,
            "stop_reason": self.stop_reason,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ChoiceRecord:
        top = data.get("top_logprobs")
        if top is not None:
            # JSON object keys are strings; token ids are ints.
            top = [{int(k): v for k, v in position.items()} for position in top]
        return cls(
            index=data["index"],
            text=data["text"],
            token_ids=data["token_ids"],
            logprobs=data["logprobs"],
            finish_reason=data["finish_reason"],
            top_logprobs=top,
            tool_calls=data.get("tool_calls"),
            stop_reason=data.get("stop_reason"),
        )


@dataclass
class CallRecord:
    """One LLM call as the endpoint served it."""

    id: str
    rollout_id: str | None  # None for calls to the plain /v1 API
    agent: str  # the request's `model` field: who called
    model: str  # the adapter or model the policy map sent the call to
    call_index: int  # 0, 1, 2, ... per (rollout_id, agent, step), in order of arrival
    kind: Literal["chat", "completion"]
    prompt_token_ids: list[int]
    choices: list[ChoiceRecord]
    messages: list[dict[str, Any]] | None = None  # chat calls
    tools: list[dict[str, Any]] | None = None
    prompt: str | list[int] | None = None  # completion calls
    params: dict[str, Any] = field(default_factory=dict)  # sampling parameters used
    stream: bool = False
    backend: str = ""
    tokenizer_id: str = ""
    policy_version: int = 0
    started_at: float = 0.0  # unix time the request arrived
    finished_at: float = 0.0  # unix time generation ended
    metadata: dict[str, Any] = field(default_factory=dict)  # per-rollout metadata
    # The decision the program named (`model="critic@verdict"` or the X-Masenvs-Step header);
    # workflow training groups calls by it.
    step: str | None = None

    @property
    def latency_s(self) -> float:
        return self.finished_at - self.started_at

    def to_dict(self) -> dict[str, Any]:
        return {
            "type": "call",
            "id": self.id,
            "rollout_id": self.rollout_id,
            "agent": self.agent,
            "model": self.model,
            "call_index": self.call_index,
            "kind": self.kind,
            "prompt_token_ids": self.prompt_token_ids,
            "choices": [choice.to_dict() for choice in self.choices],
            "messages": self.messages,
            "tools": self.tools,
            "prompt": self.prompt,
            "params": self.params,
            "stream": self.stream,
            "backend": self.backend,
            "tokenizer_id": self.tokenizer_id,
            "policy_version": self.policy_version,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "latency_s": self.latency_s,
            "metadata": self.metadata,
            "step": self.step,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CallRecord:
        return cls(
            id=data["id"],
            rollout_id=data["rollout_id"],
            agent=data["agent"],
            model=data["model"],
            call_index=data["call_index"],
            kind=data["kind"],
            prompt_token_ids=data["prompt_token_ids"],
            choices=[ChoiceRecord.from_dict(c) for c in data["choices"]],
            messages=data.get("messages"),
            tools=data.get("tools"),
            prompt=data.get("prompt"),
            params=data.get("params") or {},
            stream=data.get("stream", False),
            backend=data.get("backend", ""),
            tokenizer_id=data.get("tokenizer_id", ""),
            policy_version=data.get("policy_version", 0),
            started_at=data.get("started_at", 0.0),
            finished_at=data.get("finished_at", 0.0),
            metadata=data.get("metadata") or {},
            step=data.get("step"),
        )


@dataclass
class EpisodeRecord:
    """The outcome of one rollout: rewards per agent and success."""

    rollout_id: str
    task_id: str
    env: str
    rewards: dict[str, float]
    success: bool
    extra: dict[str, Any] = field(default_factory=dict)
    policy_version: int | None = None
    created_at: float = field(default_factory=time.time)

    def to_dict(self) -> dict[str, Any]:
        return {
            "type": "episode",
            "rollout_id": self.rollout_id,
            "task_id": self.task_id,
            "env": self.env,
            "rewards": self.rewards,
            "success": self.success,
            "extra": self.extra,
            "policy_version": self.policy_version,
            "created_at": self.created_at,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EpisodeRecord:
        return cls(
            rollout_id=data["rollout_id"],
            task_id=data["task_id"],
            env=data["env"],
            rewards=data["rewards"],
            success=data["success"],
            extra=data.get("extra") or {},
            policy_version=data.get("policy_version"),
            created_at=data.get("created_at", 0.0),
        )


def new_call_id() -> str:
    return f"call-{uuid.uuid4().hex}"


class TraceStore:
    """An append-only directory of JSON-lines segments, safe to share between threads.

    Each writer gets its own segments (`segment-<time>-<pid>-<writer>-<n>.jsonl`), so
    several writers never interleave inside one file; readers see every complete line and
    skip a torn last line left by a killed writer.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        durability: Durability = "flush",
        segment_bytes: int = 64 << 20,
    ) -> None:
        if durability not in ("flush", "fsync"):
            raise ValueError(f"durability must be 'flush' or 'fsync', not {durability!r}")
        self.path = Path(path)
        if self.path.exists() and not self.path.is_dir():
            raise NotADirectoryError(
                f"trace store {self.path} is a file; give a directory (it is created if missing)"
            )
        self.durability: Durability = durability
        self.segment_bytes = segment_bytes
        self._write_lock = threading.Lock()
        self._sync_lock = threading.Lock()
        self._fd: int | None = None
        self._segment_size = 0
        self._segment_count = 0
        self._writer_id = uuid.uuid4().hex[:8]  # two stores in one process never share a file
        self._written = 0  # records written so far (group commit of fsync counts these)
        self._synced = 0

    # -- writing ---------------------------------------------------------------------------

    def append(self, record: CallRecord | EpisodeRecord) -> None:
        """Write one record; it is in the OS (or on disk with fsync) when this returns."""
        line = (json.dumps(record.to_dict(), ensure_ascii=False) + "\n").encode()
        with self._write_lock:
            fd = self._segment_for(len(line))
            _write_all(fd, line)
            self._segment_size += len(line)
            self._written += 1
            seq = self._written
        if self.durability == "fsync":
            self._sync(seq)

    async def append_async(self, record: CallRecord | EpisodeRecord) -> None:
        """`append` from async code: a typical record is written inline (tens of
        microseconds); an fsync, or encoding a large record (long prompts, many choices,
        top logprobs: tens of ms), runs in a worker thread so the event loop keeps serving."""
        if self.durability == "fsync" or _size_hint(record) > INLINE_TOKENS:
            await asyncio.to_thread(self.append, record)
        else:
            self.append(record)

    def close(self) -> None:
        with self._write_lock:
            if self._fd is not None:
                if self.durability == "fsync":
                    os.fsync(self._fd)
                os.close(self._fd)
                self._fd = None

    def __enter__(self) -> TraceStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _segment_for(self, size: int) -> int:
        if self._fd is not None and self._segment_size + size <= self.segment_bytes:
            return self._fd
        if self._fd is not None:
            if self.durability == "fsync":
                os.fsync(self._fd)
            os.close(self._fd)
        self.path.mkdir(parents=True, exist_ok=True)
        name = f"segment-{time.time_ns():020d}-{os.getpid()}-{self._writer_id}-{self._segment_count:04d}.jsonl"
        self._segment_count += 1
        self._fd = os.open(self.path / name, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._segment_size = 0
        if self.durability == "fsync":
            _fsync_dir(self.path)  # so the new file's name survives a power loss too
        return self._fd

    def _sync(self, seq: int) -> None:
        # Group commit: one fsync covers every record written before it started, so
        # concurrent writers share fsyncs instead of queueing one each.
        with self._sync_lock:
            if self._synced >= seq:
                return
            with self._write_lock:
                fd, target = self._fd, self._written
            try:
                if fd is not None:
                    os.fsync(fd)
            except OSError:
                # A rollover closed `fd` meanwhile; it fsynced that segment before closing.
                pass
            self._synced = max(self._synced, target)

    # -- reading ---------------------------------------------------------------------------

    def segments(self) -> list[Path]:
        if not self.path.is_dir():
            return []
        return sorted(self.path.glob("segment-*.jsonl"))

    def records(self) -> Iterator[dict[str, Any]]:
        """Every complete record as a dict, oldest segment first."""
        for segment in self.segments():
            yield from _read_segment(segment)

    def calls(
        self, rollout_id: str | None = None, agent: str | None = None
    ) -> Iterator[CallRecord]:
        """Call records, optionally of one rollout and/or one agent."""
        for data in self.records():
            if data.get("type") != "call":
                continue
            if rollout_id is not None and data.get("rollout_id") != rollout_id:
                continue
            if agent is not None and data.get("agent") != agent:
                continue
            yield CallRecord.from_dict(data)

    def rollout(self, rollout_id: str) -> list[CallRecord]:
        """The calls of one rollout ordered by (agent, call_index)."""
        return sorted(self.calls(rollout_id), key=lambda c: (c.agent, c.call_index))

    def episodes(self, rollout_id: str | None = None) -> Iterator[EpisodeRecord]:
        for data in self.records():
            if data.get("type") != "episode":
                continue
            if rollout_id is not None and data.get("rollout_id") != rollout_id:
                continue
            yield EpisodeRecord.from_dict(data)

    def to_dataset(self) -> datasets.Dataset:
        """One row per sampled choice, joined with its rollout's episode when there is one."""
        try:
            import datasets
        except ImportError as exc:
            raise ImportError(
                "TraceStore.to_dataset needs the `datasets` package: pip install 'masenvs[tasks]'"
            ) from exc

        episodes = {e.rollout_id: e for e in self.episodes()}
        rows: dict[str, list[Any]] = {name: [] for name in _DATASET_FEATURES}
        for call in self.calls():
            episode = episodes.get(call.rollout_id) if call.rollout_id else None
            for choice in call.choices:
                row = {
                    "call_id": call.id,
                    "rollout_id": call.rollout_id,
                    "agent": call.agent,
                    "model": call.model,
                    "call_index": call.call_index,
                    "choice_index": choice.index,
                    "kind": call.kind,
                    "policy_version": call.policy_version,
                    "prompt_token_ids": call.prompt_token_ids,
                    "completion_token_ids": choice.token_ids,
                    "logprobs": choice.logprobs,
                    "text": choice.text,
                    "finish_reason": choice.finish_reason,
                    "messages": _json_or_none(call.messages),
                    "tools": _json_or_none(call.tools),
                    "prompt": _json_or_none(call.prompt),
                    "params": json.dumps(call.params),
                    "tokenizer_id": call.tokenizer_id,
                    "backend": call.backend,
                    "started_at": call.started_at,
                    "latency_s": call.latency_s,
                    "task_id": episode.task_id if episode else None,
                    "env": episode.env if episode else None,
                    "reward": episode.rewards.get(call.agent) if episode else None,
                    "success": episode.success if episode else None,
                }
                for name, value in row.items():
                    rows[name].append(value)
        features = datasets.Features(
            {name: _feature(datasets, kind) for name, kind in _DATASET_FEATURES.items()}
        )
        return datasets.Dataset.from_dict(rows, features=features)


# Column -> type of `to_dataset`; JSON-valued fields are strings because their shapes vary.
_DATASET_FEATURES: dict[str, str] = {
    "call_id": "string",
    "rollout_id": "string",
    "agent": "string",
    "model": "string",
    "call_index": "int64",
    "choice_index": "int64",
    "kind": "string",
    "policy_version": "int64",
    "prompt_token_ids": "ids",
    "completion_token_ids": "ids",
    "logprobs": "floats",
    "text": "string",
    "finish_reason": "string",
    "messages": "string",
    "tools": "string",
    "prompt": "string",
    "params": "string",
    "tokenizer_id": "string",
    "backend": "string",
    "started_at": "float64",
    "latency_s": "float64",
    "task_id": "string",
    "env": "string",
    "reward": "float64",
    "success": "bool",
}


def _feature(datasets: Any, kind: str) -> Any:
    if kind == "ids":
        return datasets.Sequence(datasets.Value("int64"))
    if kind == "floats":
        return datasets.Sequence(datasets.Value("float64"))
    return datasets.Value(kind)


def _size_hint(record: CallRecord | EpisodeRecord) -> int:
    if not isinstance(record, CallRecord):
        return 0
    size = len(record.prompt_token_ids)
    for choice in record.choices:
        size += 2 * len(choice.token_ids)
        if choice.top_logprobs:
            size += sum(2 * len(position) for position in choice.top_logprobs)
    return size


def _json_or_none(value: Any) -> str | None:
    return None if value is None else json.dumps(value, ensure_ascii=False)


def _read_segment(segment: Path) -> Iterator[dict[str, Any]]:
    with open(segment, "rb") as f:
        for number, line in enumerate(f, start=1):
            if not line.endswith(b"\n"):
                return  # torn last line of a killed writer (or one being written now)
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                log.warning("skipping unreadable trace line %s:%d", segment, number)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
