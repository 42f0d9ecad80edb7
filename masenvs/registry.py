"""Environment registry: `masenvs.make("sudoku", size=4)` and `masenvs list`."""

from __future__ import annotations

import difflib
import importlib
from typing import Any

from masenvs.env import MASEnv, build_config

# name -> "module:Class"; imported on first use so `masenvs list` stays fast.
_ENVS: dict[str, str] = {}


def register(name: str, entry_point: str) -> None:
    """Register an env class by import path, e.g. `register("maze", "mypkg.maze:MazeEnv")`."""
    if name in _ENVS and _ENVS[name] != entry_point:
        raise ValueError(f"environment {name!r} is already registered as {_ENVS[name]}")
    _ENVS[name] = entry_point
    from masenvs.wrappers import register_gymnasium  # gymnasium.make("masenvs/<name>-v0")

    register_gymnasium(name)


# Envs that play another framework's environment (a server by URL, a verifiers taskset): a
# config names them like any env, but they are no task of their own, so `list_envs` (and
# every test looping over the task envs) leaves them out. Imported on first use too.
_BRIDGES: dict[str, str] = {
    "openenv": "masenvs.integrations.from_openenv:OpenEnvEnv",
    "verifiers": "masenvs.integrations.from_verifiers:VerifiersEnv",
}


def list_envs() -> list[str]:
    """The task envs (`list_bridges` names the envs that wrap another framework's)."""
    return sorted(_ENVS)


def list_bridges() -> list[str]:
    return sorted(_BRIDGES)


class UnknownEnvError(KeyError):
    """A name no env is registered under; its message is one plain line (not KeyError's repr)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def env_class(name: str) -> type[MASEnv]:
    entry = _ENVS.get(name) or _BRIDGES.get(name)
    if entry is None:
        names = [*list_envs(), *list_bridges()]
        close = difflib.get_close_matches(str(name), names, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise UnknownEnvError(
            f"unknown environment {name!r}; {hint}known environments: {', '.join(list_envs())} "
            f"(and {', '.join(list_bridges())}, which play another framework's environments)"
        )
    module, _, attr = entry.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except ImportError as exc:
        if name not in _BRIDGES:
            raise
        raise ImportError(
            f"environment {name!r} needs {exc.name or 'a package that is missing'}: "
            f"{_BRIDGE_INSTALL[name]} (docs/integrations.md)"
        ) from exc


_BRIDGE_INSTALL = {
    "openenv": "pip install 'masenvs[integrations]'",
    "verifiers": "install masenvs[verifiers] in an environment of its own "
    "(scripts/verifiers_env.sh)",
}


def check_options(name: str, options: dict[str, Any]) -> None:
    """Fail as `make` would on a bad env name or option, without building the env (no task
    data is loaded): configs are checked when they are read, before any model loads."""
    cls = env_class(name)
    build_config(cls.name, cls.config_class, options)


def make(name: str, render_mode: str | None = None, **config: Any) -> MASEnv:
    """Build a registered environment; keyword arguments are its config fields."""
    return env_class(name)(render_mode=render_mode, **config)


for _name, _entry in {
    "plan_path": "masenvs.envs.plan_path:PlanPathEnv",
    "sudoku": "masenvs.envs.sudoku:SudokuEnv",
    "sokoban": "masenvs.envs.sokoban:SokobanEnv",
    "math": "masenvs.envs.math:MathEnv",
    "code": "masenvs.envs.code:CodeEnv",
    "auto_mas": "masenvs.envs.auto_mas:AutoMASEnv",
    "verilog": "masenvs.envs.verilog:VerilogEnv",
    "web_search": "masenvs.envs.web_search:WebSearchEnv",
    "say": "masenvs.envs.say:SayEnv",
}.items():
    register(_name, _entry)
