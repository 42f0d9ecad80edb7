"""docs/paper.md's tables and the paper configs say the same thing.

Every `key=value` the tables state for a config holds in that config as our loader reads it
(defaults count, and a row's `--set` overrides too); every examples/paper config is in the
configs table; every row of the rows-and-ablations table names a config that exists, and a
`masenvs train` row trains the config it names. A row marked "(landing with issue 45)" uses
an option still being merged: it is checked once its config and options load.
"""

from __future__ import annotations

import contextlib
import io
import math
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from masenvs.trainer.commands import eval as eval_command
from masenvs.trainer.commands import sft as sft_command
from masenvs.trainer.commands import train as train_command
from masenvs.trainer.config import TrainConfig, load_config

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "paper.md"
PAPER = ROOT / "examples" / "paper"
CONFIGS_SECTION = "## The configs"
ROWS_SECTION = "## Every row, ablation and MetaAgent-X result"
SOLO = {"plan_path": "plan", "sudoku": "plan", "sokoban": "plan", "math": "reasoner"}
PARSERS = {
    "train": train_command.build_parser,
    "eval": eval_command.build_parser,
    "sft": sft_command.build_parser,
}
# An eval row's flags and the config values they stand for (the ref validates as it trains).
EVAL_FLAGS = {
    "--temperature": "validation.temperature",
    "--tasks": "validation.episodes",
    "--max-tokens": "rollout.max_tokens",
}
KEY_VALUE = re.compile(r"`([A-Za-z_][\w.]*)=([^`]*)`")


def section(text: str, title: str) -> str:
    assert title in text, f"docs/paper.md has no {title!r} section"
    return text.split(title, 1)[1].split("\n## ", 1)[0]


def table(text: str) -> list[list[str]]:
    """The body rows of the markdown tables in `text`, as lists of stripped cells."""
    rows = []
    for line in text.splitlines():
        if not line.startswith("|") or set(line) <= set("|- "):
            continue
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows[1:] if rows else rows  # the first is the header


def key_values(cell: str) -> dict[str, str]:
    return dict(KEY_VALUE.findall(cell))


def expected(text: str) -> Any:
    value = yaml.safe_load(text)
    if isinstance(value, str):
        try:
            return float(value)  # YAML 1.1 reads 5e-6 as a string
        except ValueError:
            return value
    return value


def lookup(config: TrainConfig, key: str) -> Any:
    value: Any = config
    for part in key.split("."):
        if isinstance(value, dict):
            assert part in value, f"{key}: no {part!r} in {sorted(value)}"
            value = value[part]
        else:
            assert hasattr(value, part), f"{key}: the config has no field {part!r}"
            value = getattr(value, part)
    return value


def mismatches(config: TrainConfig, values: dict[str, str]) -> list[str]:
    out = []
    for key, text in values.items():
        want, have = expected(text), lookup(config, key)
        if isinstance(want, (int, float)) and isinstance(have, (int, float)):
            same = math.isclose(want, have, rel_tol=1e-9)
        else:
            same = want == have
        if not same:
            out.append(f"{key}: the table says {text}, the config has {have!r}")
    return out


def config_rows() -> list[list[str]]:
    rows = table(section(DOC.read_text(), CONFIGS_SECTION))
    return [r for r in rows if re.fullmatch(r"`[\w.]+\.yaml`", r[0])]


def command_of(cell: str) -> str:
    found = [c for c in re.findall(r"`([^`]*)`", cell) if c.startswith("masenvs ")]
    assert len(found) == 1, f"one `masenvs ...` command per row, found {found}"
    return found[0]


def expand(text: str, task: str | None) -> str:
    if task is None:
        return text
    return text.replace("<task>", task).replace("<role>", SOLO.get(task, "coder"))


