"""`masenvs ui` in a real browser: Debian's headless chromium driven by Playwright, against
`masenvs ui` started as a subprocess over runs made by real tiny trainings.

Set MASENVS_UI_SCREENSHOTS=docs/img to rewrite the screenshots docs/ui.md shows.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from tiny_runs import plan_path_run

from masenvs.trainer.config import load_config
from masenvs.trainer.run.train import train

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
SHOTS = os.environ.get("MASENVS_UI_SCREENSHOTS")

try:
    import playwright.sync_api as playwright
except ImportError:
    if os.environ.get("CI"):  # CI installs it (dev extra): a missing one is a failure there
        raise
    pytest.skip("no playwright (pip install 'masenvs[dev]')", allow_module_level=True)
if not Path(CHROMIUM).exists():
    if os.environ.get("CI"):
        raise RuntimeError("the ui tests need Debian's chromium: apt-get install chromium")
    pytest.skip("no chromium (apt-get install chromium)", allow_module_level=True)


# -- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with playwright.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        yield b
        b.close()


class Page:
    """A browser tab that fails the test on any console error or uncaught exception."""

    def __init__(self, browser: Any, base: str) -> None:
        self.base = base
        self.page = browser.new_page(viewport={"width": 1300, "height": 900})
        self.errors: list[str] = []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else 0)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))

    def goto(self, path: str) -> Any:
        response = self.page.goto(self.base + path)
        assert response is not None and response.ok, f"{path}: {response and response.status}"
        return self.page

    def shot(self, name: str) -> None:
        folder = Path(SHOTS) if SHOTS else None
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
            self.page.screenshot(path=str(folder / f"ui-{name}.png"), full_page=True)

    def close(self) -> None:
        self.page.close()
        assert self.errors == [], self.errors


@pytest.fixture
def tab(browser: Any) -> Iterator[Any]:
    pages: list[Page] = []

    def open_tab(base: str) -> Page:
        pages.append(Page(browser, base))
        return pages[-1]

    yield open_tab
    for p in pages:
        p.close()


class UI:
    """`masenvs ui` as a user starts it, on a free port."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "masenvs.cli", "ui", *args, "--port", "0"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, **(env or {})},
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        found = re.search(r"http://localhost:(\d+)/", line)
        assert found, line + self.proc.stdout.read()
        self.url = f"http://127.0.0.1:{found.group(1)}"

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


@pytest.fixture
def ui() -> Iterator[Any]:
    started: list[UI] = []

    def start(*args: str, **kw: Any) -> UI:
        started.append(UI(*args, **kw))
        return started[-1]

    yield start
    for u in started:
        u.stop()


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two steps of plan-path (tool and plan agents, K=2) on the tiny model."""
    run_dir = tmp_path_factory.mktemp("runs") / "plan-path"
    train_beside_the_browser(load_config(None, plan_path_run(run_dir, "model.name=tiny")))
    return run_dir


def train_beside_the_browser(cfg: Any) -> None:
    """`train` in a worker thread: Playwright's sync API keeps an event loop running on this
    one, where the trainer's asyncio.run cannot start another."""
    with ThreadPoolExecutor(1) as pool:
        pool.submit(train, cfg).result()


def samples(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]


# -- what the trainer writes for the viewer ---------------------------------------------------------


def test_the_trainer_records_each_samples_group_advantage_and_the_branch_that_continued(
    tiny_run: Path,
) -> None:
    rows = samples(tiny_run)
    assert {r["step"] for r in rows} == {1, 2}
    groups: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["step"], json.dumps(r["group"])), []).append(r)
    assert len(groups) == 8  # 2 steps x 2 tasks x 2 agents
    for members in groups.values():
        assert sorted(m["choice"] for m in members) == [0, 1]  # K = 2 candidates
        assert sum(m["continued"] for m in members) == 1  # exactly one branch goes on
        assert {m["agent"] for m in members} <= {"tool", "plan"}
        for m in members:
            assert set(m["reward_parts"]) == {"process", "agent", "team"}
            # the reward is the env's parts plus the team term other agents' steps paid
            own = sum(m["reward_parts"].values()) + (m["team_term"] or 0.0)
            assert own == pytest.approx(m["reward"], abs=1e-6)
            assert m["kept"] and m["advantage"] is not None
            assert len(m["learner_logprobs"]) == m["completion_tokens"] == 8


# -- the views ----------------------------------------------------------------------------------


def test_runs_step_tree_and_conversation_show_agents_rewards_and_the_continued_branch(
    tiny_run: Path, ui: Any, tab: Any
) -> None:
    copy = tiny_run.parent / "plan-path-copy"  # a second run to overlay (its index travels)
    if not copy.exists():
        shutil.copytree(tiny_run, copy)
    server = ui(str(tiny_run.parent))
    t = tab(server.url)
    page = t.goto("/")
    row = page.locator('#runs tr[data-run="plan-path"]')
    assert "finished" in row.inner_text() and "plan_path" in row.inner_text()
    page.wait_for_selector("figure[data-chart][data-drawn=yes]")
    captions = page.locator("figure[data-chart] figcaption").all_inner_texts()
    for title in ("success", "reward", "loss", "grad norm", "learning rate", "tokens/s"):
        assert title in captions
    legend = page.locator("figure[data-chart]").first.locator(".u-legend").inner_text()
    assert "plan-path: train/success" in legend and "plan-path-copy: train/success" in legend
    t.shot("runs")
    page.locator('#runs input[value="plan-path-copy"]').uncheck()
    page.locator("form.runs button").click()  # overlay only the checked run
    page.wait_for_url(re.compile(r"run=plan-path$"))
    page.wait_for_selector("figure[data-chart][data-drawn=yes]")
    legend = page.locator("figure[data-chart]").first.locator(".u-legend").inner_text()
    assert "train/success" in legend and "plan-path-copy" not in legend

    row.locator("a", has_text="plan-path").click()
    page.wait_for_selector("#steps")
    assert page.locator("#steps tr[data-step]").count() == 2
    header = page.locator("#steps thead").inner_text()
    assert "reward tool" in header and "reward plan" in header
    assert "answer length" in page.locator(".charts").nth(1).inner_text()
    t.shot("run")

    page.locator("#steps a", has_text="step 1").click()
    page.wait_for_selector("svg.tree")
    tasks = page.locator("section.task")
    assert tasks.count() == 2
    rows = samples(tiny_run)
    first_task = tasks.first.get_attribute("data-task")
    mine = [r for r in rows if r["step"] == 1 and r["task_id"] == first_task]
    continued = next(r for r in mine if r["agent"] == "tool" and r["continued"])
    tree = tasks.first.locator("svg.tree")
    node = tree.locator(f'a.node[data-agent="tool"][data-choice="{continued["choice"]}"]')
    assert node.get_attribute("data-continued") == "yes"
    assert tree.locator('a.node[data-continued="yes"]').count() == 2  # one per turn
    assert f"reward {continued['reward']:.3g}" in node.text_content()
    table = tasks.first.locator("table.groups")
    continued_row = table.locator('tr.cand[data-continued="yes"][data-agent="tool"]')
    assert "continued" in continued_row.inner_text()
    assert f"{continued['reward_parts']['agent']:.3g}" in continued_row.inner_text()
    for row in table.locator("tr.cand").all():  # the parts shown sum to the reward shown
        terms = json.loads(row.locator(".terms").get_attribute("data-terms"))
        shown = float(row.locator("td.reward").inner_text())
        assert sum(terms) == pytest.approx(shown, abs=5e-3 * max(1.0, abs(shown)))
    t.shot("step")

    node.click()
    page.wait_for_selector("section.choice")
    assert page.locator("h1").inner_text().startswith("tool call")
    record = next(
        json.loads(line)
        for seg in (tiny_run / "traces").glob("segment-*.jsonl")
        for line in seg.read_text().splitlines()
        if json.loads(line).get("id") == continued["call_id"]
    )
    system = page.locator(".msg.role-system pre").inner_text()
    assert system == record["messages"][0]["content"]  # the exact prompt from the trace
    choice = page.locator(f"#choice-{continued['choice']}")
    assert "continued" in choice.locator("h2").inner_text()
    assert (
        choice.locator("pre.completion").inner_text()
        == record["choices"][continued["choice"]]["text"]
    )
    assert choice.locator(".tokens .tok").count() == 8
    choice.locator("details summary").click()
    cells = choice.locator(".tokens-table thead").inner_text()
    assert "sampler log-prob" in cells and "learner log-prob" in cells
    assert choice.locator("tr.mismatch").count() == 0  # same weights: they agree
    t.shot("conversation")

    # a wide tolerance of 0 marks every token whose two log-probs differ at all
    strict = t.goto(f"/run/plan-path/call/{continued['call_id']}?tol=0")
    assert strict.locator(f"#choice-{continued['choice']} .tok.mismatch").count() >= 1


def test_a_run_that_cannot_learn_shows_its_banner_and_badge(
    tmp_path: Path, ui: Any, tab: Any
) -> None:
    from test_ui_diagnosis import flat_run

    flat_run(tmp_path / "runs")
    server = ui(str(tmp_path / "runs"))
    t = tab(server.url)
    page = t.goto("/")
    badge = page.locator('#runs tr[data-run="no-boxed"] a.verdict')
    assert badge.inner_text() == "cannot learn: all groups flat"
    assert "84%" in page.locator('#runs tr[data-run="no-boxed"] td.headline').inner_text()
    badge.click()
    banner = page.locator("#diagnosis")
    banner.wait_for()
    assert banner.is_visible()
    assert banner.locator("h2").inner_text() == "This run cannot learn"
    assert "format penalty -1" in banner.locator(".cause").inner_text()
    assert banner.locator(".tries li").count() == 2
    t.shot("cannot-learn")


def test_a_missing_run_or_call_is_a_404_page_not_a_crash(tiny_run: Path, ui: Any, tab: Any) -> None:
    server = ui(str(tiny_run))
    t = tab(server.url)
    response = t.page.goto(server.url + "/run/plan-path/call/nope")
    assert response.status == 404 and "no call 'nope'" in t.page.inner_text("main")
    response = t.page.goto(server.url + "/run/nope")
    assert response.status == 404
    t.errors.clear()  # the browser logs the 404s themselves


def test_model_output_is_shown_as_text_never_run_as_html(tmp_path: Path, ui: Any, tab: Any) -> None:
    from masenvs.traces import CallRecord, ChoiceRecord, TraceStore

    evil = '<img src=x onerror="window.pwned=1"><script>window.pwned=2</script>'
    run = tmp_path / "evil"
    with TraceStore(run / "traces") as store:
        store.append(
            CallRecord(
                id="call-1",
                rollout_id="s1-0",
                agent="tool",
                model="tool",
                call_index=0,
                kind="chat",
                prompt_token_ids=[1, 2],
                choices=[ChoiceRecord(0, evil, [5, 6], [-0.1, -0.2], "stop")],
                messages=[{"role": "user", "content": evil}],
            )
        )
    server = ui(str(run))
    t = tab(server.url)
    page = t.goto("/run/evil/call/call-1")
    assert evil in page.locator("pre.completion").inner_text()
    assert page.evaluate("window.pwned") is None


def test_beyond_loopback_needs_a_key_and_the_key_opens_it(tiny_run: Path, ui: Any) -> None:
    refused = subprocess.run(
        [sys.executable, "-m", "masenvs.cli", "ui", str(tiny_run), "--host", "0.0.0.0"],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if k != "MASENVS_API_KEY"},
    )
    assert refused.returncode == 2 and "without an API key" in refused.stderr

    import httpx

    server = ui(str(tiny_run), env={"MASENVS_API_KEY": "s3cret"})
    assert httpx.get(server.url + "/").status_code == 401
    assert httpx.get(server.url + "/?key=wrong").status_code == 401
    with httpx.Client(base_url=server.url, follow_redirects=True) as client:
        opened = client.get("/?key=s3cret")  # sets the cookie, then the page opens
        assert opened.status_code == 200 and "plan-path" in opened.text
        assert client.get("/run/plan-path").status_code == 200
    bearer = httpx.get(server.url + "/run/plan-path", headers={"Authorization": "Bearer s3cret"})
    assert bearer.status_code == 200
    # a page of another site cannot read a loopback server through DNS rebinding
    rebound = {"Host": "evil.example", "Authorization": "Bearer s3cret"}
    assert httpx.get(server.url + "/", headers=rebound).status_code == 400


# -- eval ---------------------------------------------------------------------------------------


def test_an_eval_report_shows_two_policies_answering_the_same_task_side_by_side(
    tiny_run: Path, tmp_path: Path, ui: Any, tab: Any
) -> None:
    from masenvs.trainer.commands.eval import main as evaluate

    checkpoint = tiny_run / "checkpoints" / "step_00000002"
    out = tmp_path / "evals" / "eval-tiny.json"
    args = ["--checkpoint", str(checkpoint), "--baseline", "--tasks", "2", "-k", "1"]
    args += ["--max-tokens", "8", "--out", str(out)]
    swapped = out.with_name("eval-swap.json")
    swap = ["--checkpoint", str(checkpoint), "--swap", "plan=tool", "--tasks", "2", "-k", "1"]
    swap += ["--max-tokens", "8", "--out", str(swapped)]
    with ThreadPoolExecutor(1) as pool:  # asyncio.run cannot start on Playwright's loop
        assert pool.submit(evaluate, args).result() == 0
        assert pool.submit(evaluate, swap).result() == 0
    report = json.loads(out.read_text())
    server = ui(str(out.parent))
    t = tab(server.url)
    page = t.goto("/")
    page.locator(".reports a", has_text="eval-tiny").click()
    page.wait_for_selector(".side-by-side")
    results = page.locator("#eval-results").inner_text()
    for r in report["results"]:
        assert r["name"] in results
    columns = page.locator(".side-by-side section.column")
    assert columns.evaluate_all("els => els.map(e => e.dataset.policy)") == [
        r["name"] for r in report["results"]
    ]
    task = page.locator("select[name=task]").input_value()
    for i in range(columns.count()):
        column = columns.nth(i)
        assert column.locator(".episode").count() == 1  # n = 1 episode of this task each
        assert "tool" in column.inner_text() and "plan" in column.inner_text()
    second = page.locator("select[name=task] option").nth(1).get_attribute("value")
    page.select_option("select[name=task]", second)  # the form reloads on the other task
    page.wait_for_url(re.compile(r"task="))
    assert page.locator("select[name=task]").input_value() == second != task
    t.shot("eval")
    columns.first.locator(".episode a").first.click()
    page.wait_for_selector("section.choice")
    assert page.locator("h1").inner_text().startswith("tool call")

    # the role swap beside the same checkpoint in its own seats (from the other report)
    page = t.goto("/eval/eval-swap")
    own = next(r for r in report["results"] if r["name"] != "base")
    row = page.locator("#role-swap tbody tr")
    assert row.count() == 1 and own["name"] in row.inner_text()
    assert "eval-tiny" in row.inner_text()  # where the unswapped figure comes from
    t.shot("role-swap")
    swap_result = json.loads(swapped.read_text())["results"][0]
    assert swap_result["name"] == f"{own['name']} swap plan=tool"


# -- auto-MAS and workflow runs -------------------------------------------------------------------

GOOD_DESIGN = 'a = Agent("solver", "Answer with \\\\boxed{}.")\nsystem = Ensemble(a, Agent("b"), judge=Agent("j"))'


def test_an_auto_mas_run_shows_each_design_graph_its_nodes_calls_and_scores(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ui: Any, tab: Any
) -> None:
    import masenvs.envs.auto_mas as auto_mas

    # The tiny model writes noise, never a design: its replies are swapped for one.
    monkeypatch.setattr(auto_mas, "extract_design", lambda text: GOOD_DESIGN)
    run_dir = tmp_path / "auto-mas"
    cfg = load_config(
        ROOT / "examples" / "auto_mas.yaml",
        [
            "model.name=tiny",
            f"run_dir={run_dir}",
            "steps=1",
            "validation.every=0",
            "rollout.tasks_per_step=1",
            "env.options.max_tokens=6",
            "rollout.max_tokens=12",
            "logging.tensorboard=false",
        ],
    )
    train_beside_the_browser(cfg)
    designs = [json.loads(line) for line in (run_dir / "designs.jsonl").read_text().splitlines()]
    server = ui(str(run_dir))
    t = tab(server.url)
    page = t.goto("/run/auto-mas/step/1")
    table = page.locator("#designs")
    assert table.locator("tbody tr").count() == len(designs)
    assert "Ensemble(solver, b, j)" in table.inner_text()
    assert "designer" in page.locator("svg.tree").text_content()
    # the schedule trains the executor first: the designer's group is shown as not trained
    frozen = page.locator('table.groups tr.cand[data-agent="designer"][data-kept="no"]')
    assert (
        frozen.count() == 2 and "dropped: frozen" in page.locator("table.groups").first.inner_text()
    )
    table.locator("a").first.click()
    page.wait_for_selector("svg.graph")
    nodes = page.locator("svg.graph a.gnode")
    assert sorted(nodes.evaluate_all("els => els.map(e => e.dataset.node)")) == ["b", "j", "solver"]
    assert page.locator("svg.graph line.edge").count() == 2  # solver -> j, b -> j
    first = designs[0]
    scores = page.locator("#scores").inner_text()
    assert "designer (mean of executions)" in scores
    assert scores.count("execution ") == len(first["executions"])
    t.shot("design")
    nodes.filter(has_text="solver").click()  # one click to the node's calls
    assert page.evaluate("location.hash") == "#node-solver"
    assert page.locator("#node-solver").is_visible()


def test_a_workflow_run_shows_its_call_graph_agents_and_the_failure_cause(
    tmp_path: Path, ui: Any, tab: Any
) -> None:
    run_dir = tmp_path / "workflow"
    cfg = load_config(
        None,
        [
            f"run_dir={run_dir}",
            "model.name=tiny",
            "lora.rank=4",
            "lora.alpha=8",
            "steps=1",
            "env.name=math",
            "env.options={level: 1}",
            "rollout.branches=2",
            "rollout.tasks_per_step=1",
            "rollout.max_tokens=8",
            "validation.every=0",
            "logging.tensorboard=false",
            "workflow.factory=ui_programs:solve_check_fails_first_run",
            "workflow.framework=langgraph",
            "workflow.agents=[solver, checker]",
            "workflow.max_failure_rate=1.0",
        ],
    )
    train_beside_the_browser(cfg)
    server = ui(str(run_dir))
    t = tab(server.url)
    page = t.goto("/run/workflow")
    runs = page.locator("#program-runs tbody tr")
    assert runs.count() == 2
    failed = page.locator("#program-runs tr.failed")
    assert failed.count() == 1 and "ValueError" in failed.inner_text()
    failed.locator("a").click()
    page.wait_for_selector("svg.callgraph")
    assert "the checker's verdict could not be parsed" in page.locator("#failure").inner_text()
    boxes = page.locator("svg.callgraph a.node")
    assert boxes.evaluate_all("els => els.map(e => e.dataset.agent)") == ["solver", "checker"]
    t.shot("workflow")
    boxes.first.click()
    page.wait_for_selector("section.choice")
    assert page.locator("h1").inner_text().startswith("solver call 0")


# -- live -----------------------------------------------------------------------------------------


def test_a_run_still_training_shows_its_next_steps_without_a_reload(
    tmp_path: Path, ui: Any, tab: Any
) -> None:
    runs = tmp_path / "runs"
    runs.mkdir()
    (tmp_path / "empty.yaml").write_text("{}\n")
    overrides = plan_path_run(runs / "live", "model.name=tiny", "steps=4")
    training = subprocess.Popen(
        [sys.executable, "-m", "masenvs.cli", "train", str(tmp_path / "empty.yaml")]
        + [f"--set={o}" for o in overrides],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        server = ui(str(runs))  # an empty folder: the run shows up when it starts
        t = tab(server.url)
        page = t.goto("/")
        page.evaluate("window.sameDocument = true")
        page.wait_for_selector('#runs a[href="/run/live"]', timeout=120_000)
        assert page.evaluate("window.sameDocument") is True  # the list updated in place
        page.locator('#runs a[href="/run/live"]').click()
        page.wait_for_selector("#steps")
        seen_at_open = page.locator("#steps tr[data-step]").count()
        page.evaluate("window.sameDocument = true")
        page.wait_for_selector('#steps tr[data-step="4"]', timeout=120_000)
        assert seen_at_open < 4
        assert page.evaluate("window.sameDocument") is True  # no reload: htmx swapped it in
        assert training.wait(timeout=120) == 0
    finally:
        if training.poll() is None:
            training.kill()
            training.wait()
    deadline = time.time() + 10
    while time.time() < deadline and "finished" not in page.locator("h1").inner_text():
        page.wait_for_timeout(500)
    assert "finished" in page.locator("h1").inner_text()
