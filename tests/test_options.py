"""Options declared once: one `key=value` parser (masenvs.overrides) for every `--set` and
for `load_config`, one `EngineArgs` behind every engine flag, YAML field and engine-server
command line, and one name for K (`branches`), the old spellings still working with a warning."""

from __future__ import annotations

import argparse
import ast
import asyncio
import dataclasses
from pathlib import Path

import pytest

import masenvs.cli
from masenvs import overrides
from masenvs.adapters import rollout
from masenvs.adapters.backends.launch import launch_engine_server
from masenvs.adapters.frameworks.workflow import WorkflowSpec, run_tasks
from masenvs.adapters.serve import build_parser as serve_parser
from masenvs.adapters.stack import add_engine_arguments, engine_options
from masenvs.engine.args import EngineArgs
from masenvs.trainer.commands import workflow as workflow_cli
from masenvs.trainer.config import BackendConfig, ConfigError, TrainConfig, load_config

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [p for d in ("masenvs", "adapters", "trainer") for p in (ROOT / d).rglob("*.py")]


# ---- one override parser -------------------------------------------------------------------


def test_every_set_flag_reads_values_the_same_way() -> None:
    assert masenvs.cli.parse_overrides is overrides.parse_overrides
    assert overrides.parse_overrides(["size=9", "x=true", "name=a b", "l=[1, 2]", "v=[oops"]) == {
        "size": 9,
        "x": True,
        "name": "a b",
        "l": [1, 2],
        "v": "[oops",  # what YAML cannot read stays text (it used to crash the CLI)
    }
    with pytest.raises(SystemExit, match="--set expects key=value, got 'size'"):
        overrides.parse_overrides(["size"])
    assert overrides.parse_pairs(["tool=runs/x/tool", "a=b=c"], "--adapter") == {
        "tool": "runs/x/tool",
        "a": "b=c",
    }
    with pytest.raises(ConfigError, match="--route expects NAME=VALUE, got 'plan='"):
        overrides.parse_pairs(["plan="], "--route")


def test_load_config_overrides_keep_their_messages() -> None:
    cfg = load_config(None, ["optim.lr=2e-5", "backend.batch_invariant=auto", "env.options.size=5"])
    assert cfg.optim.lr == 2e-5 and cfg.backend.batch_invariant == "auto"
    assert cfg.env.options == {"size": 5}
    with pytest.raises(ConfigError, match=r"optim.lrr: unknown field \(did you mean 'lr'\?\)"):
        load_config(None, ["optim.lrr=1"])
    with pytest.raises(ConfigError, match="'seed.x=1': seed is a value, not a section"):
        load_config(None, ["seed.x=1"])
    with pytest.raises(ConfigError, match="must look like section.field=value"):
        load_config(None, ["=1"])


