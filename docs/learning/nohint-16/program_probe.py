"""Can the base SmolLM2-135M fill a program template with the task's coordinates?

A probe for issue 33 (docs/learning.md, "Hint-free: six more recipes"): the tool agent is
asked for a Python program, shown a generic one that computes the straight moves from four
numbers (A's and G's row and column) on other coordinates. Nothing task-specific is in the
prompt but the grid and the coordinates; a policy that copies the program and puts in this
task's numbers reads the task. Each answer's program runs in the sandbox, its `Moves:` line
is walked on its own task and on the 31 others (`stop_at_goal: false`), as
scripts/plan_path_replay.py does for training runs.

    python docs/learning/nohint-16/program_probe.py > docs/learning/nohint-16/program-probe.txt
"""

from __future__ import annotations

import asyncio

import numpy as np

from masenvs.engine.engine import EmbeddedBackend
from masenvs.engine.protocol import GenerateRequest, SamplingParams
from masenvs.envs import plan_path as pp
from masenvs.envs.tooling import run_tool
from masenvs.parsing import parse_moves
from masenvs.registry import make

OPTIONS = {"size": 4, "obstacle_ratio": 0.1, "stop_at_goal": False, "max_rounds": 1}
CFG = pp.PlanPathConfig(**OPTIONS)
SEEDS = range(1_000_000, 1_000_032)  # the validation tasks of the hint-free runs
PROGRAM = (
    "```python\n"
    "ar, ac = 3, 0  # A (row, column)\n"
    "gr, gc = 1, 2  # G (row, column)\n"
    "moves = ['U'] * (ar - gr) + ['D'] * (gr - ar) + ['L'] * (ac - gc) + ['R'] * (gc - ac)\n"
    "print('Moves:', moves)\n"
    "```"
)
RULES = pp.PROPOSE_SYSTEM[pp.PROPOSE_SYSTEM.index("The grid uses") :]  # the env's own rules
SYSTEM = (
    "You are the tool agent of a path-planning team. Write a short Python program that prints "
    "the moves from A to G as `Moves: [...]`, in one ```python block. " + RULES
)
VARIANTS = {
    # the program as an example in the system prompt, the usual request last
    "example in the system prompt": (
        SYSTEM + "\n\nExample, for A at (row 3, column 0) and G at (row 1, column 2):\n" + PROGRAM,
        "Answer with a ```python block that prints `Moves: [...]`.",
    ),
    # the program last, to be copied with the numbers replaced
    "template at the end": (
        SYSTEM,
        "Answer with this program, the numbers replaced by A's and G's rows and columns:\n"
        + PROGRAM,
    ),
}


def prompts() -> tuple[list[pp.PlanPathTask], list[str]]:
    """The tasks and the env's own user prompt for the tool agent (grid, coordinates, round),
    without its last line (the answer format, which each variant replaces)."""
    env = make("plan_path", tool_task="search", **OPTIONS)
    tasks, users = [], []
    for seed in SEEDS:
        env.reset(seed=seed)
        tasks.append(env.task)
        users.append(env.prompt("tool")[-1]["content"].rsplit("\n", 1)[0])
    return tasks, users


TASKS, USERS = prompts()


def messages(user: str, system: str, ask: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user + "\n" + ask}]


def reaches(task: pp.PlanPathTask, moves: list[str]) -> bool:
    return pp.score_moves(task, task.start, moves, CFG).reached


async def probe(engine: EmbeddedBackend, system: str, ask: str, temperature: float, n: int):
    params = SamplingParams(max_tokens=96, temperature=temperature, n=n)
    gens = await asyncio.gather(
        *(
            engine.generate(
                GenerateRequest(model="", params=params, messages=messages(user, system, ask))
            )
            for user in USERS
        )
    )
    own = other = unparsable = total = 0
    for i, gen in enumerate(gens):
        for choice in gen.completions:
            total += 1
            run = run_tool(choice.text, 5.0)
            moves = parse_moves(run.output, marker="Moves:") if run.ok else None
            if moves is None:
                unparsable += 1
                continue
            own += reaches(TASKS[i], moves)
            other += np.mean([reaches(t, moves) for j, t in enumerate(TASKS) if j != i])
    print(
        f"  T={temperature} x{n}: {total} answers, reach G on their own task {own / total:.1%}, "
        f"on the other tasks {other / total:.1%}, no `Moves:` printed {unparsable / total:.1%}"
    )
    print(f"  first answer: {gens[0].completions[0].text[:240]!r}")


async def main() -> None:
    engine = EmbeddedBackend.from_spec("smollm2-135m", max_batch_size=32, batch_invariant="auto")
    try:
        for name, (system, ask) in VARIANTS.items():
            print(name)
            await probe(engine, system, ask, 0.0, 1)
            await probe(engine, system, ask, 0.7, 8)
    finally:
        engine.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
