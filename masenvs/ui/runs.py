"""What `masenvs ui` reads: training runs, eval reports and their per-step stats.

A training run directory holds `config.yaml`, `metrics.jsonl`, `traces/`, `samples.jsonl`,
`designs.jsonl` and `checkpoints/` (trainer/); an eval report is `eval-*.json` with one trace
store per policy beside it (`masenvs eval`). Everything here only reads them; each page's
data is built in its own module (charts, steps, calls, workflows, evals).
"""

from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import yaml

from masenvs.ui.index import RunIndex

LIVE_SECONDS = 90.0  # a run whose files changed this recently is shown as running


class RunError(ValueError):
    """A path given to `masenvs ui` that is neither a run, an eval report nor a folder of them."""


@dataclass
class Run:
    """One training run (or one policy's traces of an eval report)."""

    id: str
    path: Path
    kind: str = "train"  # "train" | "eval-policy" | "rollout" (a `masenvs rollout` folder)
    label: str = ""
    _index: RunIndex | None = field(default=None, repr=False)
    _metrics: tuple[tuple[int, float], list[dict[str, Any]]] | None = field(
        default=None, repr=False
    )
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _stats: Any = field(default=None, repr=False)  # step_stats' cache
    _diagnosis: Any = field(default=None, repr=False)  # (version, diagnose's result)

    @property
    def index(self) -> RunIndex:
        """The run's index, brought up to date (waiting at most 2 s while the indexer
        thread reads a large run: the page then shows what is indexed so far)."""
        index = self.open_index()
        # While the indexer thread reads, wait for it at most 2 s: a small run is indexed by
        # then; a large run's page shows what is indexed so far and fills in by itself.
        index.refresh(wait=2.0)
        return index

    def steps(self) -> list[int]:
        """The run's training steps (from the cached per-step stats when there are samples)."""
        stats = step_stats(self)
        return sorted({step for step, _ in stats}) if stats else self.index.steps()

    def open_index(self) -> RunIndex:
        """The run's index as it is (opened on first use)."""
        with self._lock:
            if self._index is None:
                self._index = RunIndex(self.path)
            return self._index

    @cached_property
    def config(self) -> dict[str, Any]:
        path = self.path / "config.yaml"
        if not path.is_file():
            return {}
        try:
            data = yaml.safe_load(path.read_text())
        except yaml.YAMLError:
            return {}
        return data if isinstance(data, dict) else {}

    @property
    def env(self) -> str:
        return str((self.config.get("env") or {}).get("name", ""))

    @property
    def model(self) -> str:
        return str((self.config.get("model") or {}).get("name", ""))

    @property
    def total_steps(self) -> int | None:
        steps = self.config.get("steps")
        return steps if isinstance(steps, int) else None

    @property
    def workflow(self) -> bool:
        return bool(self.config.get("workflow"))

    def metrics(self) -> list[dict[str, Any]]:
        """metrics.jsonl's records, re-read only when the file changed; a torn line skipped."""
        path = self.path / "metrics.jsonl"
        try:
            st = path.stat()
        except OSError:
            return []
        key = (st.st_size, st.st_mtime)
        if self._metrics is not None and self._metrics[0] == key:
            return self._metrics[1]
        records = []
        for line in path.read_text(errors="replace").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and isinstance(record.get("step"), int):
                records.append(record)
        # a resumed run truncates and rewrites; keep the last record of each step
        by_step: dict[int, dict[str, Any]] = {}
        for r in records:
            by_step[r["step"]] = {**by_step.get(r["step"], {}), **r}
        self._metrics = (key, [by_step[s] for s in sorted(by_step)])
        return self._metrics[1]

    def version(self) -> str:
        """Changes whenever the run's files grow: what live pages poll for."""
        parts = []
        for name in ("metrics.jsonl", "samples.jsonl", "designs.jsonl"):
            try:
                st = (self.path / name).stat()
                parts.append(f"{st.st_size}")
            except OSError:
                parts.append("-")
        traces = self.path / "traces" if (self.path / "traces").is_dir() else self.path
        sizes = 0
        for segment in traces.glob("segment-*.jsonl"):
            try:
                sizes += segment.stat().st_size
            except OSError:
                continue
        parts.append(str(sizes))
        parts.append(self.status())  # a run that just finished stops its pages polling
        return ".".join(parts)

    def last_change(self) -> float:
        latest = 0.0
        for name in ("config.yaml", "metrics.jsonl", "samples.jsonl", "traces", "checkpoints"):
            try:
                latest = max(latest, (self.path / name).stat().st_mtime)
            except OSError:
                continue
        traces = self.path / "traces"
        if traces.is_dir():
            for segment in traces.glob("segment-*.jsonl"):
                try:
                    latest = max(latest, segment.stat().st_mtime)
                except OSError:
                    continue
        return latest

    def status(self) -> str:
        """'finished' (every configured step logged and curves drawn), 'running' (files
        changed in the last LIVE_SECONDS) or 'stopped'."""
        if self.kind != "train":  # episodes only: done when its files stop changing
            recent = time.time() - self.last_change() < LIVE_SECONDS
            return "running" if recent else "finished"
        metrics = self.metrics()
        last = metrics[-1]["step"] if metrics else 0
        done = self.total_steps is not None and last >= self.total_steps
        if done and (self.path / "curves.png").is_file():
            return "finished"
        if time.time() - self.last_change() < LIVE_SECONDS:
            return "running"
        return "finished" if done else "stopped"

    def agents(self) -> list[str]:
        names: dict[str, None] = {}
        for r in self.metrics():
            for key in r:
                if key.startswith("train/reward/"):
                    names[key.removeprefix("train/reward/")] = None
        for row in self.index.query("SELECT DISTINCT agent FROM samples"):
            names[row["agent"]] = None
        return list(names)

    def format_penalty(self) -> float | None:
        """The env's `format_penalty` (an agent part equal to it is a format failure)."""
        env = self.config.get("env") or {}
        options = env.get("options") or {}
        if "format_penalty" in options:
            return float(options["format_penalty"])
        try:
            from masenvs.registry import env_class

            field_ = env_class(str(env.get("name"))).config_class.model_fields.get("format_penalty")
        except (KeyError, ImportError, AttributeError):
            return None
        return float(field_.default) if field_ is not None and field_.default else None


