"""Task sources: the math generator, our code problems, JSONL files, Hugging Face datasets.

An env names its source with one string (`EnvConfig.source`):

* `generated` (math): procedural problems, `math_gen.py`;
* `builtin` (code): our problems with tests, `code_problems.py`;
* `jsonl:/path/tasks.jsonl`: our task format (`MathTask.to_dict` / `CodeTask.to_dict`, one
  object per line);
* `hf:<key>`: a Hugging Face dataset from `HF_DATASETS`, converted to our records. Pass
  `data_path` to read a local copy instead of the Hub (a `save_to_disk` directory, a
  parquet/JSON/JSONL file, or a downloaded snapshot of the dataset repo).
"""

from __future__ import annotations

import json
import os
import pickle
import threading
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np

from masenvs.tasks.code_problems import PROBLEMS
from masenvs.tasks.hf_rows import (
    aime2024,
    aime2025,
    apps,
    code_contests,
    dapo17k,
    gsm8k,
    livecodebench,
    math500,
    olympiadbench,
)
from masenvs.tasks.math_gen import TOPICS, generate_math_task
from masenvs.tasks.records import CodeTask, MathTask, TaskSourceError

Kind = Literal["math", "code"]
Task = MathTask | CodeTask

# --- sources ------------------------------------------------------------------------------


class TaskSource(Protocol):
    name: str

    def sample(self, rng: np.random.Generator) -> Any: ...


@dataclass(frozen=True)
class TaskList:
    """A fixed list of tasks; `sample` draws one uniformly."""

    name: str
    tasks: tuple[Any, ...]

    def __len__(self) -> int:
        return len(self.tasks)

    def __getitem__(self, index: int) -> Any:
        return self.tasks[index]

    def __iter__(self) -> Iterator[Any]:
        return iter(self.tasks)

    def sample(self, rng: np.random.Generator) -> Any:
        return self.tasks[int(rng.integers(len(self.tasks)))]


@dataclass(frozen=True)
class GeneratedMath:
    """Procedural math problems (no data); `sample` generates one from the generator."""

    level: int = 2
    topics: tuple[str, ...] = tuple(TOPICS)
    name: str = "generated"

    def __post_init__(self) -> None:
        unknown = [t for t in self.topics if t not in TOPICS]
        if unknown or not self.topics:
            raise ValueError(f"unknown math topics {unknown}; known: {', '.join(TOPICS)}")
        if self.level not in (1, 2, 3):
            raise ValueError(f"difficulty level must be 1, 2 or 3, got {self.level}")

    def sample(self, rng: np.random.Generator) -> MathTask:
        return generate_math_task(rng, self.level, self.topics)


def open_source(
    spec: str,
    kind: Kind,
    split: str | None = None,
    data_path: str | None = None,
    level: int = 2,
    topics: tuple[str, ...] | None = None,
) -> TaskSource:
    """The task source named by `spec` for a `kind` env (see the module docstring)."""
    if spec == "generated":
        if kind != "math":
            raise TaskSourceError(
                'source "generated" makes math problems; the code env\'s built-in set is "builtin"'
            )
        return GeneratedMath(level, tuple(topics) if topics else tuple(TOPICS))
    stamp = None  # an edited JSONL file is read again
    if spec.startswith("jsonl:") and os.path.isfile(spec[len("jsonl:") :]):
        stamp = os.stat(spec[len("jsonl:") :]).st_mtime_ns
    return _open_list(spec, kind, split, str(data_path) if data_path else None, stamp)


@lru_cache(maxsize=32)
def _open_list(
    spec: str, kind: Kind, split: str | None, data_path: str | None, stamp: int | None
) -> TaskList:
    # Cached: every env of a run shares one loaded dataset (tasks are immutable).
    if spec == "builtin":
        if kind != "code":
            raise TaskSourceError('source "builtin" is the code problem set; math uses "generated"')
        return TaskList("builtin", PROBLEMS)
    if spec.startswith("jsonl:"):
        tasks = read_jsonl(spec[len("jsonl:") :], kind)
        return TaskList(spec, tuple(tasks))
    if spec.startswith("hf:"):
        tasks = load_hf(spec[len("hf:") :], split=split, data_path=data_path, kind=kind)
        return TaskList(spec, tuple(tasks))
    raise TaskSourceError(
        f"unknown task source {spec!r}: use "
        + ('"generated"' if kind == "math" else '"builtin"')
        + ', "jsonl:/path/file.jsonl" or "hf:<dataset>" with one of '
        + ", ".join(k for k, d in HF_DATASETS.items() if d.kind == kind)
    )


