"""Why a run learns or does not: per step and agent, the numbers an RL sanity check reads.

    python scripts/rl_diagnostics.py runs/quickstart [--hit 1.0]

From a run directory (`metrics.jsonl`, `samples.jsonl`, `traces/`), per training step and
agent: samples, mean reward, pass@K (share of groups with a candidate whose team + agent
reward reaches `--hit`, the goal bonus of plan-path, Sokoban, Sudoku), groups that trained
and flat ones, format failures (agent reward at or below `--format-penalty`), the spread of
rewards inside a group, |advantage|, distinct completions among a group's K, the mean
log-prob per sampled token (its negative is an entropy estimate: falling means the policy
is collapsing), the most common answer's share, and from metrics.jsonl lr, grad norm, the
learner-backend log-prob gap and clip fractions. Validation success is printed where run.
"""

from __future__ import annotations

import argparse
import glob
import json
import statistics
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any


def load_jsonl(path: Path) -> list[dict[str, Any]]:
    out = []
    if not path.is_file():
        return out
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a torn last line
    return out


def trace_choices(run: Path) -> dict[tuple[str, int], dict[str, Any]]:
    """(call id, choice index) -> the choice's text, token ids and behaviour log-probs."""
    out = {}
    for f in glob.glob(str(run / "traces" / "*.jsonl")):
        for record in load_jsonl(Path(f)):
            if record.get("type") != "call":
                continue
            for choice in record.get("choices", []):
                out[(record["id"], int(choice.get("index", 0)))] = choice
    return out


def step_table(run: Path, hit: float, format_penalty: float) -> list[dict[str, Any]]:
    samples = load_jsonl(run / "samples.jsonl")
    choices = trace_choices(run)
    metrics = {r["step"]: r for r in load_jsonl(run / "metrics.jsonl")}
    by_step_agent: dict[tuple[int, str], list[dict[str, Any]]] = defaultdict(list)
    for s in samples:
        by_step_agent[(s["step"], s["agent"])].append(s)
    rows = []
    for (step, agent), items in sorted(by_step_agent.items()):
        groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for s in items:
            groups[json.dumps(s["group"])].append(s)
        texts, logprobs = [], []
        distinct = []
        for members in groups.values():
            group_texts = []
            for s in members:
                choice = choices.get((s["call_id"], int(s.get("choice") or 0)))
                if choice is None:
                    continue
                group_texts.append(choice.get("text", ""))
                logprobs += choice.get("logprobs") or []
            texts += group_texts
            if group_texts:
                distinct.append(len(set(group_texts)))

        def reached(s: dict[str, Any]) -> bool:
            parts = s.get("reward_parts") or {}
            return parts.get("team", 0.0) + parts.get("agent", 0.0) >= hit

        def failed_format(s: dict[str, Any]) -> bool:
            return (s.get("reward_parts") or {}).get("agent", 0.0) <= format_penalty

        m = metrics.get(step, {})
        policy = items[0]["policy"]
        top = Counter(texts).most_common(1)
        rows.append(
            {
                "step": step,
                "agent": agent,
                "samples": len(items),
                "reward": statistics.fmean(s["reward"] for s in items),
                "pass@K": sum(any(reached(s) for s in g) for g in groups.values()) / len(groups),
                "hit": sum(reached(s) for s in items) / len(items),
                "format_fail": sum(failed_format(s) for s in items) / len(items),
                "groups": len(groups),
                "kept": sum(any(s["kept"] for s in g) for g in groups.values()),
                "group_std": statistics.fmean(
                    statistics.pstdev([s["reward"] for s in g]) for g in groups.values()
                ),
                "|A|": statistics.fmean(abs(s["advantage"] or 0.0) for s in items),
                "distinct/K": statistics.fmean(distinct) if distinct else float("nan"),
                "logp/token": statistics.fmean(logprobs) if logprobs else float("nan"),
                "top_answer": (top[0][1] / len(texts)) if top else float("nan"),
                "top_text": top[0][0][:40] if top else "",
                "lr": m.get("learner/lr", float("nan")),
                "grad_norm": m.get(f"learner/{policy}/grad_norm", float("nan")),
                "dlogp": m.get(f"learner/{policy}/logprob_diff_mean", float("nan")),
                "clip": m.get(f"learner/{policy}/clip_frac_low", 0.0)
                + m.get(f"learner/{policy}/clip_frac_high", 0.0),
                "val": m.get("val/success", ""),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run", type=Path, nargs="+")
    parser.add_argument("--hit", type=float, default=1.0, help="team + agent reward of a success")
    parser.add_argument("--format-penalty", type=float, default=-1.0)
    args = parser.parse_args()
    for run in args.run:
        rows = step_table(run, args.hit, args.format_penalty)
        val = [
            (r["step"], r["val/success"])
            for r in load_jsonl(run / "metrics.jsonl")
            if "val/success" in r
        ]
        print(f"# {run}: greedy validation {', '.join(f'{s}: {v:.0%}' for s, v in val)}")
        cols = [
            "step", "agent", "samples", "reward", "pass@K", "hit", "format_fail", "kept",
            "groups", "group_std", "|A|", "distinct/K", "logp/token", "top_answer", "lr",
            "grad_norm", "dlogp", "clip",
        ]  # fmt: skip
        print(" | ".join(cols) + " | top text")
        for r in rows:
            cells = [f"{r[c]:.3g}" if isinstance(r[c], float) else str(r[c]) for c in cols]
            print(" | ".join(cells) + f" | {r['top_text']!r}")


if __name__ == "__main__":
    main()
