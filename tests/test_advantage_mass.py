"""scripts/advantage_mass.py sorts a run's groups by what set their candidates apart."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parent.parent / "scripts" / "advantage_mass.py"


def _sample(group: str, reward: float, parts: dict, advantage: float) -> dict:
    return {
        "step": 1,
        "group": [group, 0, "tool"],
        "reward": reward,
        "reward_parts": parts,
        "advantage": advantage,
        "kept": True,
    }


def test_solved_format_and_shaping_groups_are_told_apart(tmp_path: Path) -> None:
    rows = [
        _sample("a", 1.5, {"process": 0.5, "agent": 1.0, "team": 0.0}, 1.0),
        _sample("a", 0.0, {"process": 0.0, "agent": 0.0, "team": 0.0}, -1.0),
        _sample("b", -0.3, {"process": 0.0, "agent": -0.3, "team": 0.0}, -1.0),
        _sample("b", 0.1, {"process": 0.1, "agent": 0.0, "team": 0.0}, 1.0),
        _sample("c", -0.02, {"process": -0.02, "agent": 0.0, "team": 0.0}, 1.0),
        _sample("c", -0.03, {"process": -0.03, "agent": 0.0, "team": 0.0}, -1.0),
        {**_sample("d", 0.0, {}, 0.0), "kept": False},  # dropped: not counted
    ]
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path)], capture_output=True, text=True, check=True
    ).stdout
    assert "1 | solved | 33% | 0.750" in out
    assert "1 | format | 33% | 0.200" in out
    assert "1 | shaping only | 33% | 0.005" in out
    missing = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path / "nope")], capture_output=True, text=True
    )
    assert missing.returncode != 0 and "no such file" in missing.stderr
