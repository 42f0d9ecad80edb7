"""A workflow's factory: the function that builds the user's program for each run, named
`module:function` or `path/file.py:function`, and the `WorkflowContext` it gets.

A factory takes the `WorkflowContext` (`def make(ctx)`), or is the agent's own builder
taking one framework client per parameter (`def make_graph(solver_llm, checker_llm)`):
`bind_clients` maps each parameter to an agent, from `workflow.llm_args` or the names.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
import sys
from collections.abc import Callable, Mapping, Sequence
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


# -- builders that take clients, not a context -------------------------------------------------

log = logging.getLogger("masenvs.frameworks")
CONTEXT_NAMES = ("ctx", "context")
CLIENT_NAMES = ("llm", "model_client", "client", "model", "chat_model")  # of a lone agent
CLIENT_SUFFIXES = ("_llm", "_model_client", "_client", "_chat_model", "_model")
_said: set[str] = set()


def bind_clients(
    factory: Factory, ref: str, agents: Sequence[str], llm_args: Mapping[str, str]
) -> Factory:
    """`factory` as a function of the `WorkflowContext`: each client parameter gets its agent's
    framework client (`llm_args`, else inferred from the names and logged once); a parameter
    named `ctx`/`context` or typed `WorkflowContext` gets the context. One-line errors."""
    if getattr(factory, "binds", None) is not None:
        return factory  # bound already (the trainer hands the pre-checked factory on)
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # a builtin or an extension: called with the context
        return factory
    params = [
        p for p in signature.parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    names = [p.name for p in params]
    extra = [name for name in llm_args if name not in names]
    if extra:
        raise ValueError(
            f"workflow.llm_args maps {', '.join(map(repr, extra))}, which factory {ref!r} does "
            f"not take (its parameters: {', '.join(names) or 'none'})"
        )
    required = [p for p in params if p.default is p.empty]
    if not llm_args and len(required) == 1 and _is_context(required[0], agents, strict=False):
        return factory  # def make(ctx): the context as it is
    plan, inferred, context, missing = {}, {}, None, []
    for p in params:
        agent = llm_args.get(p.name) or _agent_of(p.name, agents)
        if p.name in llm_args:
            plan[p.name] = llm_args[p.name]
        elif _is_context(p, agents, strict=True):
            context = p.name
        elif agent is not None:
            plan[p.name] = inferred[p.name] = agent
        elif p.default is p.empty:
            missing.append(p.name)
    if missing:
        raise ValueError(
            f"factory {ref!r} takes {', '.join(missing)}, which masenvs cannot map to an agent "
            f"({', '.join(agents)}): set workflow.llm_args, e.g. "
            f"{{{missing[0]}: {agents[0]}}}, or take a WorkflowContext (def make(ctx))"
        )
    if inferred and ref not in _said:
        _said.add(ref)
        given = ", ".join(f"{name} -> {agent}" for name, agent in inferred.items())
        log.warning(
            "factory %s: each parameter gets its agent's client: %s (inferred from the "
            "parameter names; set workflow.llm_args to map them otherwise)",
            ref,
            given,
        )
    positional = {p.name for p in params if p.kind == p.POSITIONAL_ONLY}

    def build(ctx: WorkflowContext) -> Any:
        values = {name: ctx.clients[agent] for name, agent in plan.items()}
        if context is not None:
            values[context] = ctx
        args = [values.pop(p.name) for p in params if p.name in positional and p.name in values]
        return factory(*args, **values)

    build.binds = factory  # type: ignore[attr-defined]
    return build


def _is_context(param: inspect.Parameter, agents: Sequence[str], strict: bool) -> bool:
    """Typed or named as the context; with `strict` off, also any lone parameter whose name
    is not a client's (today's `def make(c)`)."""
    annotation = param.annotation
    if annotation is WorkflowContext or (
        isinstance(annotation, str) and annotation.rpartition(".")[2] == "WorkflowContext"
    ):
        return True
    if param.name in CONTEXT_NAMES:
        return True
    return not strict and not _looks_like_client(param.name, agents)


def _looks_like_client(name: str, agents: Sequence[str]) -> bool:
    return name in agents or name in CLIENT_NAMES or name.endswith(CLIENT_SUFFIXES)


def _agent_of(name: str, agents: Sequence[str]) -> str | None:
    """solver_llm -> solver, checker -> checker; llm or model_client -> the only agent."""
    if name in agents:
        return name
    for suffix in CLIENT_SUFFIXES:
        if name.endswith(suffix) and name[: -len(suffix)] in agents:
            return name[: -len(suffix)]
    if name in CLIENT_NAMES and len(agents) == 1:
        return agents[0]
    return None
