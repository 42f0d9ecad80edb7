"""`masenvs ui` says why a run cannot learn, heads the runs list with validation success,
shows reward parts that sum to the reward, and opens a `masenvs rollout` folder: the pages
as the server renders them over small run folders written here."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from starlette.testclient import TestClient

from masenvs.traces import CallRecord, ChoiceRecord, EpisodeRecord, TraceStore
from masenvs.ui.server import create_app


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def sample(step: int, call: str, choice: int, reward: float, **extra: Any) -> dict[str, Any]:
    record = {
        "step": step,
        "batch": f"b{step}",
        "call_id": call,
        "choice": choice,
        "rollout_id": f"s{step}-0-{choice}",
        "agent": "solver",
        "policy": "solver",
        "group": ["math:0", "solver", 0],  # a workflow's first solver call of task math:0
        "task_id": "math:0",
        "round": None,
        "reward": reward,
        "reward_parts": None,
        "advantage": 0.0,
        "kept": True,
        "drop": None,
        "continued": False,
        "failed": False,
        "completion_tokens": 3,
    }
    return {**record, **extra}


def flat_run(root: Path, name: str = "no-boxed") -> Path:
    """The issue's run: a workflow on math whose every answer lacked \\boxed{}, so every
    reward is the format penalty, every group flat and the gradient 0; validation 84%."""
    run = root / name
    run.mkdir(parents=True)
    config = {"env": {"name": "math", "options": {}}, "steps": 2, "workflow": {"agents": []}}
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    metrics = [
        {"step": 0, "val/success": 0.12},
        {"step": 1, "train/success": 0.0, "groups/groups": 2, "groups/zero_std": 2,
         "learner/solver/grad_norm": 0.0, "learner/solver/update_norm": 0.0},
        {"step": 2, "train/success": 0.5, "val/success": 0.84, "groups/groups": 2,
         "groups/zero_std": 2, "learner/solver/grad_norm": 0.0,
         "learner/solver/update_norm": 0.0},
    ]  # fmt: skip
    write_jsonl(run / "metrics.jsonl", metrics)
    rows = [
        sample(s, f"c{s}-{k}", 0, -1.0, group=["math:0", "solver", call], rollout_id=f"s{s}-0-{k}")
        for s in (1, 2)
        for call in (0, 1)
        for k in (0, 1)
    ]  # per step 2 groups (the solver's 1st and 2nd call) of K=2 runs
    write_jsonl(run / "samples.jsonl", rows)
    return run


def client(*paths: Path) -> TestClient:
    return TestClient(create_app(list(paths)), base_url="http://127.0.0.1")


def test_a_run_that_cannot_learn_says_why_and_what_to_try(tmp_path: Path) -> None:
    run = flat_run(tmp_path)
    with client(run) as ui:
        page = ui.get("/run/no-boxed").text
    banner = re.search(r'<div class="banner cannot" id="diagnosis".*?</div>', page, re.S)
    assert banner, page
    text = banner.group(0)
    assert "This run cannot learn" in text
    assert "every group was flat (4 of 4 groups over 2 steps)" in text
    assert "policy solver&#39;s gradient was 0 at every step" in text
    # the cause in the env's own words, and the fixes
    assert (
        "8 of 8 rewards (100%) are the env&#39;s format penalty -1: given for no \\boxed{} answer"
        in text
    )
    assert "\\boxed{}" in text
    assert "env.options.answer_format=number" in text and "rollout.branches" in text
    assert "all flat" in page  # the steps table's badge


def test_the_runs_list_heads_with_validation_success_and_badges_the_run(tmp_path: Path) -> None:
    run = flat_run(tmp_path)
    with client(run) as ui:
        page = ui.get("/").text
    head = re.search(r"<thead>.*?</thead>", page, re.S).group(0)
    assert head.index("val success") < head.index("train success (last batch)")
    row = re.search(r'<tr data-run="no-boxed">.*?</tr>', page, re.S).group(0)
    assert re.search(r"<strong>84%</strong> <small>step 2</small>", row)  # the latest val
    assert "50% <small>step 2</small>" in row  # the last batch, secondary
    assert "cannot learn: all groups flat" in row


def test_a_workflow_step_names_its_groups_and_flags_them_flat(tmp_path: Path) -> None:
    run = flat_run(tmp_path)
    with client(run) as ui:
        page = ui.get("/run/no-boxed/step/1").text
    assert "None" not in page
    assert "call 0" in page and 'class="badge bad flat"' in page
    assert "episode reward —" not in page and "episode reward -1" in page


def step_terms(page: str) -> list[tuple[float, list[float], str]]:
    """(reward, terms, terms' text) of every candidate row of a step page."""
    out = []
    for row in re.findall(r'<tr class="cand.*?</tr>', page, re.S):
        reward = float(re.search(r'class="num reward">([^<]+)<', row).group(1))
        found = re.search(r'data-terms="([^"]+)">(.*?)</span></td>', row, re.S)
        values = json.loads(found.group(1).replace("&#34;", '"'))
        out.append((reward, values, re.sub(r"<[^>]+>", "", found.group(2))))
    return out


def tree_run(root: Path) -> Path:
    """One step of a tree rollout on plan_path: the tool's K=3 candidates of one turn."""
    run = root / "tree"
    run.mkdir()
    config = {"env": {"name": "plan_path", "options": {"reward_weights": {"team": 2.0}}}}
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    tree = {"group": ["plan_path:0", 0, "tool"], "round": 0, "agent": "tool"}
    parts = {"process": 0.24, "agent": 1.5, "team": 0.0}
    rows = [
        # the row: 3.24 = 0.24 + 1.5 + 0 + the plan's step's team term 1.5
        sample(1, "c1", 0, 3.24, reward_parts=parts, team_term=1.5, **tree),
        # the team weight doubles the own step's team part
        sample(1, "c1", 1, 2.5, reward_parts={**parts, "team": 0.38}, **tree),
        # a run written before team_term was recorded: the rest is still shown
        sample(1, "c1", 2, 2.0, reward_parts=parts, **tree),
    ]
    write_jsonl(run / "samples.jsonl", rows)
    return run


def test_the_reward_parts_shown_sum_to_the_reward_team_term_included(tmp_path: Path) -> None:
    with client(tree_run(tmp_path)) as ui:
        page = ui.get("/run/tree/step/1").text
    shown = step_terms(page)
    assert len(shown) == 3
    for reward, values, _ in shown:
        assert sum(values) == pytest.approx(reward, abs=1e-9)
    assert "team, from others&#39; steps 1.5" in shown[0][2]
    assert "team × 2 0.76" in shown[1][2]
    assert "team, from others&#39; steps 0.26" in shown[2][2]


def test_the_team_outcome_chart_says_what_its_number_means(tmp_path: Path) -> None:
    with client(tree_run(tmp_path)) as ui:
        page = ui.get("/run/tree").text
    assert "output changes the team outcome" in page
    assert "0 is no verdict on the agent" in page


def rollout_folder(root: Path) -> Path:
    """What `masenvs rollout` leaves: a trace store (segments of calls and episodes), no
    config, metrics or samples."""
    folder = root / "rollout-20261207-061500"
    with TraceStore(folder) as store:
        for seed in (0, 1):
            rid = f"ro-{seed:012d}"
            choice = ChoiceRecord(0, f"\\boxed{{{seed}}}", [5, 6], [-0.1, -0.2], "stop")
            call = CallRecord(f"call-{seed}", rid, "reasoner", "base", 0, "chat", [1, 2], [choice])
            store.append(call)
            store.append(EpisodeRecord(rid, f"math:{seed}", "math", {"reasoner": 1.0}, True))
    return folder


def test_a_rollout_folder_opens_and_lists_its_episodes(tmp_path: Path) -> None:
    folder = rollout_folder(tmp_path / "runs")
    for given in (folder, folder.parent):  # the folder itself, or the folder of runs
        with client(given) as ui:
            listing = ui.get("/")
            assert listing.status_code == 200
            assert 'href="/run/rollout-20261207-061500"' in listing.text
            page = ui.get("/run/rollout-20261207-061500").text
            assert "math:0" in page and "math:1" in page
            episode = ui.get("/run/rollout-20261207-061500/rollout/ro-000000000001")
            assert episode.status_code == 200 and "\\boxed{1}" in episode.text
