"""`EngineArgs`: every option of the embedded engine, declared once.

Each option has one default, one set of allowed values and one help text here. The command
lines (`masenvs serve`, `rollout`, `eval`) add their flags with `add_cli_args` and read them
with `from_cli_args`; the trainer's YAML `backend` section takes its engine fields from
`config_fields` (same names, defaults and checks); an engine server started as a child
process gets its flags from `to_cli_args`; `EmbeddedBackend.from_args` reads the engine's
options from it. A new engine option goes here and nowhere else.
No torch at import: the CLIs' `--help` stays fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

Dtype = Literal["auto", "float32", "bfloat16"]
Quantize = Literal["auto", "int4", "int8", "none"]
BatchInvariant = bool | Literal["auto"]

# The command-line spelling of batch_invariant: a bare --batch-invariant is "on".
_INVARIANT_FROM_CLI: dict[str | None, bool | str] = {"on": True, "auto": "auto"}


class ArgumentAdder(Protocol):
    """An `argparse.ArgumentParser` or one of its argument groups."""

    def add_argument(self, *names: str, **options: Any) -> Any: ...


def _option(default: Any, help: str, *, config: bool = False, **bounds: Any) -> Any:
    """A field of `EngineArgs`: `config` puts it in the trainer's YAML `backend` section;
    `bounds` (ge=1) hold in both the YAML and on the command line."""
    return field(default=default, metadata={"help": help, "config": config, "bounds": bounds})


@dataclass(frozen=True)
class EngineArgs:
    """How the embedded engine runs: where, with which weights, how many sequences at once."""

    device: str = _option("cpu", "embedded engine: cpu or cuda")
    threads: int | None = _option(
        None, "embedded engine: torch threads (default: as many as torch picks)", ge=1
    )
    max_batch_size: int = _option(
        32, "Embedded engine: sequences decoded together at most.", config=True, ge=1
    )
    dtype: Dtype = _option(
        "auto",
        "Embedded engine weights; 'auto' is bfloat16 on GPUs and on CPUs with native bf16 "
        "(AVX512-BF16, AMX, Arm BF16) or with the AVX2 kernels, float32 elsewhere. In "
        "training the learner keeps model.dtype and recomputes old log-probs itself, so the "
        "engine's precision only shifts the samples.",
        config=True,
    )
    quantize: Quantize = _option(
        "auto",
        "Embedded engine on CPU in bfloat16: decode steps and short prefills read weight-only "
        "copies. 'auto' packs weights that already are 4- or 8-bit (SmolLM2's GGUF: Q4_1 "
        "layers, Q8_0 head; the 8-bit kind needs the native CPU kernels) as they are, up to "
        "the float16 rounding of each group's scale; 'int4'/'int8' pack every matrix (lossy: "
        "the samples come from a slightly rounded policy); 'none' stays dense.",
        config=True,
    )
    batch_invariant: BatchInvariant = _option(
        False,
        "Embedded engine: every answer (tokens and log-probs) bit-identical however requests "
        "are batched, so greedy results of the same weights reproduce exactly. On (true in "
        "YAML, a bare --batch-invariant on the command line) needs the native CPU kernels "
        "(AVX2 or AVX-512 BF16) and quantize other than 'none'; 'auto' turns it on where that "
        "changes no weight (SmolLM2 on those kernels) and leaves it off elsewhere "
        "(docs/embedded-engine.md). Default: off; masenvs eval: the first checkpoint's setting.",
        config=True,
    )
    max_model_len: int | None = _option(
        None, "embedded engine: tokens of one sequence at most (default: the model's context)", ge=1
    )
    prefix_cache_rows: int = _option(
        4,
        "embedded engine: KV rows kept after their sequence finished, so a prompt that extends "
        "one skips its prefill",
        ge=0,
    )
    single_thread_rows: int | None = _option(
        None,
        "embedded engine: decode steps of at most this many rows run on one thread "
        "(default: measured at start)",
        ge=0,
    )

    def __post_init__(self) -> None:
        if self.batch_invariant not in (True, False, "auto"):
            raise ValueError(
                f"engine option batch_invariant={self.batch_invariant!r}: use true, false or 'auto'"
            )
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            allowed = _choices(f.name)
            if allowed is not None and value not in allowed:
                raise ValueError(
                    f"engine option {f.name}={value!r}: use one of {', '.join(map(repr, allowed))}"
                )
            low = f.metadata["bounds"].get("ge")
            if low is not None and value is not None and value < low:
                raise ValueError(f"engine option {f.name}={value!r} must be at least {low}")

    # ---- command lines ------------------------------------------------------------------

    @classmethod
    def add_cli_args(
        cls,
        parser: argparse.ArgumentParser | argparse._ArgumentGroup,
        names: list[str] | None = None,
    ) -> None:
        """Add `--device`, `--threads`, ... (the options in `names`; default all) to `parser`."""
        for f in _fields(names):
            flag = "--" + f.name.replace("_", "-")
            if f.name == "batch_invariant":
                # Unset (None) lets masenvs eval fall back to the checkpoint's setting.
                parser.add_argument(
                    flag, nargs="?", const="on", choices=["on", "off", "auto"], help=_help(f)
                )
                continue
            kind = _base_type(f.name)
            parser.add_argument(
                flag, type=kind, choices=_choices(f.name), default=f.default, help=_help(f)
            )

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, **run: Any) -> EngineArgs:
        """The options parsed by `add_cli_args` (the defaults for flags it did not add),
        with `run` (e.g. device=...) on top."""
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if not hasattr(args, f.name):
                continue
            value = getattr(args, f.name)
            if f.name == "batch_invariant":
                value = _INVARIANT_FROM_CLI.get(value, False)
            values[f.name] = value
        return cls(**{**values, **run})

    def to_cli_args(self) -> list[str]:
        """This object as `masenvs serve` flags, for an engine server in a child process."""
        argv: list[str] = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            flag = "--" + f.name.replace("_", "-")
            if f.name == "batch_invariant":
                if value:
                    argv += [flag, "auto" if value == "auto" else "on"]
            elif value is not None:  # None: the flag's own default (threads: torch's)
                argv += [flag, str(value)]
        return argv

    # ---- the trainer's YAML section ---------------------------------------------------------

    @classmethod
    def config_fields(cls) -> dict[str, Any]:
        """The options the trainer's YAML `backend` section holds, as pydantic field
        definitions (`create_model(..., **EngineArgs.config_fields())`)."""
        from pydantic import Field

        return {
            f.name: (
                _HINTS[f.name],
                Field(f.default, description=f.metadata["help"], **f.metadata["bounds"]),
            )
            for f in dataclasses.fields(cls)
            if f.metadata["config"]
        }

    @classmethod
    def from_config(cls, section: Any, **run: Any) -> EngineArgs:
        """The options of a config section built from `config_fields`, with `run` on top
        (device and threads come from the run, not the YAML)."""
        names = [f.name for f in dataclasses.fields(cls) if f.metadata["config"]]
        return cls(**{**{n: getattr(section, n) for n in names}, **run})


_HINTS = typing.get_type_hints(EngineArgs)  # the annotations as types, not strings


def _fields(names: list[str] | None) -> list[dataclasses.Field[Any]]:
    every = {f.name: f for f in dataclasses.fields(EngineArgs)}
    unknown = sorted(set(names or []) - set(every))
    if unknown:
        raise ValueError(f"no engine option {unknown[0]!r}; EngineArgs has {', '.join(every)}")
    return [every[n] for n in names] if names is not None else list(every.values())


def _help(f: dataclasses.Field[Any]) -> str:
    text: str = f.metadata["help"]
    return text[0].lower() + text[1:] if text[:1].isupper() else text


def _choices(name: str) -> list[Any] | None:
    """The allowed values of a Literal-typed option (`dtype`, `quantize`); None otherwise."""
    hint = _HINTS[name]
    if typing.get_origin(hint) is Literal:
        return list(typing.get_args(hint))
    return None


def _base_type(name: str) -> type:
    """The flag's argparse type: int for `threads` (int | None), float for a float, else str."""
    hint = _HINTS[name]
    members = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    return members[0] if members[0] in (int, float) else str