# --- JSONL --------------------------------------------------------------------------------


def task_from_dict(data: dict[str, Any], kind: Kind | None = None) -> Task:
    """A record from its dict; `kind` None guesses from the keys ("prompt" means code)."""
    if kind is None:
        kind = "code" if isinstance(data, dict) and "prompt" in data else "math"
    return CodeTask.from_dict(data) if kind == "code" else MathTask.from_dict(data)


def read_jsonl(path: str | os.PathLike, kind: Kind | None = None) -> list[Task]:
    """Tasks from a JSONL file in our format; a bad line names its line number."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise TaskSourceError(f"task file {str(file)!r} does not exist")
    tasks: list[Task] = []
    with file.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                tasks.append(task_from_dict(json.loads(line), kind))
            except (ValueError, TypeError) as exc:
                raise TaskSourceError(f"{file}:{number}: not a {kind or ''} task: {exc}") from exc
    if not tasks:
        raise TaskSourceError(f"task file {str(file)!r} holds no tasks")
    return tasks


def write_jsonl(tasks: Iterable[Task], path: str | os.PathLike) -> Path:
    """Write tasks in our JSONL format (one `to_dict` per line)."""
    file = Path(path).expanduser()
    file.parent.mkdir(parents=True, exist_ok=True)
    with file.open("w", encoding="utf-8") as f:
        for task in tasks:
            f.write(json.dumps(task.to_dict(), ensure_ascii=False) + "\n")
    return file


# --- Hugging Face datasets -------------------------------------------------------------------


@dataclass(frozen=True)
class HFDataset:
    """Where a dataset lives on the Hub and how its rows become our tasks."""

    hub_id: str
    kind: Kind
    split: str  # the default split
    convert: Callable[[dict, int], Any]
    config: str | None = None
    # Repos that only have a loading script (which `datasets` >= 4 refuses to run) are read
    # as raw JSONL files; "{split}" is replaced by the split name.
    data_files: str | None = None


HF_DATASETS: dict[str, HFDataset] = {
    "aime2024": HFDataset("Maxwell-Jia/AIME_2024", "math", "train", aime2024),
    "aime2025": HFDataset("yentinglin/aime_2025", "math", "train", aime2025),
    "math500": HFDataset("HuggingFaceH4/MATH-500", "math", "test", math500),
    "olympiadbench": HFDataset(
        "Hothan/OlympiadBench", "math", "train", olympiadbench, config="OE_TO_maths_en_COMP"
    ),
    "gsm8k": HFDataset("openai/gsm8k", "math", "test", gsm8k, config="main"),
    "dapo17k": HFDataset("BytedTsinghua-SIA/DAPO-Math-17k", "math", "train", dapo17k),
    "apps": HFDataset(
        "codeparrot/apps",
        "code",
        "test",
        apps,
        data_files="hf://datasets/codeparrot/apps/{split}.jsonl",
    ),
    "code_contests": HFDataset("deepmind/code_contests", "code", "test", code_contests),
    # The split is the release file: "test" (v1) ... "test6" (v6); see docs/math-code.md.
    "livecodebench": HFDataset(
        "livecodebench/code_generation_lite",
        "code",
        "test6",
        livecodebench,
        data_files="hf://datasets/livecodebench/code_generation_lite/{split}.jsonl",
    ),
}

_LOAD_LOCK = threading.Lock()


def load_hf(
    key: str,
    split: str | None = None,
    data_path: str | os.PathLike | None = None,
    kind: Kind | None = None,
    limit: int | None = None,
) -> list[Task]:
    """Tasks of the dataset `key` (see `HF_DATASETS`), from the Hub or a local copy."""
    spec = HF_DATASETS.get(key)
    if spec is None:
        raise TaskSourceError(f"unknown dataset {key!r}; known: {', '.join(HF_DATASETS)}")
    if kind is not None and spec.kind != kind:
        raise TaskSourceError(f"dataset {key!r} holds {spec.kind} tasks, not {kind} tasks")
    split = split or spec.split
    tasks: list[Task] = []
    seen: set[str] = set()
    for index, row in enumerate(_iter_rows(_rows(spec, key, split, data_path))):
        try:
            task = spec.convert(row, index)
        except (
            KeyError,
            TypeError,
            ValueError,
            AttributeError,
            zlib.error,
            pickle.PickleError,
        ) as exc:
            raise TaskSourceError(
                f"row {index} of {spec.hub_id} ({key}) does not have the expected columns: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        # DAPO-Math-17k repeats each problem about a hundred times; keep the first.
        text = task.question if isinstance(task, MathTask) else task.prompt if task else ""
        if task is None or text in seen:
            continue
        seen.add(text)
        tasks.append(task)
        if limit is not None and len(tasks) >= limit:
            break
    if not tasks:
        raise TaskSourceError(f"{spec.hub_id} ({key}, split {split}) gave no usable tasks")
    return tasks


def _iter_rows(dataset: Any) -> Iterator[dict]:
    """Rows as dicts, read in column batches (several times faster than row by row)."""
    for batch in dataset.iter(batch_size=4096):
        names = list(batch)
        for values in zip(*batch.values()):
            yield dict(zip(names, values))


def _rows(
    spec: HFDataset, key: str, split: str, data_path: str | os.PathLike | None
) -> Iterable[dict]:
    try:
        import datasets
    except ImportError as exc:
        raise TaskSourceError(
            f"reading {spec.hub_id} needs the `datasets` package: pip install 'masenvs[tasks]'"
        ) from exc
    where = f"the local copy {str(data_path)!r}" if data_path else "the Hugging Face Hub"
    try:
        with _LOAD_LOCK:  # datasets' cache is not safe to fill from several threads at once
            if data_path is not None:
                dataset = _load_local(datasets, spec, Path(data_path).expanduser(), split)
            elif spec.data_files:
                files = spec.data_files.format(split=split)
                dataset = datasets.load_dataset("json", data_files={split: files}, split=split)
            else:
                dataset = datasets.load_dataset(spec.hub_id, spec.config, split=split)
    except TaskSourceError:
        raise
    except Exception as exc:  # datasets and huggingface_hub raise many kinds; all mean "not here"
        cause = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
        raise TaskSourceError(
            f"could not load {spec.hub_id} ({key}, split {split!r}) from {where} "
            f"[{type(exc).__name__}: {cause}]; without network, save it on a connected machine "
            f"with datasets.load_dataset(...).save_to_disk(DIR) and pass data_path=DIR, or point "
            f"HF_HOME at a cache that holds it and set HF_HUB_OFFLINE=1 (docs/math-code.md)"
        ) from exc
    return dataset


def _load_local(datasets: Any, spec: HFDataset, path: Path, split: str) -> Any:
    """A local copy: `save_to_disk` output, one parquet/JSON(L) file, or a repo snapshot."""
    if not path.exists():
        raise TaskSourceError(f"data_path {str(path)!r} for {spec.hub_id} does not exist")
    if path.is_dir() and (path / "dataset_dict.json").exists():
        loaded = datasets.load_from_disk(str(path))
        if split not in loaded:
            raise TaskSourceError(f"{str(path)!r} has splits {list(loaded)}, not {split!r}")
        return loaded[split]
    if path.is_dir() and (path / "state.json").exists():
        return datasets.load_from_disk(str(path))
    if path.is_file():
        builder = {".parquet": "parquet", ".json": "json", ".jsonl": "json"}.get(path.suffix)
        if builder is None:
            raise TaskSourceError(f"data_path {str(path)!r}: expected .parquet, .json or .jsonl")
        return datasets.load_dataset(builder, data_files={split: str(path)}, split=split)
    if spec.data_files:  # a snapshot of a script-only repo: read its raw file for the split
        raw = path / Path(spec.data_files.format(split=split)).name
        if raw.exists():
            return datasets.load_dataset("json", data_files={split: str(raw)}, split=split)
    return datasets.load_dataset(str(path), spec.config, split=split)
