"""Tests that must run alone, even under pytest-xdist (docs/testing.md).

A `serial` test measures time, memory or host-wide state, and a `cluster` or `vllm` test takes
both cores itself: a neighbour in the next worker would change the verdict. Under xdist every
test holds a lock shared by all workers of the run: the others hold it shared, these hold it
exclusive, so they start once the running tests have ended and nothing starts beside them.
A turnstile keeps the exclusive ones from waiting forever behind a stream of shared ones.
Without xdist (one process) the lock is not taken.
"""

from __future__ import annotations

import contextlib
import fcntl
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from tiers import PARALLEL_UNSAFE


def lock_dir(config: pytest.Config) -> Path | None:
    """The lock files of this xdist run (all its workers share the run's uid); None: no xdist.

    Read from the worker's config, not the environment: a pytest that a test starts in a
    subprocess inherits PYTEST_XDIST_WORKER, and must not wait on the run's lock."""
    worker = getattr(config, "workerinput", None)
    if worker is None:
        return None
    path = Path(tempfile.gettempdir()) / f"masenvs-pytest-{worker['testrunuid']}"
    path.mkdir(exist_ok=True)
    return path


@contextlib.contextmanager
def held(item: pytest.Item) -> Iterator[None]:
    """Hold the run's lock, exclusive for a PARALLEL_UNSAFE test, shared for any other."""
    where = lock_dir(item.config)
    if where is None:
        yield
        return
    alone = any(item.get_closest_marker(mark) for mark in PARALLEL_UNSAFE)
    with open(where / "turnstile", "a") as turnstile, open(where / "tests", "a") as tests:
        fcntl.flock(turnstile, fcntl.LOCK_EX)  # waits while an exclusive test waits or runs
        try:
            fcntl.flock(tests, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(tests, fcntl.LOCK_UN)
