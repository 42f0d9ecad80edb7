"""Shared fixtures: the tiny model (loaded once, copied per learner), each native kernel set;
the tiers each test belongs to (tests/tiers.py, docs/testing.md)."""

from __future__ import annotations

import copy
import shutil
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from tiers import classify, left_out_summary

from masenvs.engine import kernels as cpu_kernels
from masenvs.engine.loading import load_model


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by the marks added here
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    classify(items)


def pytest_deselected(items: list[pytest.Item]) -> None:
    _deselected.extend(items)


_deselected: list[pytest.Item] = []


def pytest_report_collectionfinish() -> list[str]:
    # Shown under -q too, unlike pytest_report_header: a fast run says what it did not run.
    return left_out_summary(_deselected)


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
