"""Task records shared by every source: `MathTask`, `CodeTask` and their `TestCase`s.

Records are frozen: envs share one task object across resets and snapshots. `to_dict` /
`from_dict` give the JSONL format documented in docs/math-code.md.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any


class TaskSourceError(Exception):
    """A task source cannot be read; the message says which one and how to provide it."""


def stable_id(prefix: str, text: str) -> str:
    """An id derived from content, the same in every process (unlike `hash`)."""
    return f"{prefix}-{hashlib.sha1(text.encode('utf-8', 'replace')).hexdigest()[:12]}"


def _frozen_meta(meta: Any) -> dict[str, Any]:
    if meta is None:
        return {}
    if not isinstance(meta, dict):
        raise ValueError(f"task meta must be a JSON object, got {type(meta).__name__}")
    return dict(meta)


@dataclass(frozen=True)
class MathTask:
    """A question with one exact final answer (LaTeX or plain text, checked by math-verify)."""

    id: str
    question: str
    answer: str
    source: str = "custom"
    solution: str = ""  # a worked solution when the dataset has one; never shown to agents
    meta: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "question": self.question,
            "answer": self.answer,
            "source": self.source,
            "solution": self.solution,
            "meta": self.meta,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MathTask:
        if not isinstance(data, dict):
            raise ValueError(f"a math task must be a JSON object, got {type(data).__name__}")
        missing = [k for k in ("question", "answer") if not str(data.get(k, "")).strip()]
        if missing:
            raise ValueError(f"math task {data.get('id', '?')!r} has no {' or '.join(missing)}")
        return cls(
            id=str(data.get("id") or stable_id("math", str(data["question"]))),
            question=str(data["question"]),
            answer=str(data["answer"]).strip(),
            source=str(data.get("source") or "custom"),
            solution=str(data.get("solution") or ""),
            meta=_frozen_meta(data.get("meta")),
        )


@dataclass(frozen=True)
class TestCase:
    """One test: stdin text and expected stdout, or (call-based) arguments and return value."""

    __test__ = False  # not a pytest class, despite the name

    input: Any  # str for stdin problems; a list of positional arguments for call-based ones
    output: Any  # expected stdout text, or the expected return value (any JSON value)

    def to_dict(self) -> dict[str, Any]:
        return {"input": self.input, "output": self.output}

    @classmethod
    def from_dict(cls, data: Any, call_based: bool) -> TestCase:
        if not isinstance(data, dict) or "input" not in data or "output" not in data:
            raise ValueError('a test case must be an object with "input" and "output"')
        if call_based:
            if not isinstance(data["input"], list):
                raise ValueError("a call-based test input must be a list of arguments")
            # Round-trip through JSON so tuples and other types compare as the sandbox sees them.
            return cls(
                json.loads(json.dumps(data["input"])), json.loads(json.dumps(data["output"]))
            )
        return cls(str(data["input"]), str(data["output"]))


@dataclass(frozen=True)
class CodeTask:
    """A programming problem judged by hidden tests.

    `fn_name` set means call-based: the program defines that function (or a `Solution` class
    with that method) and each test calls it. Otherwise the program reads stdin and prints.
    """

    id: str
    prompt: str
    tests: tuple[TestCase, ...]  # hidden: they decide the reward and success
    public_tests: tuple[TestCase, ...] = ()  # examples the agents may see
    fn_name: str | None = None
    starter_code: str = ""
    reference_solution: str | None = None  # a known-correct program, used to check tester tests
    source: str = "custom"
    meta: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)

    @property
    def call_based(self) -> bool:
        return self.fn_name is not None

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "prompt": self.prompt,
            "tests": [t.to_dict() for t in self.tests],
            "public_tests": [t.to_dict() for t in self.public_tests],
            "fn_name": self.fn_name,
            "starter_code": self.starter_code,
            "reference_solution": self.reference_solution,
            "source": self.source,
            "meta": self.meta,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CodeTask:
        if not isinstance(data, dict):
            raise ValueError(f"a code task must be a JSON object, got {type(data).__name__}")
        if not str(data.get("prompt", "")).strip():
            raise ValueError(f"code task {data.get('id', '?')!r} has no prompt")
        fn_name = data.get("fn_name") or None
        call_based = fn_name is not None
        tests = tuple(TestCase.from_dict(t, call_based) for t in data.get("tests") or ())
        if not tests:
            raise ValueError(f"code task {data.get('id', '?')!r} has no hidden tests")
        public = tuple(TestCase.from_dict(t, call_based) for t in data.get("public_tests") or ())
        return cls(
            id=str(data.get("id") or stable_id("code", str(data["prompt"]))),
            prompt=str(data["prompt"]),
            tests=tests,
            public_tests=public,
            fn_name=str(fn_name) if fn_name else None,
            starter_code=str(data.get("starter_code") or ""),
            reference_solution=data.get("reference_solution") or None,
            source=str(data.get("source") or "custom"),
            meta=_frozen_meta(data.get("meta")),
        )
