"""A workflow's factory: the function that builds the user's program for each run, named
`module:function` or `path/file.py:function`, and the `WorkflowContext` it gets."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from masenvs.adapters.frameworks.clients import Clients
from masenvs.adapters.frameworks.programs import Messages, failure_reason


@dataclass
class WorkflowContext:
    """What a factory gets: the clients of one run and the task it is about to solve."""

    clients: Clients  # agent name -> framework client at this run's endpoint URL
    messages: Messages  # the task as chat messages (the env's solo-role prompt)
    task: str  # the same as one text (what an AutoGen team / LlamaIndex agent is asked)
    base_url: str  # this run's OpenAI base URL, .../r/{rollout_id}/v1
    rollout_id: str
    env: str
    seed: int
    run_index: int  # k of the K runs of this task
    task_info: dict[str, Any]  # the env's facts about the task (ids, sizes)


Factory = Callable[[WorkflowContext], Any]


def load_factory(ref: str) -> Factory:
    """Import `module:function` (or `path/file.py:function`) and return the function."""
    module_name, sep, attr = ref.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"factory {ref!r} must look like 'module:function' or 'file.py:function'")
    module = _import(module_name, ref)
    factory = getattr(module, attr, None)
    if factory is None or not callable(factory):
        raise ValueError(f"factory {ref!r}: {module_name} has no function {attr!r}")
    return factory


def _import(module_name: str, ref: str) -> Any:
    path = Path(module_name)
    if module_name.endswith(".py") or not path.suffix and "/" in module_name:
        return _import_file(path if path.suffix else path.with_suffix(".py"), ref)
    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        # A console script's sys.path does not hold the working directory: `my_graph:build`
        # names a module there, as it would for `python -m`.
        sys.path.append(str(Path.cwd()))
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        # `examples.my_graph` run from the repository root (a folder with no __init__.py).
        candidate = Path(*module_name.split(".")).with_suffix(".py")
        if exc.name and module_name.startswith(exc.name) and candidate.is_file():
            return _import_file(candidate, ref)
        raise ValueError(f"factory {ref!r}: cannot import {module_name}: {exc}") from exc
    except Exception as exc:
        raise ValueError(
            f"factory {ref!r}: importing {module_name} failed: {failure_reason(exc)}"
        ) from exc


def _import_file(path: Path, ref: str) -> Any:
    if not path.is_file():
        raise ValueError(f"factory {ref!r}: file {path} does not exist")
    name = f"masenvs_workflow_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"factory {ref!r}: cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pydantic look their module up here
    folder = str(path.resolve().parent)
    if folder not in sys.path:  # the factory's own imports of its sibling modules
        sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise ValueError(
            f"factory {ref!r}: importing {path} failed: {failure_reason(exc)}"
        ) from exc
    return module
