"""The same benchmarks on two trees of masenvs, alternated in one run: does a change move them?

    python bench/before_after.py --before e046d2d            # HEAD vs a git ref
    python bench/before_after.py --before e046d2d --rounds 5 --batches 1 8

Written for the structure step (issue 28), which must leave speed where it was. Each tree is
exported with `git archive` into a temporary folder and imported from there: a
`sitecustomize.py` on PYTHONPATH maps `masenvs`, `masenvs.adapters` and `masenvs.trainer` to
that tree's folders, so spawned workers import the same tree as their parent. Each round runs,
for the before tree and then the after tree:

- `bench/engine.py --modes auto` (the engine's default, as training rollouts run it), one
  repeat per round, at each `--batches` size: aggregate tokens/s and tokens per CPU-second;
- `bench/trainer.py`'s masenvs worker on its uniform batch: seconds per learner step and
  the first-step gradient norm, which must be equal (the same weights, the same batch).

Medians over the rounds, and after/before ratios, are printed at the end with `lscpu`'s model
name. Alternating the trees spreads any load from elsewhere over both alike.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

SITE = """import importlib.util, sys
ROOT = {root!r}
MAP = {{"masenvs": ROOT + "/masenvs", "masenvs.adapters": ROOT + "/adapters",
        "masenvs.trainer": ROOT + "/trainer"}}
class _TreeFinder:
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name in MAP:
            return importlib.util.spec_from_file_location(
                name, MAP[name] + "/__init__.py", submodule_search_locations=[MAP[name]])
        return None
sys.meta_path.insert(0, _TreeFinder)
"""


def export(ref: str, into: Path) -> Path:
    """`git archive` of `ref` unpacked into `into`, with a sitecustomize that imports it."""
    tree = into / "tree"
    tree.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", ref], cwd=REPO, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    site = into / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITE.format(root=str(tree)))
    return into


def run_in(tree: Path, args: list[str]) -> subprocess.CompletedProcess[str]:
    """Run `python args...` from `tree` with that tree's masenvs on the import path."""
    env = os.environ | {"PYTHONPATH": str(tree / "site")}
    proc = subprocess.run(
        [sys.executable, *args], cwd=tree / "tree", env=env, capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed in {tree}:\n{proc.stderr[-3000:]}")
    return proc


def which_tree(tree: Path) -> str:
    """Where `masenvs.trainer` is imported from under this tree's PYTHONPATH (a check)."""
    code = "import masenvs.trainer, sys; print(masenvs.trainer.__file__)"
    return run_in(tree, ["-c", code]).stdout.strip()


def engine_rates(tree: Path, batches: list[int], max_tokens: int) -> dict[int, tuple[float, float]]:
    """{batch: (tokens/s, tokens per CPU-s)} of one repeat of bench/engine.py --modes auto."""
    command = ["bench/engine.py", "--modes", "auto", "--repeats", "1"]
    command += ["--max-tokens", str(max_tokens), "--batches", *map(str, batches)]
    rates: dict[int, tuple[float, float]] = {}
    for line in run_in(tree, command).stdout.splitlines():
        cells = [c.strip() for c in line.split(" | ")]
        if len(cells) == 5 and cells[1].isdigit():
            rates[int(cells[1])] = (float(cells[2]), float(cells[4]))
    if set(rates) != set(batches):
        raise SystemExit(f"bench/engine.py in {tree} printed no rate for some batch sizes")
    return rates


def learner_step(tree: Path, work: Path) -> dict[str, float]:
    """One masenvs worker of bench/trainer.py (uniform batch): step seconds and grad norm."""
    out, adapter = work / "out.json", work / "adapter"
    command = ["bench/trainer.py", "--worker", "masenvs", "--kind", "uniform"]
    command += ["--adapter", str(adapter), "--out", str(out)]
    run_in(tree, command)
    result = json.loads(out.read_text())
    return {
        "step_s": statistics.median(result["times"]),
        "cpu_s": statistics.median(result["cpu"]),
        "grad_norm": result["grad_norm"],
    }


def cpu_model() -> str:
    for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="git ref of the tree to compare with")
    parser.add_argument("--after", default="HEAD", help="git ref (default HEAD)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--no-trainer", action="store_true", help="the engine only")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench-before-after-") as tmp:
        trees = {name: export(ref, Path(tmp) / name) for name, ref in
                 (("before", args.before), ("after", args.after))}  # fmt: skip
        for name, tree in trees.items():
            print(f"{name}: {getattr(args, name)} -> masenvs.trainer from {which_tree(tree)}")
        engine: dict[str, list[dict[int, tuple[float, float]]]] = {n: [] for n in trees}
        learner: dict[str, list[dict[str, float]]] = {n: [] for n in trees}
        for round_ in range(args.rounds):
            for name, tree in trees.items():
                rates = engine_rates(tree, args.batches, args.max_tokens)
                engine[name].append(rates)
                line = ", ".join(f"batch {b}: {r[0]:.1f} tok/s" for b, r in rates.items())
                if not args.no_trainer:
                    work = Path(tmp) / f"{name}-{round_}"
                    work.mkdir()
                    learner[name].append(learner_step(tree, work))
                    step = learner[name][-1]
                    line += (
                        f"; learner step {step['step_s']:.2f} s, grad norm {step['grad_norm']:.6g}"
                    )
                print(f"round {round_ + 1} {name}: {line}", flush=True)

    print(f"\n{cpu_model()}, {os.cpu_count()} CPUs; medians of {args.rounds} alternated rounds")
    print(f"{'figure':34}{'before':>12}{'after':>12}{'after/before':>14}")

    def row(label: str, before: list[float], after: list[float]) -> None:
        b, a = statistics.median(before), statistics.median(after)
        print(f"{label:34}{b:12.2f}{a:12.2f}{a / b:13.3f}x")

    for batch in args.batches:
        for i, unit in enumerate(("tokens/s", "tokens per CPU-s")):
            values = {n: [r[batch][i] for r in engine[n]] for n in trees}
            row(f"engine batch {batch} {unit}", values["before"], values["after"])
    if not args.no_trainer:
        for key in ("step_s", "cpu_s"):
            values = {n: [r[key] for r in learner[n]] for n in trees}
            row(f"learner uniform step {key}", values["before"], values["after"])
        norms = {n: {r["grad_norm"] for r in learner[n]} for n in trees}
        same = norms["before"] == norms["after"] and len(norms["before"]) == 1
        print(f"first-step grad norms: before {sorted(norms['before'])}, after "
              f"{sorted(norms['after'])}: {'equal' if same else 'DIFFERENT'}")  # fmt: skip


if __name__ == "__main__":
    main()
