"""An incremental sqlite index of one run's files, so a step or a call opens in milliseconds.

The trainer appends JSON lines (trace segments, `samples.jsonl`, `designs.jsonl`); the index
keeps, per file, how many bytes it has read, and on `refresh()` reads only what was appended
since, whole lines only (a line being written is read next time). Each row keeps the
line's file and byte offset: the full record (token ids, log-probs, messages) is read back
from the JSONL with one seek, never copied into the index.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

INDEX_NAME = ".masenvs-ui.sqlite"
SCHEMA_VERSION = 6
CHUNK_LINES = 20_000  # a first build commits this often
BUSY_SECONDS = 5.0  # after a wait for a busy indexer timed out, reads go on without one
PREVIEW = 160  # characters of each choice's text kept in the index
try:  # 4x faster on records full of token ids; the stdlib's when it is not installed
    from orjson import dumps as _orjson_dumps
    from orjson import loads as _loads

    def _dumps(value: Any) -> str:
        return _orjson_dumps(value).decode()

except ImportError:  # pragma: no cover
    _loads = json.loads
    _dumps = json.dumps

_COLUMNS = {"calls": 17, "episodes": 10, "samples": 26, "designs": 11}  # per table

_STEP_OF_ROLLOUT = re.compile(r"^s(\d+)-")  # training rollouts are s{step}-{seed}[-{k}]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT);
CREATE TABLE IF NOT EXISTS files (id INTEGER PRIMARY KEY, path TEXT UNIQUE, consumed INTEGER);
CREATE TABLE IF NOT EXISTS calls (
    id TEXT, rollout_id TEXT, agent TEXT, call_index INTEGER, step_name TEXT,
    train_step INTEGER, n_choices INTEGER, started_at REAL, latency_s REAL,
    policy_version INTEGER, prompt_tokens INTEGER, completion_tokens INTEGER,
    finish_reason TEXT, previews TEXT, file INTEGER, offset INTEGER, length INTEGER);
CREATE INDEX IF NOT EXISTS calls_id ON calls (id);
CREATE INDEX IF NOT EXISTS calls_rollout ON calls (rollout_id);
CREATE INDEX IF NOT EXISTS calls_step ON calls (train_step);
CREATE TABLE IF NOT EXISTS episodes (
    rollout_id TEXT, task_id TEXT, env TEXT, success INTEGER, rewards TEXT, error TEXT,
    created_at REAL, file INTEGER, offset INTEGER, length INTEGER);
CREATE INDEX IF NOT EXISTS episodes_rollout ON episodes (rollout_id);
CREATE TABLE IF NOT EXISTS samples (
    step INTEGER, batch TEXT, call_id TEXT, choice INTEGER, rollout_id TEXT, agent TEXT,
    policy TEXT, grp TEXT, task_id TEXT, round INTEGER, reward REAL, parts TEXT,
    part_agent REAL, part_team REAL, team_term REAL,
    advantage REAL, kept INTEGER, drop_reason TEXT, continued INTEGER, design_id TEXT,
    failed INTEGER, completion_tokens INTEGER, file INTEGER, offset INTEGER, length INTEGER,
    seq INTEGER);
CREATE INDEX IF NOT EXISTS samples_step ON samples (step);
CREATE INDEX IF NOT EXISTS samples_call ON samples (call_id);
CREATE TABLE IF NOT EXISTS designs (
    step INTEGER, task_id TEXT, round INTEGER, design_id TEXT, reward REAL, error TEXT,
    structure TEXT, executions INTEGER, file INTEGER, offset INTEGER, length INTEGER);
CREATE INDEX IF NOT EXISTS designs_step ON designs (step);
CREATE INDEX IF NOT EXISTS designs_id ON designs (design_id);
"""


