"""`key=value` overrides, the one parser behind every `--set` and behind `load_config`.

A value is read as YAML (`3`, `1e-5`, `true`, `[q_proj, v_proj]`, `null`); text YAML cannot
parse stays a plain string. `parse_overrides` gives flat env options (`masenvs play`, `rollout`,
`eval --set size=9`); `apply_override` writes a dotted key into nested config data (`masenvs
train --set optim.lr=1e-5`), checking that each dotted prefix names a section of a pydantic
model; `explain` turns that model's validation error into one line per field, with a
did-you-mean for a misspelt name. Core layer: the CLIs and the libraries all import it from here.
"""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Callable
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the field and the fix."""


class Section(BaseModel):
    """A config section: an unknown key is an error (with a did-you-mean), and so is
    assigning a value of the wrong type later."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def parse_value(raw: str) -> Any:
    """`raw` read as YAML; text YAML cannot parse is taken as a plain string."""
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """`key=value` command-line pairs as a dict, so `size=9` is an int and `x=true` a bool.

    For command lines: a malformed pair stops the command with one line naming it."""
    config: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--set expects key=value, got {pair!r}")
        config[key.strip()] = parse_value(value)
    return config


def parse_pairs(pairs: list[str], flag: str) -> dict[str, str]:
    """`NAME=VALUE` pairs of a repeatable flag (`--adapter`, `--route`) as a dict of strings;
    a malformed one is a ConfigError naming `flag`."""
    result = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name or not value:
            raise ConfigError(f"{flag} expects NAME=VALUE, got {pair!r}")
        result[name] = value
    return result


def apply_override(data: dict[str, Any], item: str, root: type[BaseModel]) -> None:
    """Write `section.field=value` into the nested mapping `data` that `root` will validate."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {item!r} must look like section.field=value")
    value = parse_value(raw)
    parts = key.strip().split(".")
    _check_sections(parts, item, root)
    node = data
    for depth, part in enumerate(parts[:-1]):
        if node.get(part) is None:  # absent, or an optional section left empty (`workflow:`)
            node[part] = {}
        child = node[part]
        if not isinstance(child, dict):
            where = ".".join(parts[: depth + 1])
            raise ConfigError(f"override {item!r}: {where} is a value, not a section")
        node = child
    node[parts[-1]] = value


def _check_sections(parts: list[str], item: str, root: type[BaseModel]) -> None:
    """Every dotted prefix of an override must be a section (or a dict-valued field)."""
    section: type[BaseModel] | None = root
    for depth, part in enumerate(parts[:-1]):
        if section is None:  # inside a free-form dict such as env.options
            return
        field = section.model_fields.get(part)
        if field is None:
            return  # unknown name: validation reports it with a suggestion
        annotation = section_type(field.annotation)
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            section = annotation
        elif getattr(annotation, "__origin__", None) is dict:
            section = None
        else:
            where = ".".join(parts[: depth + 1])
            raise ConfigError(f"override {item!r}: {where} is a value, not a section")


def section_type(annotation: Any) -> Any:
    """`X | None` -> X: an optional section (`workflow`) takes overrides like any other."""
    members = [a for a in typing.get_args(annotation) if a is not type(None)]
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return members[0] if len(members) == 1 else annotation
    return annotation


def explain(
    exc: ValidationError,
    source: str,
    root: type[BaseModel],
    hint: Callable[[str, Any], str] | None = None,
) -> str:
    """`invalid config (source): field.path: problem`, one line per error of `root`'s data.

    `hint(path, value)` may explain an unknown field (a name from another library) instead of
    the closest spelling; '' leaves the closest spelling."""
    lines = [f"invalid config ({source}):"]
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "(top level)"
        message = err["msg"]
        if err["type"] == "extra_forbidden":
            known = hint(where, err.get("input")) if hint is not None else ""
            message = "unknown field" + (known or did_you_mean(err["loc"], root))
        lines.append(f"  {where}: {message}")
    text = "\n".join(lines)
    if len(exc.errors()) == 1:  # the usual case, in one line
        return text.replace(":\n  ", ": ", 1)
    return text


def did_you_mean(loc: tuple[Any, ...], root: type[BaseModel]) -> str:
    """` (did you mean 'lr'?)` for the unknown field at `loc` of `root`, or ''."""
    section: type[BaseModel] = root
    for part in loc[:-1]:
        field = section.model_fields.get(str(part))
        annotation = section_type(field.annotation) if field else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return ""
        section = annotation
    close = difflib.get_close_matches(str(loc[-1]), list(section.model_fields), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
