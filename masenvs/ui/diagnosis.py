"""Why a run cannot learn, in words: flat groups, zero gradients, unchanged adapters and the
reward most samples got; and each sample's reward as the terms that sum to it.

The trainer prints these as warnings (trainer/run/metrics.py `step_warnings`); here they are
read back from `metrics.jsonl` and `samples.jsonl`, so the UI says the same thing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from masenvs.ui.runs import Run

FLAT_WARN = 0.8  # a run whose groups are this often flat learns little: say so
DOMINANT = 0.5  # a reward cause this common is named as the run's cause
EPS = 1e-9

SPREAD = (
    "give groups a spread: more rollout.branches, a higher rollout.temperature, or tasks "
    "the model solves sometimes"
)


@dataclass
class Diagnosis:
    """What the run page's banner and the runs list's badge say."""

    cannot_learn: bool
    badge: str  # a few words for the runs list
    reasons: list[str] = field(default_factory=list)
    cause: str | None = None  # the reward most samples got, and why
    tries: list[str] = field(default_factory=list)


def latest(run: Run, key: str) -> tuple[int, float] | None:
    """The last step that logged `key` (e.g. val/success) and its value."""
    for record in reversed(run.metrics()):
        value = record.get(key)
        if isinstance(value, int | float) and math.isfinite(value):
            return record["step"], float(value)
    return None


def flat_groups(run: Run) -> dict[int, tuple[int, int]]:
    """Per step: (groups whose rewards are all equal, groups) over the agents that train;
    from samples.jsonl, else metrics.jsonl's groups/zero_std and groups/groups."""
    rows = run.open_index().query(
        "SELECT step, COUNT(*) AS groups, SUM(flat) AS flat FROM ("
        " SELECT step, grp, MAX(reward) - MIN(reward) < 1e-9 AS flat FROM samples"
        " WHERE drop_reason IS NULL OR drop_reason != 'frozen' GROUP BY step, grp"
        ") GROUP BY step"
    )
    if rows:
        return {r["step"]: (int(r["flat"] or 0), int(r["groups"])) for r in rows}
    out = {}
    for r in run.metrics():
        groups = r.get("groups/groups")
        if isinstance(groups, int | float) and groups > 0:
            out[r["step"]] = (int(r.get("groups/zero_std") or 0), int(groups))
    return out


def diagnose(run: Run) -> Diagnosis | None:
    """The run's verdict, or None while it shows nothing wrong (or is no training run);
    read again only when the run's files grew (the runs list asks every 2 s)."""
    if run.kind != "train":
        return None
    counts = run.open_index().query(
        "SELECT (SELECT COUNT(*) FROM samples) AS s, (SELECT COUNT(*) FROM calls) AS c"
    )[0]
    version = f"{run.version()}.{counts['s']}.{counts['c']}"  # what is indexed, not on disk
    if run._diagnosis is None or run._diagnosis[0] != version:
        run._diagnosis = (version, _diagnose(run))
    return run._diagnosis[1]


def _diagnose(run: Run) -> Diagnosis | None:
    flat = flat_groups(run)
    reasons, tries = [], []
    cannot = False
    n_flat, n_groups = sum(f for f, _ in flat.values()), sum(g for _, g in flat.values())
    if flat and all(f >= g for f, g in flat.values()):
        cannot = True
        reasons.append(
            f"every group was flat ({n_flat} of {n_groups} groups over {len(flat)} step{'s' * (len(flat) != 1)}): all "
            "K candidates of a group got the same reward, so every advantage is 0"
        )
        tries.append(SPREAD)
    elif n_groups and n_flat / n_groups >= FLAT_WARN:
        reasons.append(
            f"{n_flat / n_groups:.0%} of groups were flat ({n_flat} of {n_groups}): only the "
            "others move the weights"
        )
        tries.append(SPREAD)
    still = _unchanged(run)
    for policy, what in still.items():
        reasons.append(f"policy {policy}'s {what} at every step: its adapter did not change")
    if still and len(still) == len(_policies(run)):
        cannot = True
    cause, fixes = reward_cause(run)
    tries = fixes + tries
    if not reasons:
        return None
    if cannot:
        badge = "cannot learn" + (": all groups flat" if n_flat >= n_groups > 0 else "")
    else:
        badge = "learns little"
    return Diagnosis(cannot, badge, reasons, cause, tries)


def _policies(run: Run) -> set[str]:
    return {
        k.removeprefix("learner/").removesuffix("/grad_norm")
        for r in run.metrics()
        for k in r
        if k.startswith("learner/") and k.endswith("/grad_norm") and k.count("/") == 2
    }


def _unchanged(run: Run) -> dict[str, str]:
    """Policies whose gradient (or update) was 0 at every logged step."""
    out = {}
    records = run.metrics()
    for policy in sorted(_policies(run)):
        for key, what in (("grad_norm", "gradient was 0"), ("update_norm", "update was 0")):
            values = [
                r[f"learner/{policy}/{key}"] for r in records if f"learner/{policy}/{key}" in r
            ]
            if values and all(v == 0 for v in values):
                out[policy] = what
                break
    return out


