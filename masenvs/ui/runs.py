"""What `masenvs ui` reads: training runs, eval reports and the views' data built from them.

A training run directory holds `config.yaml`, `metrics.jsonl`, `traces/`, `samples.jsonl`,
`designs.jsonl` and `checkpoints/` (trainer/); an eval report is `eval-*.json` with one trace
store per policy beside it (`masenvs eval`). Everything here only reads them.
"""

from __future__ import annotations

import json
import math
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
    kind: str = "train"  # "train" | "eval-policy"
    label: str = ""
    _index: RunIndex | None = field(default=None, repr=False)
    _metrics: tuple[tuple[int, float], list[dict[str, Any]]] | None = field(
        default=None, repr=False
    )
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _stats: Any = field(default=None, repr=False)  # step_stats' cache

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
                "traces/; an eval report is the JSON `masenvs eval` writes"
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


# -- curves ------------------------------------------------------------------------------------

# (title, metric key patterns); {agent} is each agent, {policy} each learner policy.
CURVES: list[tuple[str, list[str]]] = [
    ("success", ["train/success", "val/success"]),
    ("reward", ["train/reward/{agent}", "val/reward/{agent}"]),
    ("loss", ["learner/{policy}/loss"]),
    ("grad norm", ["learner/{policy}/grad_norm"]),
    ("learning rate", ["learner/{policy}/lr", "learner/lr"]),
    ("tokens/s", ["learner/tokens_per_s", "throughput/rollout_tokens_per_s"]),
]


def _matching(records: list[dict[str, Any]], pattern: str) -> list[str]:
    if "{" not in pattern:
        return [pattern] if any(pattern in r for r in records) else []
    head, _, tail = re.split(r"(\{\w+\})", pattern, maxsplit=1)
    keys = {k for r in records for k in r}
    out = []
    for k in sorted(keys):
        if k.startswith(head) and k.endswith(tail) and len(k) > len(head) + len(tail):
            middle = k[len(head) : len(k) - len(tail)] if tail else k[len(head) :]
            if "/" not in middle:
                out.append(k)
    return out


def curves(runs: list[Run], several: bool) -> list[dict[str, Any]]:
    """uPlot-ready charts: per family, one series per run x metric key, aligned on steps."""
    charts = []
    for title, patterns in CURVES:
        series: list[tuple[str, dict[int, float]]] = []
        for run in runs:
            records = run.metrics()
            for pattern in patterns:
                for key in _matching(records, pattern):
                    points = {
                        r["step"]: r[key]
                        for r in records
                        if isinstance(r.get(key), int | float) and math.isfinite(r[key])
                    }
                    if points:
                        label = key if not several else f"{run.id}: {key}"
                        series.append((label, points))
        if not series:
            continue
        steps = sorted({s for _, points in series for s in points})
        charts.append(
            {
                "title": title,
                "x": steps,
                "series": [
                    {"label": label, "values": [points.get(s) for s in steps]}
                    for label, points in series
                ],
            }
        )
    return charts


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


def behaviour(run: Run) -> list[dict[str, Any]]:
    """Per agent over steps: answer length, format-failure rate, and how often the agent's
    candidates disagree on the team outcome (its output changes what the team gets)."""
    stats = step_stats(run)
    steps = sorted({step for step, _ in stats})
    seen = {agent for _, agent in stats}
    agents = [a for a in run.agents() if a in seen]  # the run's own order

    def chart(title: str, key: str) -> dict[str, Any] | None:
        series = []
        for agent in agents:
            line = [(stats.get((s, agent)) or {}).get(key) for s in steps]
            if any(v is not None for v in line):
                series.append({"label": agent, "values": line})
        return {"title": title, "x": steps, "series": series} if series else None

    charts = [
        chart("answer length (tokens)", "length"),
        chart("format-failure rate", "failed"),
        chart("output changes the team outcome (share of groups)", "changes"),
    ]
    return [c for c in charts if c is not None]


def step_summary(run: Run) -> dict[int, dict[str, int]]:
    """Per step: samples, kept and dropped, over all agents."""
    out: dict[int, dict[str, int]] = {}
    for (step, _), r in step_stats(run).items():
        row = out.setdefault(step, {"samples": 0, "kept": 0, "dropped": 0})
        for key in row:
            row[key] += r[key] or 0
    return out


# -- a step -----------------------------------------------------------------------------------


