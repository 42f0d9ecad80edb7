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
    ("masenvs.trainer.train", "env_options", "masenvs.trainer.sources"),
    ("masenvs.trainer.train", "env_factory", "masenvs.trainer.sources"),
    ("masenvs.trainer.train", "agent_sampling", "masenvs.trainer.sources"),
    ("masenvs.trainer.train", "rollout_metrics", "masenvs.trainer.sources"),
    ("masenvs.trainer.train", "rollout_sample_seed", "masenvs.trainer.sources"),
    ("masenvs.trainer.train", "TreeSource", "masenvs.trainer.sources"),
    ("masenvs.trainer.train", "validation_metrics", "masenvs.trainer.sources"),
    ("masenvs.trainer.train", "WorkflowSource", "masenvs.trainer.sources"),
    ("masenvs.trainer.evaluate", "main", "masenvs.trainer.eval_cli"),
    ("masenvs.trainer.evaluate", "build_parser", "masenvs.trainer.eval_cli"),
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
        from masenvs.trainer.evaluate import DirectPolicy, evaluate, pass_at_k  # noqa: F401
        from masenvs.trainer.learner import Learner, lr_at  # noqa: F401
        from masenvs.trainer.train import endpoint_binding, seed_everything, train  # noqa: F401


def test_an_unknown_name_is_still_an_attribute_error() -> None:
    learner = importlib.import_module("masenvs.trainer.learner")
    with pytest.raises(AttributeError, match="no_such_name"):
        learner.no_such_name  # noqa: B018


def test_the_eval_library_does_not_load_the_command_line() -> None:
    # The library sits below the CLI layer: importing it must not import masenvs eval's parser.
    import subprocess
    import sys

    code = (
        "import sys, masenvs.trainer.evaluate\n"
        "assert 'masenvs.trainer.eval_cli' not in sys.modules, 'the CLI module was loaded'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