def reward_cause(run: Run) -> tuple[str | None, list[str]]:
    """The reward most samples got and why (the env's format penalty, failed program runs,
    one value everywhere), with what to try; (None, []) when no cause dominates."""
    penalty = run.format_penalty()
    nan = float("nan")
    row = run.open_index().query(
        "SELECT COUNT(*) AS n, SUM(failed = 1) AS failed, SUM(CASE WHEN part_agent IS NOT NULL "
        "THEN ABS(part_agent - ?) < 1e-9 ELSE ABS(reward - ?) < 1e-9 END) AS format "
        "FROM samples WHERE drop_reason IS NULL OR drop_reason != 'frozen'",
        (penalty if penalty is not None else nan, penalty if penalty is not None else nan),
    )[0]
    n = row["n"] or 0
    if not n:
        return None, []
    tries = _cut_answers(run)
    if (row["format"] or 0) / n >= DOMINANT and penalty is not None:
        why = _penalty_reason(run)
        cause = (
            f"{row['format']} of {n} rewards ({row['format'] / n:.0%}) are the env's format "
            f"penalty {penalty:g}{': ' + why if why else ''}"
        )
        fix = (
            "make every agent's prompt ask for the answer format the env parses, with an "
            "example (a workflow's own system prompts too; answer_from must name the final "
            "answer)"
        )
        if _has_option(run, "answer_format"):
            fix += ", or set env.options.answer_format=number"
        return cause, [fix, *tries]
    if (row["failed"] or 0) / n >= DOMINANT:
        cause = (
            f"{row['failed']} of {n} samples come from program runs that failed: their reward "
            "is the failure reward (see Program runs below for each error)"
        )
        return cause, ["fix the first error in Program runs", *tries]
    common = run.open_index().query(
        "SELECT ROUND(reward, 9) AS value, COUNT(*) AS k FROM samples "
        "WHERE drop_reason IS NULL OR drop_reason != 'frozen' GROUP BY value ORDER BY k DESC "
        "LIMIT 1"
    )
    if common and common[0]["k"] / n >= FLAT_WARN:
        return f"{common[0]['k']} of {n} rewards are {common[0]['value']:g}", tries
    return None, tries


def _cut_answers(run: Run) -> list[str]:
    row = run.open_index().query(
        "SELECT COUNT(*) AS n, SUM(finish_reason = 'length') AS cut FROM calls "
        "WHERE train_step IS NOT NULL"
    )[0]
    if row["n"] and (row["cut"] or 0) / row["n"] >= DOMINANT:
        return [
            f"{row['cut'] / row['n']:.0%} of answers stopped at the token limit (finish_reason "
            "length): raise rollout.max_tokens"
        ]
    return []


def _env_field(run: Run, name: str) -> Any:
    try:
        from masenvs.registry import env_class

        return env_class(run.env).config_class.model_fields.get(name)
    except (KeyError, ImportError, AttributeError, ValueError):
        return None


def _has_option(run: Run, name: str) -> bool:
    return _env_field(run, name) is not None


def _penalty_reason(run: Run) -> str:
    """The env's own words for when it gives the penalty ('no \\boxed{} answer ...')."""
    found = _env_field(run, "format_penalty")
    text = (getattr(found, "description", None) or "").strip().rstrip(".")
    if text.lower().startswith("for "):
        text = "given for " + text[4:]
    return text


# -- a sample's reward as the terms that sum to it -----------------------------------------------


def reward_terms(run: Run, sample: dict[str, Any]) -> list[tuple[str, float]]:
    """(label, value) pairs that sum to the sample's reward: the env's parts as weighted in
    the total, the team term other agents' steps of the round added, and what is left (a
    whole episode's return, or the team term of a run written before it was recorded)."""
    weights = (((run.config.get("env") or {}).get("options") or {}).get("reward_weights")) or {}
    parts = sample.get("parts") or {}
    terms = []
    for level in ("process", "agent", "team"):
        if isinstance(parts.get(level), int | float):
            w = float(weights.get(level, 1.0))
            label = level if w == 1.0 else f"{level} × {w:g}"
            terms.append((label, w * parts[level]))
    if sample.get("team_term"):
        terms.append(("team, from others' steps", float(sample["team_term"])))
    reward = sample.get("reward")
    if not isinstance(reward, int | float):
        return terms
    rest = reward - sum(v for _, v in terms)
    if not terms:
        terms.append(("episode reward", float(reward)))
    elif abs(rest) > 1e-6:
        group = sample.get("group") or []
        whole = isinstance(group, list) and len(group) == 2  # (task, agent): a return
        terms.append(("rest of the episode" if whole else "team, from others' steps", rest))
    return terms