def step_view(run: Run, step: int) -> dict[str, Any]:
    """The step's tasks, each with its turns (tree) and its caller groups."""
    rows = run.index.query(
        "SELECT s.*, c.rollout_id AS call_rollout, c.previews, c.finish_reason "
        "FROM samples s LEFT JOIN calls c ON c.id = s.call_id "
        "WHERE s.step = ? ORDER BY s.seq",
        (step,),
    )
    tasks: dict[str, dict[str, Any]] = {}
    for r in rows:
        r["parts"] = json.loads(r["parts"] or "null") or {}
        r["group"] = json.loads(r["grp"] or "null")
        r["rollout"] = r["rollout_id"] or r["call_rollout"]
        r["preview"] = _preview(r.pop("previews", None), r["choice"])
        task = tasks.setdefault(r["task_id"], {"task_id": r["task_id"], "groups": {}})
        group = task["groups"].setdefault(
            r["grp"],
            {
                "key": r["group"],
                "agent": r["agent"],
                "round": r["round"],
                "caller": bool(r["group"]) and r["group"][0] == "caller",
                "members": [],
            },
        )
        group["members"].append(r)
    out = []
    for task in tasks.values():
        groups = list(task["groups"].values())
        for g in groups:
            rewards = [m["reward"] for m in g["members"]]
            g["mean"] = sum(rewards) / len(rewards)
            g["drop"] = next((m["drop_reason"] for m in g["members"] if m["drop_reason"]), None)
            g["kept"] = all(m["kept"] for m in g["members"])
        turns = [g for g in groups if not g["caller"] and g["round"] is not None]
        others = [g for g in groups if g not in turns]
        out.append(
            {
                "task_id": task["task_id"],
                "turns": turns,
                "others": others,
                "tree": tree_layout(turns),
            }
        )
    return {"tasks": out, "samples": len(rows)}


BOX_W, BOX_H, GAP_X, GAP_Y = 150, 58, 14, 34


def tree_layout(turns: list[dict[str, Any]]) -> dict[str, Any]:
    """SVG geometry of a task's tree: one row per turn, its K candidates side by side, edges
    from the candidate that continued to every candidate of the next turn."""
    boxes, edges = [], []
    width = 0
    parent: tuple[float, float] | None = None
    for row, turn in enumerate(turns):
        y = 20 + row * (BOX_H + GAP_Y)
        continued = None
        for k, m in enumerate(turn["members"]):
            x = 10 + k * (BOX_W + GAP_X)
            boxes.append({"x": x, "y": y, "m": m, "turn": turn})
            if parent is not None:
                edges.append((parent[0], parent[1], x + BOX_W / 2, y))
            if m["continued"]:
                continued = (x + BOX_W / 2, y + BOX_H)
            width = max(width, x + BOX_W + 10)
        parent = continued
    height = 20 + len(turns) * (BOX_H + GAP_Y)
    return {
        "boxes": boxes,
        "edges": edges,
        "width": width,
        "height": height,
        "w": BOX_W,
        "h": BOX_H,
    }


# -- a conversation ------------------------------------------------------------------------------


class Tokens:
    """Token id -> text with the run's tokenizer (loaded once, in the background); ids alone
    when it cannot be loaded (a model this machine does not have)."""

    _cache: dict[str, Any] = {}
    _lock = threading.Lock()

    @classmethod
    def warm(cls, model: str) -> None:
        if model and model not in cls._cache:
            threading.Thread(target=cls.get, args=(model,), daemon=True).start()

    @classmethod
    def get(cls, model: str) -> Any:
        with cls._lock:
            if model not in cls._cache:
                try:
                    from masenvs.engine.loading import load_tokenizer

                    cls._cache[model] = load_tokenizer(model)
                except Exception:  # noqa: BLE001 (no tokenizer: ids are shown instead)
                    cls._cache[model] = None
            return cls._cache[model]

    @classmethod
    def pieces(cls, model: str, ids: list[int]) -> list[str] | None:
        tok = cls.get(model) if model else None
        if tok is None:
            return None
        return [tok.decode([i]) for i in ids]

    @classmethod
    def text(cls, model: str, ids: list[int]) -> str | None:
        tok = cls.get(model) if model else None
        return None if tok is None else tok.decode(ids)