def row_cases() -> list[tuple[str, str | None, list[str]]]:
    """(row label, task or None, the row's cells) for every row of the rows table."""
    cases = []
    for cells in table(section(DOC.read_text(), ROWS_SECTION)):
        assert len(cells) == 6, f"row {cells[0]!r}: 6 cells (row, tasks, config, command, ...)"
        assert re.search(r"\b(match|differs)", cells[5]), f"row {cells[0]!r}: match or differs"
        tasks = re.findall(r"`(\w+)`", cells[1]) or [None]
        cases += [(cells[0], task, cells) for task in tasks]
    return cases


def test_every_paper_config_is_in_the_configs_table() -> None:
    named = [r[0].strip("`") for r in config_rows()]
    assert len(named) == len(set(named)), "a config is listed twice"
    shipped = sorted(p.name for p in PAPER.glob("*.yaml"))
    assert sorted(named) == shipped


@pytest.mark.parametrize("row", config_rows(), ids=lambda r: r[0].strip("`"))
def test_the_configs_table_states_each_configs_values(row: list[str]) -> None:
    path = PAPER / row[0].strip("`")
    values = key_values(row[2])
    assert len(values) >= 5, f"{path.name}: its key values"
    assert not mismatches(load_config(path), values), path.name


@pytest.mark.parametrize("case", row_cases(), ids=lambda c: f"{c[0][:48]}|{c[1]}")
def test_each_row_names_a_config_and_holds_its_values(
    case: tuple[str, str | None, list[str]],
) -> None:
    label, task, cells = case
    configs = re.findall(r"`(examples/paper/[^`]+\.yaml)`", cells[2])
    assert len(configs) == 1, f"{label}: one config, examples/paper/..., in its config cell"
    path = ROOT / expand(configs[0], task)
    words = shlex.split(expand(command_of(cells[3]), task))
    if words[1] in PARSERS:
        with contextlib.redirect_stderr(io.StringIO()) as said:
            try:  # every flag of the row's command is one the command takes
                parsed = PARSERS[words[1]]().parse_args(words[2:])
            except SystemExit:
                pytest.fail(f"{label}: `{' '.join(words)}`: {said.getvalue().strip()}")
    if words[1] in ("train", "sft"):
        assert ROOT / words[2] == path, f"{label}: its command trains {words[2]}, not {path}"
    assert path.exists(), f"{label}: {path.relative_to(ROOT)} does not exist"
    values = key_values(cells[4])
    overrides = [words[i + 1] for i, w in enumerate(words) if w == "--set"]
    if words[1] == "sft":  # --lora-rank and --lora-alpha stand for --set lora.*
        overrides += sft_command.overrides(parsed)
    if words[1] == "eval":
        overrides = []  # eval's --set are env options; the values are the trained config's
        for flag, key in EVAL_FLAGS.items():  # an eval flag and the config say one thing
            if flag in words and key in values:
                assert expected(words[words.index(flag) + 1]) == expected(values[key]), flag
    assert not mismatches(load_config(path, overrides), values), label


def test_every_config_has_a_row_and_every_paper_row_is_mapped() -> None:
    cases = row_cases()
    trained = {expand(re.findall(r"`(examples/paper/[^`]+)`", c[2])[0], t) for _, t, c in cases}
    assert {f"examples/paper/{p.name}" for p in PAPER.glob("*.yaml")} <= trained
    labels = {label for label, _, _ in cases}
    reported = DOC.read_text().split("## What the paper reports", 1)[1].split("\n## ", 1)[0]
    for number, size in ((1, "1.7B"), (2, "8B")):
        part = reported.split(f"**Qwen3-{size}**", 1)[1].split("**", 1)[0]
        for method in (r[0] for r in table(part)):
            assert f"Table {number} ({size}): {method}" in labels, (number, method)
    for ablation in ("grouping", "reward alpha", "role swap", "single agent vs MAS"):
        assert any(label.startswith(f"Ablation, {ablation}") for label in labels), ablation
    assert any(label.startswith("MetaAgent-X") for label in labels)
