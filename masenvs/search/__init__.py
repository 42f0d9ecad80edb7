"""Search for the web_search env: backends, the /retrieve server, offline data, answer scores."""

from masenvs.search.backends import (
    BM25Backend,
    Hit,
    HttpBackend,
    PlainBM25,
    SearchBackend,
    SearchError,
    load_backend,
    tokenize,
)
from masenvs.search.data import (
    Doc,
    Encyclopedia,
    SearchTask,
    generate_encyclopedia,
    generate_tasks,
    load_corpus_jsonl,
    load_qa_jsonl,
    write_corpus_jsonl,
)
from masenvs.search.metrics import contains_answer, exact_match, f1_score, normalize_answer

__all__ = [
    "BM25Backend",
    "Doc",
    "Encyclopedia",
    "Hit",
    "HttpBackend",
    "PlainBM25",
    "SearchBackend",
    "SearchError",
    "SearchTask",
    "contains_answer",
    "exact_match",
    "f1_score",
    "generate_encyclopedia",
    "generate_tasks",
    "load_backend",
    "load_corpus_jsonl",
    "load_qa_jsonl",
    "normalize_answer",
    "tokenize",
    "write_corpus_jsonl",
]
