"""Procedural math problems with exact answers: no data needed, same seed, same problem.

Each topic has three difficulty levels. Answers are integers or reduced fractions written in
LaTeX (`\\frac{p}{q}`), the way a model is asked to write them in `\\boxed{}`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from fractions import Fraction

import numpy as np

from masenvs.tasks.records import MathTask, stable_id

Problem = tuple[str, Fraction | int]  # question, exact answer


def latex(value: Fraction | int) -> str:
    """An exact value as the answer string: `7`, `-3`, `\\frac{2}{3}`, `-\\frac{5}{4}`."""
    value = Fraction(value)
    if value.denominator == 1:
        return str(value.numerator)
    sign = "-" if value < 0 else ""
    return f"{sign}\\frac{{{abs(value.numerator)}}}{{{value.denominator}}}"


def _int(rng: np.random.Generator, low: int, high: int) -> int:
    """A uniform integer in [low, high]."""
    return int(rng.integers(low, high + 1))


def _nonzero(rng: np.random.Generator, low: int, high: int) -> int:
    while True:
        value = _int(rng, low, high)
        if value:
            return value


def _signed(value: int) -> str:
    return f"+ {value}" if value >= 0 else f"- {-value}"


# --- topics ---------------------------------------------------------------------------------


def arithmetic(rng: np.random.Generator, level: int) -> Problem:
    if level == 1:
        a, b, c = _int(rng, 2, 50), _int(rng, 2, 12), _int(rng, 2, 12)
        return f"Compute ${a} + {b} \\times {c}$.", a + b * c
    if level == 2:
        a, b, c, e = _int(rng, 10, 99), _int(rng, 2, 40), _int(rng, 2, 15), _int(rng, 2, 9)
        d = e * _int(rng, 2, 20)
        return f"Compute $({a} - {b}) \\times {c} + {d} \\div {e}$.", (a - b) * c + d // e
    a, b, c, d = _int(rng, 2, 9), _int(rng, 2, 4), _int(rng, 11, 99), _int(rng, 2, 30)
    return f"Compute ${a}^{{{b}}} - {c} \\times ({d} - {a * 2})$.", a**b - c * (d - a * 2)


def linear(rng: np.random.Generator, level: int) -> Problem:
    if level == 1:
        x, a = _int(rng, -20, 20), _nonzero(rng, 2, 12)
        b = _int(rng, -30, 30)
        return f"Solve for $x$: ${a}x {_signed(b)} = {a * x + b}$.", x
    if level == 2:
        a, c = _nonzero(rng, -9, 9), _nonzero(rng, -9, 9)
        while c == a:
            c = _nonzero(rng, -9, 9)
        b, d = _int(rng, -40, 40), _int(rng, -40, 40)
        # ax + b = cx + d  =>  x = (d - b) / (a - c), possibly a fraction
        return (
            f"Solve for $x$: ${a}x {_signed(b)} = {c}x {_signed(d)}$.",
            Fraction(d - b, a - c),
        )
    x, y = _int(rng, -12, 12), _int(rng, -12, 12)
    a, b, c, d = (_nonzero(rng, -7, 7) for _ in range(4))
    while a * d - b * c == 0:
        d = _nonzero(rng, -7, 7)
    return (
        f"Solve the system ${a}x {_signed(b)}y = {a * x + b * y}$ and "
        f"${c}x {_signed(d)}y = {c * x + d * y}$. What is $x + y$?",
        x + y,
    )


def fractions(rng: np.random.Generator, level: int) -> Problem:
    def frac() -> tuple[str, Fraction]:
        while True:
            n, d = _int(rng, 1, 12), _int(rng, 2, 12)
            if n % d:  # a proper-looking fraction, written as drawn (not reduced)
                return f"\\frac{{{n}}}{{{d}}}", Fraction(n, d)

    (p_text, p), (q_text, q) = frac(), frac()
    if level == 1:
        return f"Compute ${p_text} + {q_text}$ as a reduced fraction.", p + q
    if level == 2:
        return f"Compute ${p_text} \\div {q_text}$ as a reduced fraction.", p / q
    r_text, r = frac()
    return (
        f"Compute $\\left({p_text} - {q_text}\\right) \\times {r_text}$ as a reduced fraction.",
        (p - q) * r,
    )


def modular(rng: np.random.Generator, level: int) -> Problem:
    if level == 1:
        a, m = _int(rng, 100, 9999), _int(rng, 3, 13)
        return f"What is the remainder when ${a}$ is divided by ${m}$?", a % m
    if level == 2:
        a, b, m = _int(rng, 2, 20), _int(rng, 5, 40), _int(rng, 5, 23)
        return f"What is ${a}^{{{b}}} \\bmod {m}$?", pow(a, b, m)
    m = int(rng.choice([7, 11, 13, 17, 19, 23, 29, 31]))
    a = _int(rng, 2, m - 1)
    return (
        f"Find the integer $x$ with $0 \\le x < {m}$ such that ${a}x \\equiv 1 \\pmod{{{m}}}$.",
        pow(a, -1, m),
    )


def combinatorics(rng: np.random.Generator, level: int) -> Problem:
    if level == 1:
        n = _int(rng, 5, 15)
        k = _int(rng, 2, min(5, n - 1))
        return f"In how many ways can a committee of {k} be chosen from {n} people?", math.comb(
            n, k
        )
    if level == 2:
        rows, cols = _int(rng, 2, 7), _int(rng, 2, 7)
        return (
            f"How many shortest paths go from the bottom-left to the top-right corner of a "
            f"{cols} by {rows} grid, moving one unit right or up at each step?",
            math.comb(rows + cols, rows),
        )
    word = str(rng.choice(["BANANA", "LETTER", "COFFEE", "STATISTICS", "ALGEBRA", "BOOKKEEPER"]))
    count = math.factorial(len(word))
    for letter in set(word):
        count //= math.factorial(word.count(letter))
    return f"How many distinct arrangements of the letters of {word} are there?", count


def number_theory(rng: np.random.Generator, level: int) -> Problem:
    if level == 1:
        a, b = _int(rng, 2, 30) * _int(rng, 1, 12), _int(rng, 2, 30) * _int(rng, 1, 12)
        return f"What is the greatest common divisor of {a} and {b}?", math.gcd(a, b)
    if level == 2:
        a, b = _int(rng, 4, 60), _int(rng, 4, 60)
        return f"What is the least common multiple of {a} and {b}?", math.lcm(a, b)
    n = _int(rng, 30, 720)
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    return f"What is the sum of the positive divisors of {n}?", sum(divisors)


TOPICS: dict[str, Callable[[np.random.Generator, int], Problem]] = {
    "arithmetic": arithmetic,
    "linear": linear,
    "fractions": fractions,
    "modular": modular,
    "combinatorics": combinatorics,
    "number_theory": number_theory,
}


def generate_math_task(
    rng: np.random.Generator, level: int = 2, topics: tuple[str, ...] | None = None
) -> MathTask:
    """One problem drawn from `rng`: a topic (uniform over `topics`) at difficulty `level` (1-3)."""
    if level not in (1, 2, 3):
        raise ValueError(f"difficulty level must be 1, 2 or 3, got {level}")
    names = tuple(topics) if topics else tuple(TOPICS)
    unknown = [t for t in names if t not in TOPICS]
    if unknown:
        raise ValueError(f"unknown math topics {unknown}; known: {', '.join(TOPICS)}")
    topic = names[int(rng.integers(len(names)))]
    question, answer = TOPICS[topic](rng, level)
    answer_text = latex(answer)
    return MathTask(
        id=stable_id(f"gen-{topic}-{level}", question),
        question=question,
        answer=answer_text,
        source="generated",
        meta={"topic": topic, "level": level},
    )