def conversation(run: Run, call_id: str, tolerance: float) -> dict[str, Any] | None:
    """A call's messages, rendered prompt and choices, each token with the sampler's and the
    learner's log-prob (when the learner scored it) and whether they disagree."""
    record = run.index.call(call_id)
    if record is None:
        return None
    samples = run.index.query("SELECT * FROM samples WHERE call_id = ? ORDER BY choice", (call_id,))
    by_choice: dict[int, dict[str, Any]] = {}
    for s in samples:
        full = run.index.record(s) or {}
        s["learner_logprobs"] = full.get("learner_logprobs")
        s["parts"] = json.loads(s["parts"] or "null") or {}
        by_choice[s["choice"]] = s
    model = run.model
    choices = []
    for c in record.get("choices") or []:
        ids = c.get("token_ids") or []
        sampler = c.get("logprobs") or []
        sample = by_choice.get(c.get("index"))
        learner = (sample or {}).get("learner_logprobs") or []
        pieces = Tokens.pieces(model, ids) or [f"⟨{i}⟩" for i in ids]
        tokens = []
        worst = 0.0
        for j, tid in enumerate(ids):
            lp = sampler[j] if j < len(sampler) else None
            lq = learner[j] if j < len(learner) and len(learner) == len(ids) else None
            diff = abs(lp - lq) if lp is not None and lq is not None else None
            worst = max(worst, diff or 0.0)
            tokens.append(
                {
                    "id": tid,
                    "text": pieces[j],
                    "lp": lp,
                    "learner": lq,
                    "diff": diff,
                    "mismatch": diff is not None and diff > tolerance,
                    "shade": _shade(lp),
                }
            )
        choices.append(
            {
                "index": c.get("index"),
                "text": c.get("text", ""),
                "finish_reason": c.get("finish_reason"),
                "tokens": tokens,
                "sample": sample,
                "has_learner": bool(learner) and len(learner) == len(ids),
                "max_diff": worst,
                "mismatches": sum(t["mismatch"] for t in tokens),
            }
        )
    prompt_ids = record.get("prompt_token_ids") or []
    return {
        "record": record,
        "choices": choices,
        "prompt_text": Tokens.text(model, prompt_ids),
        "prompt_tokens": len(prompt_ids),
        "tolerance": tolerance,
    }


def _shade(lp: float | None) -> str:
    """Background of a token: green when the model was sure (p near 1), red when not."""
    if lp is None or not math.isfinite(lp):
        return "transparent"
    p = math.exp(max(lp, -30.0))
    hue = int(120 * p)  # 0 red .. 120 green
    return f"hsl({hue} 70% 85%)"


# -- auto-MAS and workflows --------------------------------------------------------------------


def design_view(run: Run, design_id: str) -> dict[str, Any] | None:
    rows = run.index.query("SELECT * FROM designs WHERE design_id = ? LIMIT 1", (design_id,))
    if not rows:
        return None
    record = run.index.record(rows[0]) or {}
    graph = record.get("graph") or {"structure": "", "nodes": [], "edges": []}
    calls = {}
    for node in graph.get("nodes", []):
        ids = [c for c in node.get("calls") or [] if c]  # '': a call the gate refused
        found = []
        for cid in ids:
            meta = run.index.query(
                "SELECT id, rollout_id, agent, previews FROM calls WHERE id = ?", (cid,)
            )
            if meta:
                meta[0]["preview"] = _preview(meta[0].pop("previews"), 0)
            found.append(meta[0] if meta else {"id": cid, "rollout_id": None, "preview": ""})
        calls[node["name"]] = found
    # each execution's calls, by rollout id mas-{design_id}-{m}
    executions = []
    for m, e in enumerate(record.get("executions") or []):
        rollout = f"mas-{design_id}-{m}"
        n = run.index.query("SELECT COUNT(*) AS n FROM calls WHERE rollout_id = ?", (rollout,))
        executions.append({"m": m, "rollout": rollout, "calls": n[0]["n"], **e})
    return {
        "record": record,
        "graph": graph,
        "layout": graph_layout(graph),
        "calls": calls,
        "executions": executions,
    }


def graph_layout(graph: dict[str, Any]) -> dict[str, Any]:
    """Nodes on a circle, clockwise from the top in declaration order (as `mas-graph` draws)."""
    nodes = graph.get("nodes") or []
    n = max(len(nodes), 1)
    cx, cy, r = 260, 200, 150 if n > 1 else 0
    pos = {}
    for i, node in enumerate(nodes):
        pos[node["name"]] = (
            cx + r * math.sin(2 * math.pi * i / n),
            cy - r * math.cos(2 * math.pi * i / n),
        )
    edges = []
    for a, b in graph.get("edges") or []:
        if a in pos and b in pos and a != b:
            (x1, y1), (x2, y2) = pos[a], pos[b]
            d = math.hypot(x2 - x1, y2 - y1) or 1.0
            shrink = 42
            edges.append(
                (
                    x1 + (x2 - x1) * shrink / d,
                    y1 + (y2 - y1) * shrink / d,
                    x2 - (x2 - x1) * shrink / d,
                    y2 - (y2 - y1) * shrink / d,
                )
            )
    return {
        "nodes": [
            {
                "name": node["name"],
                "x": pos[node["name"]][0],
                "y": pos[node["name"]][1],
                "calls": len([c for c in node.get("calls") or [] if c]),
            }
            for node in nodes
        ],  # fmt: skip
        "edges": edges,
        "width": 520,
        "height": 400,
    }


