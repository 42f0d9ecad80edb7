"""Fixtures shared by the learner tests: the tiny model, loaded once, copied per learner."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from masenvs.adapters.models import load_model


@pytest.fixture(scope="module")
def tiny() -> Any:
    return load_model("tiny").model


@pytest.fixture
def loader(tiny: Any) -> Any:
    def load(name: str, device: torch.device, dtype: torch.dtype) -> Any:
        assert name == "tiny"
        return copy.deepcopy(tiny).to(device=device, dtype=dtype)

    return load
