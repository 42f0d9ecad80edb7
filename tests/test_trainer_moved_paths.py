"""Names that moved out of trainer modules in the issue-28 split still import from their old
paths for one release, with a DeprecationWarning, and are the very same objects."""

from __future__ import annotations

import importlib

import pytest

MOVED = [
    # (old module, name, new module)
    ("masenvs.trainer.learner", "ModelLoader", "masenvs.trainer.policies"),
    ("masenvs.trainer.learner", "load_base_model", "masenvs.trainer.policies"),
    ("masenvs.trainer.learner", "Policy", "masenvs.trainer.policies"),
    ("masenvs.trainer.learner", "Unit", "masenvs.trainer.packing"),
    ("masenvs.trainer.learner", "prompt_units", "masenvs.trainer.packing"),
    ("masenvs.trainer.learner", "unit_length", "masenvs.trainer.packing"),
    ("masenvs.trainer.learner", "plan_microbatches", "masenvs.trainer.packing"),
    ("masenvs.trainer.learner", "MicroBatch", "masenvs.trainer.packing"),
    ("masenvs.trainer.learner", "build_microbatch", "masenvs.trainer.packing"),
    ("masenvs.trainer.learner", "token_logprobs", "masenvs.trainer.scoring"),
    ("masenvs.trainer.learner", "matmul_flops_per_s", "masenvs.trainer.flops"),
    ("masenvs.trainer.learner", "mfu_metrics", "masenvs.trainer.flops"),
    ("masenvs.trainer.learner", "linear_params", "masenvs.trainer.flops"),
    ("masenvs.trainer.learner", "forward_flops", "masenvs.trainer.flops"),
    ("masenvs.trainer.learner", "ADAPTER_WEIGHTS", "masenvs.trainer.weights"),
    ("masenvs.trainer.learner", "ADAPTER_CONFIG", "masenvs.trainer.weights"),
    ("masenvs.trainer.learner", "MODEL_WEIGHTS", "masenvs.trainer.weights"),
    ("masenvs.trainer.dist_learner", "RankLearner", "masenvs.trainer.rank_learner"),
    ("masenvs.trainer.dist_learner", "load_sharded_optimizers", "masenvs.trainer.rank_learner"),
]


@pytest.mark.parametrize(("old", "name", "new"), MOVED, ids=[f"{o}.{n}" for o, n, _ in MOVED])
def test_a_moved_name_imports_from_its_old_path_with_a_warning(
    old: str, name: str, new: str
) -> None:
    module = importlib.import_module(old)
    with pytest.warns(DeprecationWarning, match=f"{new}.{name}"):
        value = getattr(module, name)
    assert value is getattr(importlib.import_module(new), name)


def test_from_import_of_an_old_path_warns_too() -> None:
    with pytest.warns(DeprecationWarning, match="masenvs.trainer.packing.prompt_units"):
        from masenvs.trainer.learner import prompt_units
    from masenvs.trainer.packing import prompt_units as new

    assert prompt_units is new


def test_names_that_stay_import_without_a_warning() -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        from masenvs.trainer.dist_learner import DistributedLearner, make_learner  # noqa: F401
        from masenvs.trainer.learner import Learner, lr_at  # noqa: F401


def test_an_unknown_name_is_still_an_attribute_error() -> None:
    learner = importlib.import_module("masenvs.trainer.learner")
    with pytest.raises(AttributeError, match="no_such_name"):
        learner.no_such_name  # noqa: B018
