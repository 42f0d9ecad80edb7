"""Hugging Face dataset rows as our task records: one converter per dataset of `HF_DATASETS`
(loaders.py), `(row, index) -> task`, None for a row to skip."""

from __future__ import annotations

import base64
import io
import json
import pickle
import zlib
from typing import Any

from masenvs.tasks.records import CodeTask, MathTask, TestCase


def _text(value: Any) -> str:
    """Test text as one string: APPS stores some inputs and outputs as lists of lines."""
    if isinstance(value, list):
        return "\n".join(str(v) for v in value)
    return "" if value is None else str(value)


def _strip_dollars(answer: str) -> str:
    answer = answer.strip()
    while answer.startswith("$") and answer.endswith("$") and len(answer) >= 2:
        answer = answer[1:-1].strip()
    return answer


def math500(row: dict, index: int) -> MathTask:
    return MathTask(
        id=str(row.get("unique_id") or f"math500/{index}"),
        question=row["problem"],
        answer=str(row["answer"]),
        source="math500",
        solution=row.get("solution") or "",
        meta={"subject": row.get("subject"), "level": row.get("level")},
    )


def aime2024(row: dict, index: int) -> MathTask:
    return MathTask(
        id=f"aime2024/{row.get('ID') or index}",
        question=row["Problem"],
        answer=str(row["Answer"]).strip(),
        source="aime2024",
        solution=row.get("Solution") or "",
    )


def aime2025(row: dict, index: int) -> MathTask:
    return MathTask(
        id=f"aime2025/{row.get('id', index)}",
        question=row["problem"],
        answer=str(row["answer"]).strip(),
        source="aime2025",
        solution=row.get("solution") or "",
    )


def olympiadbench(row: dict, index: int) -> MathTask | None:
    answers = row.get("final_answer") or []
    if isinstance(answers, str):
        answers = [answers]
    if not answers:
        return None
    question = row["question"]
    if row.get("context"):
        question = f"{row['context']}\n\n{question}"
    return MathTask(
        id=f"olympiadbench/{row.get('id', index)}",
        question=question,
        answer=", ".join(_strip_dollars(str(a)) for a in answers),
        source="olympiadbench",
        solution="\n".join(row.get("solution") or []),
        meta={"unit": row.get("unit"), "answer_type": row.get("answer_type")},
    )


def gsm8k(row: dict, index: int) -> MathTask | None:
    solution, marker, answer = row["answer"].rpartition("####")
    if not marker:
        return None
    return MathTask(
        id=f"gsm8k/{index}",
        question=row["question"],
        answer=answer.strip().replace(",", ""),
        source="gsm8k",
        solution=solution.strip(),
    )


_DAPO_HEAD = "Solve the following math problem step by step."
_DAPO_TAIL = '\n\nRemember to put your answer on its own line after "Answer:"'


def dapo17k(row: dict, index: int) -> MathTask:
    prompt = row["prompt"]
    text = prompt[0]["content"] if isinstance(prompt, list) else str(prompt)
    text = text.strip()
    if text.startswith(_DAPO_HEAD) and "\n\n" in text:  # drop DAPO's answer-format template
        text = text.split("\n\n", 1)[1]
    text = text.split(_DAPO_TAIL, 1)[0].strip()
    extra = row.get("extra_info") or {}
    return MathTask(
        id=f"dapo17k/{extra.get('index', index)}",
        question=text,
        answer=str(row["reward_model"]["ground_truth"]).strip(),
        source="dapo17k",
    )


def apps(row: dict, index: int) -> CodeTask | None:
    try:
        io_spec = json.loads(row["input_output"]) if row.get("input_output") else {}
    except ValueError:
        return None
    inputs, outputs = io_spec.get("inputs") or [], io_spec.get("outputs") or []
    if not inputs or len(inputs) != len(outputs):
        return None
    fn_name = io_spec.get("fn_name")
    if fn_name:
        tests = tuple(TestCase(list(i), o) for i, o in zip(inputs, outputs))
    else:
        tests = tuple(TestCase(_text(i), _text(o)) for i, o in zip(inputs, outputs))
    try:
        solutions = json.loads(row["solutions"]) if row.get("solutions") else []
    except ValueError:
        solutions = []
    return CodeTask(
        id=f"apps/{row.get('problem_id', index)}",
        prompt=row["question"],
        tests=tests,
        fn_name=fn_name,
        starter_code=row.get("starter_code") or "",
        reference_solution=solutions[0] if solutions else None,
        source="apps",
        meta={"difficulty": row.get("difficulty"), "url": row.get("url")},
    )


_PYTHON3 = (3, "PYTHON3")  # CodeContests' language label, as an int or its name


def code_contests(row: dict, index: int) -> CodeTask | None:
    def pairs(tests: dict | None) -> tuple[TestCase, ...]:
        tests = tests or {}
        return tuple(
            TestCase(i, o) for i, o in zip(tests.get("input", []), tests.get("output", []))
        )

    public, private = pairs(row.get("public_tests")), pairs(row.get("private_tests"))
    hidden = private or pairs(row.get("generated_tests")) or public
    if not hidden:
        return None
    solutions = row.get("solutions") or {}
    reference = next(
        (
            code
            for lang, code in zip(solutions.get("language", []), solutions.get("solution", []))
            if lang in _PYTHON3
        ),
        None,
    )
    return CodeTask(
        id=f"code_contests/{row.get('name') or index}",
        prompt=row["description"],
        tests=hidden,
        public_tests=public,
        reference_solution=reference,
        source="code_contests",
        meta={"difficulty": row.get("difficulty"), "cf_rating": row.get("cf_rating")},
    )


class _StringsOnly(pickle.Unpickler):
    """LiveCodeBench pickles a JSON string; refuse anything that would import code."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refusing to unpickle {module}.{name}")


def decode_lcb_tests(field: str) -> list[dict]:
    """LiveCodeBench test cases: plain JSON, or base64(zlib(pickle(JSON string)))."""
    try:
        return json.loads(field)
    except ValueError:
        raw = zlib.decompress(base64.b64decode(field.encode("utf-8")))
        return json.loads(_StringsOnly(io.BytesIO(raw)).load())


def livecodebench(row: dict, index: int) -> CodeTask | None:
    public = json.loads(row.get("public_test_cases") or "[]")
    private = decode_lcb_tests(row["private_test_cases"]) if row.get("private_test_cases") else []
    metadata = json.loads(row.get("metadata") or "{}")
    functional = any(t.get("testtype") == "functional" for t in public + private)
    fn_name = metadata.get("func_name") if functional else None

    def case(t: dict) -> TestCase:
        if fn_name:  # one JSON value per line, one line per argument
            return TestCase(
                [json.loads(line) for line in t["input"].split("\n")], json.loads(t["output"])
            )
        return TestCase(t["input"], t["output"])

    hidden = tuple(case(t) for t in public + private)  # LiveCodeBench grades on both
    if not hidden:
        return None
    return CodeTask(
        id=f"livecodebench/{row.get('question_id', index)}",
        prompt=row["question_content"],
        tests=hidden,
        public_tests=tuple(case(t) for t in public),
        fn_name=fn_name,
        starter_code=row.get("starter_code") or "",
        source="livecodebench",
        meta={
            "platform": row.get("platform"),
            "difficulty": row.get("difficulty"),
            "contest_date": str(row.get("contest_date", "")),
        },
    )
