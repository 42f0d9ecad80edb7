"""Task records, sources (generator, our problems, JSONL, Hugging Face) and judges."""

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
from masenvs.tasks.records import CodeTask, MathTask, TaskSourceError, TestCase

__all__ = [
    "HF_DATASETS",
    "CodeTask",
    "GeneratedMath",
    "MathTask",
    "TaskList",
    "TaskSource",
    "TaskSourceError",
    "TestCase",
    "load_hf",
    "open_source",
    "read_jsonl",
    "task_from_dict",
    "write_jsonl",
]
