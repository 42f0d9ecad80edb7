"""Write examples/sft/auto_mas_math.jsonl: a small cold-start set for `masenvs sft`.

Made here, from problems written for it: for each problem, one designer conversation (the
auto_mas env's own designer prompt, answered with a design) and one executor conversation
(a ToolAgent's turns: Python code, its real output from the sandbox, the boxed answer).

    python examples/sft/make_auto_mas_traces.py
    masenvs sft examples/auto_mas.yaml examples/sft/auto_mas_math.jsonl
"""

from __future__ import annotations

import json
from pathlib import Path

import masenvs
from masenvs.mas.tools import run_python

# (question, program printing the answer); the answer is what the program prints.
PROBLEMS = [
    ("What is the greatest common divisor of 84 and 120?", "import math\nprint(math.gcd(84, 120))"),
    ("What is the least common multiple of 18 and 24?", "import math\nprint(math.lcm(18, 24))"),
    ("What is 37 * 43?", "print(37 * 43)"),
    ("What is the sum of the integers from 1 to 150?", "print(sum(range(1, 151)))"),
    (
        "How many primes are less than 100?",
        "print(sum(all(n % d for d in range(2, int(n**0.5) + 1)) for n in range(2, 100)))",
    ),
    ("What is the remainder when 7^100 is divided by 13?", "print(pow(7, 100, 13))"),
    ("In how many ways can 3 people be chosen from 10?", "import math\nprint(math.comb(10, 3))"),
    ("What is the sum of the digits of 2^50?", "print(sum(int(d) for d in str(2**50)))"),
    (
        "Compute 3/8 + 5/12 as a reduced fraction.",
        "from fractions import Fraction\nf = Fraction(3, 8) + Fraction(5, 12)\n"
        "print(f'\\\\frac{{{f.numerator}}}{{{f.denominator}}}')",
    ),
    (
        "How many positive divisors does 360 have?",
        "print(sum(1 for d in range(1, 361) if 360 % d == 0))",
    ),
    (
        "What is 12 factorial divided by 10 factorial?",
        "import math\nprint(math.factorial(12) // math.factorial(10))",
    ),
    (
        "How many shortest grid paths go from (0,0) to (4,3) moving right or up?",
        "import math\nprint(math.comb(7, 3))",
    ),
    (
        "What is the 15th Fibonacci number, with F(1) = F(2) = 1?",
        "a, b = 1, 1\nfor _ in range(13):\n    a, b = b, a + b\nprint(b)",
    ),
    (
        "What is the sum of the squares of the first 20 positive integers?",
        "print(sum(k * k for k in range(1, 21)))",
    ),
    (
        "What is the smallest positive integer divisible by 2, 3, 4, 5 and 7?",
        "import math\nfrom functools import reduce\nprint(reduce(math.lcm, [2, 3, 4, 5, 7]))",
    ),
    ("What is 2^20 - 1000000?", "print(2**20 - 1000000)"),
]

SOLVER = "Solve the problem. Use Python to compute. End with \\boxed{answer}."
DESIGNS = [
    'system = ToolAgent("solver", "{s}", max_turns=3)',
    'system = Ensemble(ToolAgent("a", "{s}"), ToolAgent("b", "{s}"), judge=Agent("judge", '
    '"Pick the right answer; end with \\\\boxed{{}}."))',
    'system = Reflect(ToolAgent("solver", "{s}"), Agent("checker", "Reply APPROVE if it is right."))',
]


def designer(env, question: str, k: int) -> dict:
    env.reset(options={"task": {"id": f"sft-{k}", "question": question, "answer": "0"}})
    prompt = env.prompt("designer")
    code = DESIGNS[k % len(DESIGNS)].format(s=SOLVER.replace("\\", "\\\\"))
    reply = (
        "A computation problem: an agent that checks its arithmetic with Python is reliable.\n"
        f"<code>\n{code}\n</code>"
    )
    return {"agent": "designer", "messages": [*prompt, {"role": "assistant", "content": reply}]}


def executor(question: str, program: str) -> dict:
    result = run_python(program)
    assert result.verdict == "ok", result
    answer = result.stdout.strip()
    return {
        "agent": "executor",
        "messages": [
            {"role": "system", "content": SOLVER},
            {"role": "user", "content": question},
            {"role": "assistant", "content": f"I will compute it.\n```python\n{program}\n```"},
            {"role": "user", "content": result.observation()},
            {"role": "assistant", "content": f"The program printed {answer}.\n\\boxed{{{answer}}}"},
        ],
    }


def main() -> None:
    env = masenvs.make("auto_mas", max_rounds=1)
    out = Path(__file__).with_name("auto_mas_math.jsonl")
    rows = []
    for k, (question, program) in enumerate(PROBLEMS):
        rows += [designer(env, question, k), executor(question, program)]
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} conversations to {out}")


if __name__ == "__main__":
    main()
