"""`SamplingArgs`: how one call samples, declared once, in the core so every layer reads it.

Each knob (temperature, top_p, top_k, repetition_penalty, max_tokens) has one default, one
set of bounds and one help text here. The trainer's YAML (`rollout.*`, `agents.<name>.*`)
takes its fields from `config_fields`; the commands add their flags with `add_cli_args`; the
endpoint's request schema and the engine's checks read `bounds`; `SamplingParams` (the
engine's request) and the clients' `Sampling` take their defaults from here. A call's trace
record keeps the values it used, and a training `Sample` reads them back (`from_record`), so
the learner scores each sample at the temperature it was drawn with. No torch at import.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any

_WORDS = {"ge": "at least", "gt": "above", "le": "at most", "lt": "below"}
_HOLDS = {
    "ge": lambda v, b: v >= b,
    "gt": lambda v, b: v > b,
    "le": lambda v, b: v <= b,
    "lt": lambda v, b: v < b,
}


def _option(default: Any, help: str, **bounds: Any) -> Any:
    """A field of `SamplingArgs`: `bounds` (ge=0.0, le=2.0) hold in the YAML, on the
    command line, in the endpoint's schema and in the engine."""
    return field(default=default, metadata={"help": help, "bounds": bounds})


@dataclass(frozen=True)
class SamplingArgs:
    """How a call samples: the raw model's logits, penalized, divided by the temperature,
    cut to top_k and top_p, then drawn from; at most max_tokens tokens."""

    temperature: float = _option(
        1.0,
        "Sampling temperature; 0 is greedy. The learner scores each sample at the temperature "
        "it was sampled with (the trace records it), so the PPO ratio is against the "
        "distribution that was sampled.",
        ge=0.0,
        le=2.0,
    )
    top_p: float = _option(1.0, "Nucleus sampling mass; 1.0 is off.", gt=0.0, le=1.0)
    top_k: int = _option(
        0, "Sample among the k most likely tokens only; 0 (or vLLM's -1) is off.", ge=-1
    )
    max_tokens: int = _option(512, "Completion token limit per LLM call.", ge=1)
    repetition_penalty: float = _option(
        1.0,
        "vLLM's repetition penalty over the prompt's and the answer's tokens (>1 repeats "
        "less); 1.0 is off. Sampling only: the learner scores the raw policy at the "
        "temperature, so with a penalty (or top_p, top_k) the samples are not quite the "
        "policy's own.",
        gt=0.0,
    )

    def __post_init__(self) -> None:
        problems = self.problems(self)
        if problems:
            raise ValueError(f"sampling option {problems[0]}")

    # ---- bounds -------------------------------------------------------------------------

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(SamplingArgs)]

    @classmethod
    def bounds(cls, name: str) -> dict[str, Any]:
        """The bounds of one knob as pydantic takes them (`Field(..., **bounds)`)."""
        return dict(_field(name).metadata["bounds"])

    @classmethod
    def problems(cls, values: Any) -> list[str]:
        """What is out of bounds in `values` (a dict, or anything with these attributes: a
        `SamplingParams`, a config section), one sentence each; [] when all hold."""
        out = []
        for f in dataclasses.fields(SamplingArgs):
            if isinstance(values, dict):
                value = values.get(f.name)
            else:
                value = getattr(values, f.name, None)
            if value is None:
                continue
            for rule, bound in f.metadata["bounds"].items():
                if not _HOLDS[rule](value, bound):
                    out.append(f"{f.name}={value!r} must be {_WORDS[rule]} {bound}")
        return out

    # ---- from what a call used ----------------------------------------------------------

    @classmethod
    def of(cls, values: Any) -> SamplingArgs:
        """The knobs of anything that has them as attributes (`SamplingParams`, `Sampling`,
        the config's `rollout` section)."""
        return cls(**{n: getattr(values, n) for n in cls.names()})

    @classmethod
    def from_record(cls, params: dict[str, Any]) -> SamplingArgs | None:
        """The knobs a trace record's `params` say a call used; None when it does not say
        (a record written by hand, or by another tool)."""
        if any(params.get(n) is None for n in cls.names()):
            return None
        try:
            return cls(**{n: params[n] for n in cls.names()})
        except (TypeError, ValueError):
            return None

    def replace(self, **changes: Any) -> SamplingArgs:
        return dataclasses.replace(self, **changes)

    # ---- command lines ------------------------------------------------------------------

    @classmethod
    def add_cli_args(
        cls,
        parser: argparse.ArgumentParser | argparse._ArgumentGroup,
        names: list[str] | None = None,
        defaults: dict[str, tuple[Any, str]] | None = None,
    ) -> None:
        """Add `--temperature`, `--top-p`, ... (the knobs in `names`; default all) to
        `parser`, checked against the bounds. A command that needs another default than
        SamplingArgs' gives it with the reason: `defaults={"temperature": (0.7, "why")}`."""
        defaults = defaults or {}
        unknown = sorted(set(defaults) - set(names or cls.names()))
        if unknown:
            raise ValueError(f"a default for {unknown[0]!r}, which is not among the flags added")
        for name in names or cls.names():
            f = _field(name)
            default, why = defaults.get(name, (f.default, ""))
            text = f.metadata["help"].split(". ")[0].rstrip(".")
            if default is None:  # the command works it out: `why` says how
                text += f" (default: {why})"
            else:
                text += f" (default {default}: {why})" if why else f" (default {default})"
            parser.add_argument(
                "--" + name.replace("_", "-"),
                type=_checked(name),
                default=default,
                help=text[0].lower() + text[1:],
            )

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, **fallback: Any) -> SamplingArgs:
        """The knobs `add_cli_args` parsed; a flag not added or left unset (None) takes
        `fallback`'s value, then the default."""
        values = dict(fallback)
        for name in cls.names():
            if getattr(args, name, None) is not None:
                values[name] = getattr(args, name)
        return cls(**values)

    # ---- the trainer's YAML -------------------------------------------------------------

    @classmethod
    def config_fields(
        cls, *, optional: bool = False, bounds: dict[str, dict[str, Any]] | None = None
    ) -> dict[str, Any]:
        """The knobs as pydantic field definitions (`create_model(..., **config_fields())`);
        `optional`: each one unset (None) by default, as per-agent overrides are; `bounds`
        tighten a knob for one section (training samples at a temperature above 0)."""
        from pydantic import Field

        out = {}
        for f in dataclasses.fields(SamplingArgs):
            limits = {**f.metadata["bounds"], **(bounds or {}).get(f.name, {})}
            hint = _HINTS[f.name] | None if optional else _HINTS[f.name]
            default = None if optional else f.default
            out[f.name] = (hint, Field(default, description=f.metadata["help"], **limits))
        return out


_HINTS = typing.get_type_hints(SamplingArgs)  # the annotations as types, not strings
DEFAULT = SamplingArgs()


def _field(name: str) -> dataclasses.Field[Any]:
    every = {f.name: f for f in dataclasses.fields(SamplingArgs)}
    if name not in every:
        raise ValueError(f"no sampling option {name!r}; SamplingArgs has {', '.join(every)}")
    return every[name]


def _checked(name: str) -> Any:
    """The argparse type of one knob: its number type, checked against its bounds."""
    kind = _HINTS[name]

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {kind.__name__}") from None
        problems = SamplingArgs.problems({name: value})
        if problems:
            raise argparse.ArgumentTypeError(problems[0])
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse
