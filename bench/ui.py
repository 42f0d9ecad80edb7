"""`masenvs ui` on a run of 100k traces: how long a step and a conversation take to open in a
real browser (Debian's chromium, driven by Playwright), after the first index build.

    python bench/ui.py                 # 100k calls (1000 steps x 100 calls, K=2), in /tmp
    python bench/ui.py --calls 20000   # smaller

Prints the time to write the run, the first (index-building) request, and the median and
worst of opening a step and a conversation page (navigation to `load`, charts drawn).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from masenvs.traces import CallRecord, ChoiceRecord, TraceStore

FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
AGENTS = ("tool", "plan")


def build_run(run_dir: Path, calls: int, per_step: int, k: int) -> None:
    """A plan-path-like run: per step, tasks x agents calls of K choices, samples.jsonl and
    metrics.jsonl as the trainer writes them."""
    rng = random.Random(0)
    steps = calls // per_step
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(
        f"steps: {steps}\nmodel:\n  name: bench-model-not-on-this-machine\n"
        "env:\n  name: plan_path\n  options: {size: 4}\n"
    )
    prompt = [rng.randrange(50_000) for _ in range(300)]
    with (
        TraceStore(run_dir / "traces") as store,
        open(run_dir / "samples.jsonl", "w") as samples,
        open(run_dir / "metrics.jsonl", "w") as metrics,
    ):
        for step in range(1, steps + 1):
            for c in range(per_step):
                task, agent = c // len(AGENTS), AGENTS[c % len(AGENTS)]
                cid = f"chatcmpl-{step}-{c}"
                choices = []
                for j in range(k):
                    ids = [rng.randrange(50_000) for _ in range(48)]
                    lps = [round(-rng.random() * 3, 4) for _ in ids]
                    choices.append(
                        ChoiceRecord(j, f"Moves: [U, R] {step}/{c}/{j}", ids, lps, "stop")
                    )
                store.append(
                    CallRecord(
                        id=cid,
                        rollout_id=f"s{step}-{task}",
                        agent=agent,
                        model=agent,
                        call_index=0,
                        kind="chat",
                        prompt_token_ids=prompt,
                        choices=choices,
                        messages=[{"role": "user", "content": "Grid (4x4) ... " * 20}],
                        started_at=time.time(),
                        finished_at=time.time(),
                    )
                )
                rewards = [rng.choice([-1.0, 0.0, 1.0]) for _ in range(k)]
                best = max(range(k), key=lambda j: rewards[j])
                mean = sum(rewards) / k
                std = statistics.pstdev(rewards)
                for j in range(k):
                    samples.write(
                        json.dumps(
                            {
                                "step": step,
                                "batch": f"b{step}",
                                "call_id": cid,
                                "choice": j,
                                "agent": agent,
                                "policy": agent,
                                "group": [f"plan_path:{task}", 0, agent],
                                "task_id": f"plan_path:{task}",
                                "round": 0,
                                "reward": rewards[j],
                                "reward_parts": {"process": 0.0, "agent": rewards[j], "team": 0.0},
                                "advantage": (rewards[j] - mean) / (std + 1e-6) if std else 0.0,
                                "kept": True,
                                "drop": None,
                                "continued": j == best,
                                "completion_tokens": 48,
                                "learner_logprobs": [
                                    round(-rng.random() * 3, 5) for _ in range(48)
                                ],
                            }
                        )
                        + "\n"
                    )
            metrics.write(
                json.dumps({"step": step, "train/success": rng.random(), "train/reward/tool": 0.0})
                + "\n"
            )
    (run_dir / "curves.png").write_bytes(b"")


def _fetch(url: str) -> float:
    t = time.perf_counter()
    with urllib.request.urlopen(url) as response:
        response.read()
    return time.perf_counter() - t


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=100_000)
    parser.add_argument("--per-step", type=int, default=100)
    parser.add_argument("-k", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--chromium", default=shutil.which("chromium") or "/usr/bin/chromium")
    parser.add_argument(
        "--dir",
        type=Path,
        help="keep the generated run here and reuse it next time (its "
        "index is deleted first, so the first build is timed again)",
    )
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    root = args.dir or Path(tempfile.mkdtemp(prefix="masenvs-ui-bench-"))
    run_dir = root / "big"
    if (run_dir / "samples.jsonl").is_file():
        for index in run_dir.glob(".masenvs-ui.sqlite*"):
            index.unlink()
    else:
        started = time.perf_counter()
        build_run(run_dir, args.calls, args.per_step, args.k)
        print(f"wrote {args.calls} calls in {time.perf_counter() - started:.1f}s")
    size = sum(p.stat().st_size for p in run_dir.rglob("*") if p.is_file())
    print(f"run: {size / 1e6:.0f} MB")

    server = subprocess.Popen(
        [sys.executable, "-m", "masenvs.cli", "ui", str(run_dir), "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = server.stdout.readline()  # type: ignore[union-attr]
        port = re.search(r"localhost:(\d+)", line).group(1)  # type: ignore[union-attr]
        base = f"http://127.0.0.1:{port}"
        steps = args.calls // args.per_step
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=args.chromium, args=FLAGS)
            page = browser.new_page()
            t = time.perf_counter()
            page.goto(f"{base}/run/big")
            print(f"the run's page, while its index builds: {time.perf_counter() - t:.1f}s")
            # the page polls itself and drops the banner once the index is complete
            page.wait_for_selector("#main:not(:has(.indexing))", timeout=900_000)
            print(f"first index build: {time.perf_counter() - t:.1f}s (once; later: appends)")
            rng = random.Random(1)
            step_times, call_times, step_http, call_http = [], [], [], []
            for _ in range(args.repeats):
                step = rng.randrange(1, steps + 1)
                t = time.perf_counter()
                page.goto(f"{base}/run/big/step/{step}")
                page.wait_for_selector("svg.tree")
                step_times.append(time.perf_counter() - t)
                link = page.locator("svg.tree a.node").first
                href = link.get_attribute("href").split("#")[0]
                t = time.perf_counter()
                link.click()
                page.wait_for_selector("section.choice")
                call_times.append(time.perf_counter() - t)
                # the server's share: the same pages fetched without a browser
                step_http.append(_fetch(f"{base}/run/big/step/{step}"))
                call_http.append(_fetch(base + href))
            browser.close()
    finally:
        server.terminate()
        server.wait()
    for name, times in (
        ("open a step (browser)", step_times),
        ("open a conversation (browser)", call_times),
        ("  the step page's HTTP response", step_http),
        ("  the conversation's HTTP response", call_http),
    ):
        print(
            f"{name}: median {statistics.median(times) * 1000:.0f} ms, "
            f"worst {max(times) * 1000:.0f} ms over {len(times)} "
            f"(in order: {', '.join(f'{t * 1000:.0f}' for t in times)})"
        )
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