class RunIndex:
    """The index of the run at `run_dir` (traces under `traces/`, or `run_dir` itself when it
    is a trace store, as an eval's per-policy directories are)."""

    def __init__(self, run_dir: str | Path, db_path: str | Path | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.db_path = Path(db_path) if db_path else _db_path(self.run_dir)
        self._refresh_lock = threading.Lock()  # one writer: a request or the indexer thread
        self._read_lock = threading.Lock()
        self._refreshed = 0.0
        self._gave_up = -BUSY_SECONDS  # when a wait for the indexer thread last timed out
        self._db = self._open()  # written by refresh() only
        # Reads use their own connection: in WAL mode they see each committed chunk while a
        # long first build goes on, instead of waiting for it.
        self._reader = sqlite3.connect(self.db_path, check_same_thread=False, timeout=30.0)
        self._reader.row_factory = sqlite3.Row
        self._pending: dict[str, list[tuple[Any, ...]]] = {t: [] for t in _COLUMNS}
        self._batches: dict[int, Any] = {}  # step -> the batch that wrote it
        self.ready = False  # a first pass over every file has finished
        self.total_bytes = 0
        self.done_bytes = 0

    # -- building --------------------------------------------------------------------------

    def _open(self) -> sqlite3.Connection:
        db = sqlite3.connect(
            self.db_path, check_same_thread=False, isolation_level=None, timeout=30.0
        )
        db.row_factory = sqlite3.Row
        with contextlib.suppress(sqlite3.DatabaseError):
            db.execute("PRAGMA journal_mode=WAL")
        version = db.execute("PRAGMA user_version").fetchone()[0]
        if version != SCHEMA_VERSION:  # written by another version: start over
            for (name,) in db.execute(
                "SELECT name FROM sqlite_master WHERE type='table'"
            ).fetchall():
                db.execute(f'DROP TABLE IF EXISTS "{name}"')
            db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        db.executescript(_SCHEMA)
        return db

    def trace_dir(self) -> Path:
        traces = self.run_dir / "traces"
        return traces if traces.is_dir() else self.run_dir

    def refresh(self, min_interval: float = 0.5, wait: float | None = None) -> bool:
        """Read what was appended since the last refresh; True when anything was new.

        At most once per `min_interval` seconds it looks at the files (a few stat calls when
        nothing changed). While another thread refreshes, it waits up to `wait` seconds
        (None: as long as it takes) and then returns; the reader sees what is committed."""
        if wait is not None and time.monotonic() - self._gave_up < BUSY_SECONDS:
            return False  # a page's many reads wait for a long first build once, not each
        if not self._refresh_lock.acquire(timeout=-1 if wait is None else wait):
            if wait:
                self._gave_up = time.monotonic()
            return False
        try:
            now = time.monotonic()
            if now - self._refreshed < min_interval:
                return False
            files = [
                (segment, self._add_trace_line)
                for segment in sorted(self.trace_dir().glob("segment-*.jsonl"))
            ]
            files.append((self.run_dir / "samples.jsonl", self._add_sample_line))
            files.append((self.run_dir / "designs.jsonl", self._add_design_line))
            sizes = {}
            for path, _ in files:
                with contextlib.suppress(OSError):
                    sizes[path] = path.stat().st_size
            self.total_bytes = sum(sizes.values())
            self.done_bytes = sum(min(self._consumed(p), n) for p, n in sizes.items())
            changed = False
            for path, add in files:
                changed |= self._consume(path, add)
            self.ready = True
            self._refreshed = time.monotonic()
            return changed
        finally:
            self._refresh_lock.release()

    def progress(self) -> float:
        """Share of the run's bytes indexed (1.0 when up to date)."""
        if self.ready:
            return 1.0
        return min(self.done_bytes / self.total_bytes, 0.99) if self.total_bytes else 0.0

    def _consumed(self, path: Path) -> int:
        row = self._db.execute("SELECT consumed FROM files WHERE path = ?", (self._key(path),))
        found = row.fetchone()
        return found["consumed"] if found else 0

    def _key(self, path: Path) -> str:
        """A file's name relative to the run: a copied or moved run keeps its index."""
        return str(path.relative_to(self.run_dir))

    def _consume(self, path: Path, add: Any) -> bool:
        try:
            size = path.stat().st_size
        except OSError:
            return False
        if size == self._consumed(path):
            return False  # the common case, answered without a write lock
        # IMMEDIATE: a second `masenvs ui` on the same run waits here (busy_timeout) and then
        # sees the lines this one indexed, instead of indexing them twice.
        self._db.execute("BEGIN IMMEDIATE")
        try:
            row = self._db.execute(
                "SELECT id, consumed FROM files WHERE path = ?", (self._key(path),)
            ).fetchone()
            if row is None:
                file_id = self._db.execute(
                    "INSERT INTO files (path, consumed) VALUES (?, 0)", (self._key(path),)
                ).lastrowid
                consumed = 0
            else:
                file_id, consumed = row["id"], row["consumed"]
            if size < consumed:  # rewritten (truncated): read it again from the start
                self._forget(file_id)
                consumed = 0
            offset = consumed
            with open(path, "rb") as f:
                f.seek(consumed)
                for n, line in enumerate(_whole_lines(f), start=1):
                    try:
                        record = _loads(line)
                    except ValueError:  # JSON or UTF-8 errors (orjson's are ValueErrors)
                        record = None  # an unreadable line is skipped, as TraceStore does
                    if isinstance(record, dict):
                        add(record, file_id, offset, len(line))
                    offset += len(line)
                    self.done_bytes += len(line)
                    if n % CHUNK_LINES == 0:  # readers see a large first build fill in
                        self._flush()
                        self._db.execute(
                            "UPDATE files SET consumed = ? WHERE id = ?", (offset, file_id)
                        )
                        self._db.execute("COMMIT")
                        self._db.execute("BEGIN IMMEDIATE")
            self._flush()
            self._db.execute("UPDATE files SET consumed = ? WHERE id = ?", (offset, file_id))
            self._db.execute("COMMIT")
        except BaseException:
            for rows in self._pending.values():
                rows.clear()
            self._db.execute("ROLLBACK")
            raise
        return offset > consumed

    def _flush(self) -> None:
        """Insert the rows read so far (one executemany per table)."""
        for table, rows in self._pending.items():
            if rows:
                marks = ",".join("?" * _COLUMNS[table])
                self._db.executemany(f"INSERT INTO {table} VALUES ({marks})", rows)
                rows.clear()

    def _forget(self, file_id: int) -> None:
        self._flush()
        self._batches.clear()
        for table in ("calls", "episodes", "samples", "designs"):
            self._db.execute(f"DELETE FROM {table} WHERE file = ?", (file_id,))

    def _add_trace_line(self, r: dict[str, Any], file_id: int, offset: int, length: int) -> None:
        if r.get("type") == "call":
            choices = r.get("choices") or []
            first = choices[0] if choices else {}
            rollout = r.get("rollout_id")
            match = _STEP_OF_ROLLOUT.match(rollout or "")
            self._pending["calls"].append(
                (
                    r.get("id"),
                    rollout,
                    r.get("agent"),
                    r.get("call_index"),
                    r.get("step"),
                    int(match.group(1)) if match else None,
                    len(choices),
                    r.get("started_at"),
                    r.get("latency_s"),
                    r.get("policy_version"),
                    len(r.get("prompt_token_ids") or []),
                    sum(len(c.get("token_ids") or []) for c in choices),
                    first.get("finish_reason"),
                    _dumps([str(c.get("text") or "")[:PREVIEW] for c in choices]),
                    file_id,
                    offset,
                    length,
                ),
            )
        elif r.get("type") == "episode":
            extra = r.get("extra") or {}
            self._pending["episodes"].append(
                (
                    r.get("rollout_id"),
                    r.get("task_id"),
                    r.get("env"),
                    int(bool(r.get("success"))),
                    _dumps(r.get("rewards") or {}),
                    extra.get("error"),
                    r.get("created_at"),
                    file_id,
                    offset,
                    length,
                ),
            )

    def _add_sample_line(self, r: dict[str, Any], file_id: int, offset: int, length: int) -> None:
        step = r.get("step")
        if not isinstance(step, int):
            return
        # A resumed run writes a step again: the newest write of a step replaces the older.
        batch = self._batches.get(step)
        if batch is None:
            old = self._db.execute("SELECT batch FROM samples WHERE step = ? LIMIT 1", (step,))
            found = old.fetchone()
            batch = found["batch"] if found else r.get("batch")
        if batch != r.get("batch"):
            self._flush()
            self._db.execute("DELETE FROM samples WHERE step = ?", (step,))
        self._batches[step] = r.get("batch")
        parts = r.get("reward_parts") if isinstance(r.get("reward_parts"), dict) else {}
        self._pending["samples"].append(
            (
                step,
                r.get("batch"),
                r.get("call_id"),
                r.get("choice"),
                r.get("rollout_id"),
                r.get("agent"),
                r.get("policy"),
                _dumps(r.get("group")),
                r.get("task_id"),
                r.get("round"),
                r.get("reward"),
                _dumps(parts),
                _number(parts.get("agent")),
                _number(parts.get("team")),
                _number(r.get("team_term")),
                r.get("advantage"),
                int(bool(r.get("kept"))),
                r.get("drop"),
                int(bool(r.get("continued"))),
                r.get("design_id"),
                None if r.get("failed") is None else int(bool(r.get("failed"))),
                r.get("completion_tokens"),
                file_id,
                offset,
                length,
                offset,
            ),
        )

    def _add_design_line(self, r: dict[str, Any], file_id: int, offset: int, length: int) -> None:
        graph = r.get("graph") or {}
        self._pending["designs"].append(
            (
                r.get("step"),
                r.get("task_id"),
                r.get("round"),
                r.get("design_id"),
                r.get("reward"),
                r.get("error"),
                graph.get("structure") if isinstance(graph, dict) else None,
                len(r.get("executions") or []),
                file_id,
                offset,
                length,
            ),
        )

    # -- reading ---------------------------------------------------------------------------

    def query(self, sql: str, params: tuple[Any, ...] = ()) -> list[dict[str, Any]]:
        with self._read_lock:
            return [dict(row) for row in self._reader.execute(sql, params).fetchall()]

    def record(self, row: dict[str, Any]) -> dict[str, Any] | None:
        """The full JSON record a row points at (one seek and one read)."""
        with self._read_lock:
            found = self._reader.execute(
                "SELECT path FROM files WHERE id = ?", (row["file"],)
            ).fetchone()
        if found is None:
            return None
        try:
            with open(self.run_dir / found["path"], "rb") as f:
                f.seek(row["offset"])
                return _loads(f.read(row["length"]))
        except (OSError, ValueError):
            return None

    def call(self, call_id: str) -> dict[str, Any] | None:
        rows = self.query("SELECT * FROM calls WHERE id = ? LIMIT 1", (call_id,))
        return self.record(rows[0]) if rows else None

    def steps(self) -> list[int]:
        """Training steps with samples (or, for runs written before samples.jsonl, calls)."""
        rows = self.query("SELECT DISTINCT step FROM samples ORDER BY step")
        if rows:
            return [r["step"] for r in rows]
        rows = self.query(
            "SELECT DISTINCT train_step AS step FROM calls WHERE train_step IS NOT NULL "
            "ORDER BY train_step"
        )
        return [r["step"] for r in rows]

    def counts(self) -> dict[str, int]:
        out = {}
        for table in ("calls", "episodes", "samples", "designs"):
            out[table] = self.query(f"SELECT COUNT(*) AS n FROM {table}")[0]["n"]
        return out

    def close(self) -> None:
        with self._refresh_lock, self._read_lock:
            self._db.close()
            self._reader.close()


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) else None


def _whole_lines(f: Any) -> Iterator[bytes]:
    for line in f:
        if not line.endswith(b"\n"):
            return  # being written: read it whole on a later refresh
        yield line


def _db_path(run_dir: Path) -> Path:
    """Next to the run when the run's directory is writable, else in the user's cache."""
    if os.access(run_dir, os.W_OK):
        return run_dir / INDEX_NAME
    digest = hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("MASENVS_CACHE", Path.home() / ".cache" / "masenvs")) / "ui"
    cache.mkdir(parents=True, exist_ok=True)
    return cache / f"{digest}.sqlite"
