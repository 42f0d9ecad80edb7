"""Shared fixtures: the tiny model (loaded once, copied per learner), each native kernel set;
the tiers each test belongs to (tests/tiers.py, docs/testing.md)."""

from __future__ import annotations

import copy
import shutil
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from exclusive import held
from tiers import classify, left_out_counts, left_out_summary

from masenvs.engine import kernels as cpu_kernels
from masenvs.engine.loading import load_model


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by the marks added here
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    classify(items)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    # A serial, cluster or vLLM test runs alone under xdist too (tests/exclusive.py).
    with held(item):
        yield


def pytest_deselected(items: list[pytest.Item]) -> None:
    _deselected.extend(items)


_deselected: list[pytest.Item] = []
_left_out: dict[str, int] = {}  # under xdist: what the first worker to finish left out


def pytest_report_collectionfinish(config: pytest.Config) -> list[str]:
    # Shown under -q too, unlike pytest_report_header: a fast run says what it did not run.
    if hasattr(config, "workerinput"):  # an xdist worker: the controller says it at the end
        return []
    return left_out_summary(left_out_counts(_deselected))


def pytest_sessionfinish(session: pytest.Session) -> None:
    if hasattr(session.config, "workeroutput"):  # an xdist worker tells the controller
        session.config.workeroutput["left_out"] = left_out_counts(_deselected)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook, on the controller
def pytest_testnodedown(node: Any, error: Any) -> None:
    _left_out.update(getattr(node, "workeroutput", {}).get("left_out", {}))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    for line in left_out_summary(_left_out):
        terminalreporter.write_line(line)


@pytest.fixture(scope="module")
def tiny() -> Any:
    return load_model("tiny").model


@pytest.fixture
def loader(tiny: Any) -> Any:
    def load(name: str, device: torch.device, dtype: torch.dtype) -> Any:
        assert name == "tiny"
        return copy.deepcopy(tiny).to(device=device, dtype=dtype)

    return load


@pytest.fixture(
    params=[
        pytest.param(
            name,
            marks=pytest.mark.skipif(
                not cpu_kernels.cpu_supports(name) or shutil.which("gcc") is None,
                reason=f"needs gcc and a CPU with {', '.join(kernels.cpu_flags)}",
            ),
        )
        for name, kernels in cpu_kernels.KERNEL_SETS.items()
    ]
)
def kernels(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Each kernel set in turn, forced with MASENVS_CPU_KERNELS."""
    cpu_kernels._resolve.cache_clear()  # forget the set chosen before
    monkeypatch.setenv("MASENVS_CPU_KERNELS", request.param)
    assert cpu_kernels.kernel_set() == request.param
    yield request.param
    monkeypatch.delenv("MASENVS_CPU_KERNELS")
    cpu_kernels._resolve.cache_clear()
