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


def list_envs() -> list[str]:
    return sorted(_ENVS)


class UnknownEnvError(KeyError):
    """A name no env is registered under; its message is one plain line (not KeyError's repr)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def env_class(name: str) -> type[MASEnv]:
    if name not in _ENVS:
        known = ", ".join(list_envs())
        close = difflib.get_close_matches(str(name), list_envs(), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise UnknownEnvError(f"unknown environment {name!r}; {hint}known environments: {known}")
    module, _, attr = _ENVS[name].partition(":")
    return getattr(importlib.import_module(module), attr)


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