def rollout_view(run: Run, rollout_id: str) -> dict[str, Any]:
    """A captured program run: its calls in time order, one lane per agent, and its outcome."""
    calls = run.index.query(
        "SELECT id, agent, call_index, step_name, started_at, latency_s, previews, "
        "finish_reason, completion_tokens FROM calls WHERE rollout_id = ? ORDER BY started_at",
        (rollout_id,),
    )
    for c in calls:
        c["preview"] = _preview(c.pop("previews"), 0)
    episodes = run.index.query("SELECT * FROM episodes WHERE rollout_id = ?", (rollout_id,))
    episode = None
    if episodes:
        episode = run.index.record(episodes[-1])
    lanes = list(dict.fromkeys(c["agent"] for c in calls))
    w, h, gx, gy = 150, 46, 30, 22
    boxes = []
    for i, c in enumerate(calls):
        lane = lanes.index(c["agent"])
        boxes.append({"x": 110 + i * (w + gx), "y": 16 + lane * (h + gy), "c": c, "n": i})
    edges = [(a["x"] + w, a["y"] + h / 2, b["x"], b["y"] + h / 2) for a, b in zip(boxes, boxes[1:])]
    layout = {
        "boxes": boxes,
        "edges": edges,
        "lanes": [{"name": a, "y": 16 + i * (h + gy)} for i, a in enumerate(lanes)],
        "width": 120 + len(calls) * (w + gx),
        "height": 24 + len(lanes) * (h + gy),
        "w": w,
        "h": h,
    }
    return {"calls": calls, "episode": episode, "layout": layout}


def workflow_runs(run: Run, step: int | None = None) -> list[dict[str, Any]]:
    """The episodes of captured program runs (workflow mode), newest step first."""
    rows = run.index.query(
        "SELECT e.rollout_id, e.task_id, e.success, e.rewards, e.error, "
        "(SELECT COUNT(*) FROM calls c WHERE c.rollout_id = e.rollout_id) AS calls "
        "FROM episodes e ORDER BY e.created_at"
    )
    out = []
    for r in rows:
        m = re.match(r"^s(\d+)-", r["rollout_id"] or "")
        r["step"] = int(m.group(1)) if m else None
        if step is None or r["step"] == step:
            out.append(r)
    return out


def eval_task_view(report: EvalReport, task_id: str | None) -> dict[str, Any]:
    """Every policy's episodes of one task side by side (each agent's calls and outcome)."""
    tasks: list[str] = []
    for policy in report.policies:
        for r in policy.index.query("SELECT DISTINCT task_id FROM episodes ORDER BY rowid"):
            if r["task_id"] not in tasks:
                tasks.append(r["task_id"])
    task_id = task_id if task_id in tasks else (tasks[0] if tasks else None)
    columns = []
    for policy in report.policies:
        episodes = policy.index.query(
            "SELECT rollout_id, success, rewards, error FROM episodes WHERE task_id = ? "
            "ORDER BY rollout_id",
            (task_id,),
        )
        for e in episodes:
            e["rewards"] = json.loads(e["rewards"] or "{}")
            e["calls"] = policy.index.query(
                "SELECT id, agent, call_index, previews FROM calls WHERE rollout_id = ? "
                "ORDER BY started_at",
                (e["rollout_id"],),
            )
            for c in e["calls"]:
                c["preview"] = _preview(c.pop("previews"), 0)
        columns.append({"policy": policy, "episodes": episodes})
    return {"tasks": tasks, "task_id": task_id, "columns": columns}


def _preview(previews: str | None, choice: int | None) -> str:
    """The indexed start of one choice's text."""
    try:
        texts = json.loads(previews or "[]")
        return str(texts[choice or 0])
    except (json.JSONDecodeError, IndexError, TypeError):
        return ""


def swap_results(report: EvalReport, reports: list[EvalReport]) -> list[dict[str, Any]]:
    """A role-swap eval beside the same policies unswapped (from any report of the same env
    and tasks, this one included): success with the roles in their own seats and swapped."""
    data = report.data
    out = []
    for result in data.get("results") or []:
        name = str(result.get("name", ""))
        base, sep, _ = name.partition(" swap ")
        if not sep:
            continue
        found = None
        for other in reports:
            if other.data.get("env") != data.get("env") or other.data.get("tasks") != data.get(
                "tasks"
            ):
                continue
            found = next(
                (r for r in other.data.get("results") or [] if r.get("name") == base), None
            )
            if found is not None:
                found = {**found, "report": other.id}
                break
        out.append({"name": name, "policy": base, "swapped": result, "own": found})
    return out