@dataclass
class EvalReport:
    """`masenvs eval`'s JSON and, per policy, its trace store (a Run of kind eval-policy)."""

    id: str
    path: Path
    data: dict[str, Any]
    policies: list[Run]


def discover(paths: list[str | Path]) -> tuple[list[Run], list[EvalReport]]:
    """Runs and eval reports under `paths` (each a run, an eval JSON, or a folder of them)."""
    runs: list[Run] = []
    reports: list[EvalReport] = []
    ids: set[str] = set()

    def unique(name: str) -> str:
        base = re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-") or "run"
        out, n = base, 2
        while out in ids:
            out, n = f"{base}-{n}", n + 1
        ids.add(out)
        return out

    def add(path: Path, depth: int) -> bool:
        if path.is_file() and path.suffix == ".json":
            report = _eval_report(path, unique)
            if report is not None:
                reports.append(report)
                return True
            return False
        if not path.is_dir():
            return False
        if _is_run(path):
            runs.append(Run(unique(path.name), path))
            return True
        if any(path.glob("segment-*.jsonl")):  # `masenvs rollout`'s traces: episodes only
            runs.append(Run(unique(path.name), path, kind="rollout"))
            return True
        if depth == 0:
            return False
        found = False
        for child in sorted(path.iterdir()):
            if child.name.startswith("."):
                continue
            if child.is_dir() and (child.with_suffix(".json")).is_file():
                continue  # an eval report's trace folders: shown with the report
            found |= add(child, depth - 1)
        return found

    for raw in paths:
        path = Path(raw).expanduser()
        if not path.exists():
            raise RunError(f"{path} does not exist; give a run directory (run_dir of a config)")
        if not add(path, 2) and not path.is_dir():  # an empty folder: runs to come
            raise RunError(
                f"{path} holds no run: a run directory has metrics.jsonl, config.yaml or "
                "traces/; a `masenvs rollout` folder has segment-*.jsonl; an eval report is "
                "the JSON `masenvs eval` writes"
            )
    return runs, reports


def _is_run(path: Path) -> bool:
    names = ("metrics.jsonl", "config.yaml", "samples.jsonl")
    return any((path / n).is_file() for n in names) or (path / "traces").is_dir()


def _eval_report(path: Path, unique: Any) -> EvalReport | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("results"), list):
        return None
    rid = unique(path.stem)
    folder = path.with_suffix("")
    policies = []
    for i, result in enumerate(data["results"]):
        name = str(result.get("name", f"policy {i}"))
        store = folder / name.replace("/", "_").replace("@", "_")
        if store.is_dir():
            policies.append(Run(f"{rid}~{i}", store, kind="eval-policy", label=name))
    return EvalReport(rid, path, data, policies)


# -- per-step stats ----------------------------------------------------------------------------


def step_stats(run: Run) -> dict[tuple[int, str], dict[str, float]]:
    """Per (step, agent): samples, kept, dropped, mean answer length, format-failure share
    and the share of groups whose candidates led to different team rewards.

    Steps are read once: a later call only reads the steps from the last one seen on (a
    live run), or everything again when rows went away (a resumed run rewrote steps)."""
    index = run.index
    penalty = run.format_penalty()
    count = index.query("SELECT COUNT(*) AS n FROM samples")[0]["n"]
    cached = run._stats
    if cached is None or count < cached[0] or cached[1] != penalty:
        cached = (0, penalty, -1, {})
    _, _, since, stats = cached
    if count != cached[0]:
        rows = index.query(
            "SELECT step, agent, COUNT(*) AS samples, SUM(kept) AS kept, "
            "SUM(drop_reason IS NOT NULL) AS dropped, AVG(completion_tokens) AS length, "
            "AVG(ABS(part_agent - ?) < 1e-9) AS failed, "
            "(SELECT AVG(n > 1) FROM (SELECT COUNT(DISTINCT t.part_team) AS n FROM samples t "
            " WHERE t.step = s.step AND t.agent = s.agent AND t.part_team IS NOT NULL "
            " GROUP BY t.grp)) AS changes "
            "FROM samples s WHERE step >= ? GROUP BY step, agent",
            (penalty if penalty is not None else float("nan"), since),
        )
        for r in rows:
            if penalty is None:
                r["failed"] = None
            stats[(r["step"], r["agent"])] = r
        since = max([since, *(r["step"] for r in rows)])
    run._stats = (count, penalty, since, stats)
    return stats


def step_summary(run: Run) -> dict[int, dict[str, int]]:
    """Per step: samples, kept and dropped, over all agents."""
    out: dict[int, dict[str, int]] = {}
    for (step, _), r in step_stats(run).items():
        row = out.setdefault(step, {"samples": 0, "kept": 0, "dropped": 0})
        for key in row:
            row[key] += r[key] or 0
    return out


def preview(previews: str | None, choice: int | None) -> str:
    """The indexed start of one choice's text."""
    try:
        texts = json.loads(previews or "[]")
        return str(texts[choice or 0])
    except (json.JSONDecodeError, IndexError, TypeError):
        return ""