def test_no_library_module_imports_the_cli() -> None:
    """The CLI dispatches to rollout, eval and train; none of them may import it back."""
    offenders = []
    for path in SOURCES:
        if path in (ROOT / "masenvs" / "cli.py", ROOT / "masenvs" / "__main__.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            if "masenvs.cli" in names:
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders == []


# ---- one EngineArgs --------------------------------------------------------------------------


def test_the_backend_section_takes_its_engine_fields_from_engine_args() -> None:
    declared = EngineArgs.config_fields()
    assert set(declared) == {"max_batch_size", "dtype", "quantize", "batch_invariant"}
    defaults = {f.name: f.default for f in dataclasses.fields(EngineArgs)}
    for name, (_, field) in declared.items():
        model_field = BackendConfig.model_fields[name]
        assert model_field.description == field.description
        assert model_field.default == defaults[name] == getattr(TrainConfig().backend, name)
    # The YAML section keeps its order, names and checks.
    assert list(BackendConfig.model_fields)[-4:] == [
        "max_batch_size",
        "dtype",
        "quantize",
        "batch_invariant",
    ]
    with pytest.raises(ConfigError, match="backend.max_batch_size: Input should be greater"):
        load_config(None, ["backend.max_batch_size=0"])
    with pytest.raises(ConfigError, match=r"did you mean 'batch_invariant'"):
        load_config(None, ["backend.batch_invarant=true"])
    with pytest.raises(ConfigError, match="backend.dtype: Input should be 'auto', 'float32'"):
        load_config(None, ["backend.dtype=fp16"])
    # The run's engine: the YAML's fields, the run's device, EngineArgs' defaults elsewhere.
    assert TrainConfig().backend.engine_args(device="cuda") == EngineArgs(device="cuda")


def test_serve_help_and_the_yaml_description_are_one_text() -> None:
    actions = {a.dest: a for a in serve_parser()._actions}
    for name in ("batch_invariant", "dtype", "quantize", "max_batch_size"):
        description = BackendConfig.model_fields[name].description
        assert actions[name].help[1:] == description[1:]  # the flag's starts lower-case
    assert actions["dtype"].choices == ["auto", "float32", "bfloat16"]


def test_batch_invariant_is_declared_only_in_engine_args() -> None:
    """No other module declares the option: no class field, no argparse flag of its own."""
    declared = []
    for path in SOURCES:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            is_field = (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and node.target.id == "batch_invariant"
                and isinstance(node.value, ast.Call)
            )
            is_flag = (
                isinstance(node, ast.Call)
                and getattr(node.func, "attr", "") == "add_argument"
                and any(
                    isinstance(a, ast.Constant) and a.value == "--batch-invariant"
                    for a in node.args
                )
            )
            if is_field or is_flag:
                declared.append(str(path.relative_to(ROOT)))
    assert declared == ["masenvs/engine/args.py"]


def test_the_engine_is_built_from_engine_args_and_restates_none_of_them() -> None:
    """EmbeddedBackend's doors take an EngineArgs (from_spec: its fields by name), so no
    parameter of theirs declares an engine option again, under its own name or another."""
    import inspect

    from masenvs.engine.engine import EmbeddedBackend

    doors = {
        EmbeddedBackend.__init__: ["self", "loaded", "args"],
        EmbeddedBackend.from_args: ["model", "args"],
        EmbeddedBackend.from_spec: ["spec", "options"],
    }
    for door, params in doors.items():
        assert list(inspect.signature(door).parameters) == params, door.__qualname__
    engine = EmbeddedBackend.from_spec("tiny", max_batch_size=2, prefix_cache_rows=1)
    try:
        assert engine.args == EngineArgs(max_batch_size=2, prefix_cache_rows=1)
        assert (engine.max_batch_size, len(engine.scheduler.prefixes.rows)) == (2, 1)
    finally:
        engine.shutdown()
    with pytest.raises(TypeError, match="num_threads"):  # the old spelling of threads
        EmbeddedBackend.from_spec("tiny", num_threads=2)


@pytest.mark.parametrize(
    "engine",
    [
        EngineArgs(),
        EngineArgs(max_model_len=256, prefix_cache_rows=0, single_thread_rows=2),
        EngineArgs(device="cuda", threads=3, max_batch_size=8, dtype="float32", quantize="none"),
        EngineArgs(dtype="bfloat16", quantize="int8", batch_invariant=True),
        EngineArgs(batch_invariant="auto", threads=1),
    ],
)
def test_an_engine_server_child_parses_back_the_options_it_was_given(engine) -> None:
    """`launch_engine_server` hands EngineArgs to `masenvs serve --engine` as flags."""
    args = serve_parser().parse_args(["--engine", *engine.to_cli_args()])
    assert EngineArgs.from_cli_args(args) == engine


def test_rollout_and_eval_flags_keep_their_defaults() -> None:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args([])
    assert args.batch_invariant is None  # eval: the checkpoint's setting
    assert engine_options(args) == {"dtype": "auto", "quantize": "auto", "batch_invariant": False}
    assert not hasattr(args, "device") and not hasattr(args, "threads")


def test_bad_engine_options_fail_in_one_sentence_before_anything_starts() -> None:
    with pytest.raises(ValueError, match="engine option dtype='fp16': use one of 'auto'"):
        EngineArgs(dtype="fp16")
    with pytest.raises(ValueError, match="max_batch_size=0 must be at least 1"):
        EngineArgs(max_batch_size=0)
    with pytest.raises(ValueError, match="batch_invariant='yes'"):
        EngineArgs(batch_invariant="yes")
    with pytest.raises(ValueError, match="quantize='int3'"):  # no process was started
        launch_engine_server("tiny", quantize="int3")
    with pytest.raises(ValueError, match="no engine option 'dtyp'"):
        EngineArgs.add_cli_args(argparse.ArgumentParser(), ["dtyp"])


# ---- K is `branches` -------------------------------------------------------------------------


@pytest.mark.parametrize("parser", [rollout.build_parser(), workflow_cli.build_parser("x")])
def test_branches_is_the_flag(parser) -> None:
    base = ["--env", "math"] if parser.prog.endswith("rollout") else []
    assert parser.parse_args([*base, "--branches", "3"]).branches == 3


def test_run_tasks_needs_at_least_one_branch() -> None:
    spec = WorkflowSpec(factory="x:y", framework="langgraph", agents=["a"])
    common = {"root_url": "http://127.0.0.1:9", "env_name": "math", "seeds": [0]}
    with pytest.raises(ValueError, match="branches .* must be at least 1, got 0"):
        asyncio.run(run_tasks(spec, branches=0, **common))


def _command_parsers() -> dict[str, argparse.ArgumentParser]:
    from masenvs.adapters import rollout, serve
    from masenvs.integrations import openenv_serve
    from masenvs.trainer.commands import eval as eval_command
    from masenvs.trainer.commands import sft, train
    from masenvs.trainer.commands import workflow as workflow_command
    from masenvs.ui import server as ui

    return {
        "serve": serve.build_parser(),
        "rollout": rollout.build_parser(),
        "eval": eval_command.build_parser(),
        "sft": sft.build_parser(),
        "train": train.build_parser(),
        "workflow": workflow_command.build_parser("a workflow"),
        "ui": ui.build_parser(),
        "openenv-serve": openenv_serve.build_parser(),
    }


def test_a_flag_means_one_thing_in_every_command() -> None:
    """A flag two commands share takes the same kind of value in both (issue 43: `--policy`
    was a route in rollout and a policy mode in the workflow scripts; `--episodes` counted
    episodes in rollout and tasks in eval and the workflow scripts)."""
    seen: dict[str, tuple[str, tuple[object, ...]]] = {}
    clashes = []
    for command, parser in _command_parsers().items():
        for action in parser._actions:
            for flag in action.option_strings:
                if not flag.startswith("--") or flag == "--help":
                    continue
                kind = (_kind(action.type), action.choices, action.metavar, action.nargs)
                if flag in seen and seen[flag][1] != kind:
                    clashes.append(f"{flag}: {seen[flag][0]} {seen[flag][1]} vs {command} {kind}")
                seen.setdefault(flag, (command, kind))
    assert not clashes, clashes
    assert "--policy" not in seen and "--route" in seen
    assert "--episodes" not in {a for a in _flags("eval")} | {a for a in _flags("workflow")}


def _flags(command: str) -> set[str]:
    parser = _command_parsers()[command]
    return {flag for action in parser._actions for flag in action.option_strings}


def _kind(parse: object) -> str:
    """What a flag's value is: text (str, a path) or what its parser makes of it."""
    if parse in (None, str, Path):
        return "text"
    return getattr(parse, "__qualname__", repr(parse))
