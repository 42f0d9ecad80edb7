"""The `masenvs ui` index: incremental, whole lines only, a resumed step replaced, shared
safely by two viewers, and bad paths refused with one sentence."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from masenvs.traces import CallRecord, ChoiceRecord, TraceStore
from masenvs.ui.index import RunIndex
from masenvs.ui.runs import Run
from masenvs.ui.steps import step_view


def call(cid: str, rollout: str, agent: str = "tool", k: int = 2) -> CallRecord:
    choices = [
        ChoiceRecord(j, f"answer {cid} #{j}", [5, 6, 7], [-0.5, -1.0, -2.0], "stop")
        for j in range(k)
    ]
    return CallRecord(cid, rollout, agent, agent, 0, "chat", [1, 2, 3], choices, messages=[])


def sample(step: int, cid: str, choice: int, batch: str, reward: float, continued: bool) -> str:
    return (
        json.dumps(
            {
                "step": step,
                "batch": batch,
                "call_id": cid,
                "choice": choice,
                "agent": "tool",
                "policy": "tool",
                "group": ["plan_path:0", 0, "tool"],
                "task_id": "plan_path:0",
                "round": 0,
                "reward": reward,
                "reward_parts": {"process": 0.0, "agent": reward, "team": 0.0},
                "advantage": 1.0 if continued else -1.0,
                "kept": True,
                "drop": None,
                "continued": continued,
                "completion_tokens": 3,
            }
        )
        + "\n"
    )


def test_the_index_reads_only_appended_whole_lines(tmp_path: Path) -> None:
    run = tmp_path / "run"
    store = TraceStore(run / "traces")
    store.append(call("c1", "s1-0"))
    index = RunIndex(run)
    assert index.refresh(min_interval=0) is True
    assert [r["id"] for r in index.query("SELECT id FROM calls")] == ["c1"]
    assert index.refresh(min_interval=0) is False  # nothing new: nothing read
    store.append(call("c2", "s2-0"))
    segment = store.segments()[0]
    with open(segment, "ab") as f:
        f.write(b'{"type": "call", "id": "torn"')  # a writer killed mid-line
    index.refresh(min_interval=0)
    assert [r["id"] for r in index.query("SELECT id FROM calls ORDER BY rowid")] == ["c1", "c2"]
    assert index.steps() == [1, 2]  # from the rollout ids, before samples.jsonl exists
    full = index.call("c2")
    assert full is not None and full["choices"][1]["text"] == "answer c2 #1"
    store.close()


def test_a_resumed_run_rewriting_a_step_shows_its_newest_write(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with TraceStore(run / "traces") as store:
        store.append(call("c1", "s1-0"))
        store.append(call("c1b", "s1-0"))
    lines = run / "samples.jsonl"
    lines.write_text(sample(1, "c1", 0, "a", 1.0, True) + sample(1, "c1", 1, "a", 0.0, False))
    view = step_view(Run("run", run), 1)
    assert [m["call_id"] for g in view["tasks"][0]["turns"] for m in g["members"]] == ["c1", "c1"]
    with open(lines, "a") as f:  # the resumed run plays step 1 again
        f.write(sample(1, "c1b", 0, "b", 0.0, False) + sample(1, "c1b", 1, "b", 1.0, True))
    fresh = Run("run", run)
    view = step_view(fresh, 1)
    members = view["tasks"][0]["turns"][0]["members"]
    assert [(m["call_id"], m["choice"], m["continued"]) for m in members] == [
        ("c1b", 0, 0),
        ("c1b", 1, 1),
    ]
    assert members[1]["preview"] == "answer c1b #1"  # each candidate its own text


def test_two_viewers_of_one_run_index_each_line_once(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with TraceStore(run / "traces") as store:
        for i in range(50):
            store.append(call(f"c{i}", f"s1-{i}"))
    a, b = RunIndex(run), RunIndex(run)
    a.refresh(min_interval=0)
    b.refresh(min_interval=0)
    assert a.query("SELECT COUNT(*) AS n FROM calls")[0]["n"] == 50
    assert b.query("SELECT COUNT(*) AS n FROM calls")[0]["n"] == 50


def test_a_path_that_is_not_a_run_is_refused_with_its_cause(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    for path, cause in ((tmp_path / "nope", "does not exist"), (tmp_path / "notes.txt", "no run")):
        done = subprocess.run(
            [sys.executable, "-m", "masenvs.cli", "ui", str(path), "--port", "0"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 2 and cause in done.stderr, done.stderr
        assert "Traceback" not in done.stderr


def test_each_sample_says_whether_its_group_trained_and_why_not() -> None:
    from masenvs.trainer.atgrpo import group_advantages
    from masenvs.trainer.run.steplog import step_records
    from masenvs.trainer.samples import Sample
    from masenvs.trainer.update_config import AlgorithmConfig

    def s(group: str, agent: str, reward: float, k: int) -> Sample:
        meta = {"call_id": f"{group}-call", "choice": k, "continued": k == 0}
        return Sample([1], [2, 3], [], agent, agent, (group, 0, agent), reward, meta=meta)

    samples = [
        s("flat", "tool", 1.0, 0),
        s("flat", "tool", 1.0, 1),
        s("wide", "tool", 2.0, 0),
        s("wide", "tool", -2.0, 1),
        s("narrow", "tool", 0.1, 0),
        s("narrow", "tool", 0.0, 1),
        s("frozen", "plan", 1.0, 0),
        s("frozen", "plan", 0.0, 1),
    ]
    trained = [x for x in samples if x.agent == "tool"]  # plan is frozen this step
    cfg = AlgorithmConfig(drop_zero_std_groups=True, keep_top_groups=0.5)
    trainable, _ = group_advantages(trained, cfg)
    rows = {(r["group"][0], r["choice"]): r for r in step_records(7, samples, trained, trainable)}
    assert {(g, r["drop"]) for (g, _), r in rows.items()} == {
        ("flat", "flat"),
        ("wide", None),
        ("narrow", "filtered"),  # keep_top_groups kept the wider group
        ("frozen", "frozen"),
    }
    assert rows[("wide", 0)]["advantage"] > 0 > rows[("wide", 1)]["advantage"]
    assert rows[("wide", 0)]["kept"] and not rows[("narrow", 0)]["kept"]
    assert rows[("narrow", 0)]["advantage"] is None
    assert rows[("wide", 0)]["continued"] and not rows[("wide", 1)]["continued"]
    assert all(r["step"] == 7 for r in rows.values())


def test_a_step_of_many_tasks_opens_on_ten_and_links_every_task(tmp_path: Path) -> None:
    from starlette.testclient import TestClient

    from masenvs.ui.server import create_app

    run = tmp_path / "wide"
    lines = []
    with TraceStore(run / "traces") as store:
        for task in range(12):
            store.append(call(f"c{task}", f"s1-{task}"))
            for k in range(2):
                row = json.loads(sample(1, f"c{task}", k, "a", float(k), k == 1))
                row["group"] = [f"plan_path:{task}", 0, "tool"]
                row["task_id"] = f"plan_path:{task}"
                lines.append(json.dumps(row) + "\n")
    (run / "samples.jsonl").write_text("".join(lines))
    client = TestClient(create_app([run]), base_url="http://127.0.0.1")

    def tasks(query: str = "") -> list[str]:
        html = client.get(f"/run/wide/step/1{query}").text
        return re.findall(r'<section class="task" data-task="([^"]+)"', html)

    assert tasks() == [f"plan_path:{i}" for i in range(10)]
    assert tasks("?from=10") == ["plan_path:10", "plan_path:11"]
    assert tasks("?task=plan_path:7") == ["plan_path:7"]
    assert 'href="?from=10"' in client.get("/run/wide/step/1").text
