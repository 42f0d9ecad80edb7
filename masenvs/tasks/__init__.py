"""Task records, sources (generator, our problems, JSONL, Hugging Face) and judges."""

from masenvs.tasks.code_judge import CodeJudge, Suite, SuiteResult
from masenvs.tasks.loaders import (
    HF_DATASETS,
    GeneratedMath,
    TaskList,
    TaskSource,
    load_hf,
    open_source,
    read_jsonl,
    task_from_dict,
    write_jsonl,
)
from masenvs.tasks.math_judge import MathJudge, default_judge
from masenvs.tasks.records import CodeTask, MathTask, TaskSourceError, TestCase

__all__ = [
    "HF_DATASETS",
    "CodeJudge",
    "CodeTask",
    "GeneratedMath",
    "MathJudge",
    "MathTask",
    "Suite",
    "SuiteResult",
    "TaskList",
    "TaskSource",
    "TaskSourceError",
    "TestCase",
    "default_judge",
    "load_hf",
    "open_source",
    "read_jsonl",
    "task_from_dict",
    "write_jsonl",
]
