"""Offline data for web_search: a seeded synthetic encyclopedia with multi-hop questions, and
loaders for FlashRAG QA datasets and Wikipedia-style corpora in local JSONL files."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Doc:
    """One corpus document; `contents` is FlashRAG's '"Title"\\ntext' form."""

    id: str
    contents: str

    @property
    def title(self) -> str:
        return self.contents.split("\n", 1)[0].strip('"')

    def to_dict(self) -> dict[str, str]:
        return {"id": self.id, "contents": self.contents}


@dataclass(frozen=True)
class SearchTask:
    """A question, its golden answers and (for generated ones) the chain that answers it."""

    id: str
    question: str
    answers: tuple[str, ...]
    hops: int = 0  # 0: unknown (loaded datasets)
    # (entity, relation, next entity) per hop, entity names as in the documents.
    chain: tuple[tuple[str, str, str], ...] = ()
    source: str = "synthetic"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SearchTask:
        answers = data.get("answers", data.get("golden_answers"))
        if not answers or "question" not in data:
            raise ValueError(
                "a web_search task needs 'question' and 'golden_answers' (or 'answers'), "
                f"got keys {sorted(data)}"
            )
        answers = [answers] if isinstance(answers, str) else answers
        return cls(
            id=str(data.get("id", "")),
            question=str(data["question"]),
            answers=tuple(str(a) for a in answers),
            hops=int(data.get("hops", 0)),
            chain=tuple(tuple(h) for h in data.get("chain", ())),
            source=str(data.get("source", "task")),
        )


# --- the synthetic encyclopedia -----------------------------------------------------------

_ONSETS = [
    "b",
    "c",
    "d",
    "f",
    "g",
    "h",
    "j",
    "k",
    "l",
    "m",
    "n",
    "p",
    "r",
    "s",
    "t",
    "v",
    "z",
    "br",
    "dr",
    "gr",
    "kr",
    "pl",
    "st",
    "tr",
    "th",
    "sh",
]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ei", "ou", "ia"]
_CODAS = ["", "", "", "n", "r", "s", "l", "th", "x", "nd"]

# type -> its functional relations: (relation, target type, sentence, noun phrase).
# The sentence states the fact in the subject's document; the phrase wraps a description of
# the subject into a description of the object, so questions compose to any depth.
RELATIONS: dict[str, list[tuple[str, str, str, str]]] = {
    "person": [
        ("born_in", "city", "{s} was born in the city of {o}.", "the city where {x} was born"),
        ("works_for", "company", "{s} works for the company {o}.", "the company {x} works for"),
        ("mentor", "person", "The mentor of {s} is {o}.", "the mentor of {x}"),
    ],
    "city": [
        ("located_in", "country", "{s} is a city in the country of {o}.", "the country {x} is in"),
    ],
    "country": [
        ("capital", "city", "The capital of {s} is {o}.", "the capital of {x}"),
    ],
    "company": [
        ("founded_by", "person", "{s} was founded by {o}.", "the founder of {x}"),
        (
            "headquartered_in",
            "city",
            "{s} is headquartered in {o}.",
            "the city where {x} is headquartered",
        ),
    ],
}
_SHARE = {"person": 0.5, "city": 0.2, "country": 0.1, "company": 0.2}
_FILLER = {
    "person": "{s} is a person known in the records of this encyclopedia.",
    "city": "{s} is a city with a long history of trade.",
    "country": "{s} is a country with its own government and flag.",
    "company": "{s} is a company that makes goods sold in many markets.",
}


def _name(rng: np.random.Generator, syllables: int) -> str:
    parts = [
        str(rng.choice(_ONSETS)) + str(rng.choice(_VOWELS)) + str(rng.choice(_CODAS))
        for _ in range(syllables)
    ]
    return "".join(parts).capitalize()


@dataclass
class Encyclopedia:
    """Entities with functional relations and one document per entity (all seeded)."""

    names: list[str]
    types: list[str]
    facts: list[dict[str, int]]  # per entity: relation -> object entity index
    docs: list[Doc] = field(default_factory=list)

    def question(self, rng: np.random.Generator, hops: int, index: int = 0) -> SearchTask:
        """A `hops`-hop question: a walk of distinct entities along relations."""
        for _ in range(1000):
            start = int(rng.integers(len(self.names)))
            path, chain, phrase = [start], [], self.names[start]
            for _ in range(hops):
                here = path[-1]
                options = [r for r in self.facts[here] if self.facts[here][r] not in path]
                if not options:
                    break
                relation = str(rng.choice(sorted(options)))
                nxt = self.facts[here][relation]
                template = next(rel[3] for rel in RELATIONS[self.types[here]] if rel[0] == relation)
                phrase = template.format(x=phrase)
                chain.append((self.names[here], relation, self.names[nxt]))
                path.append(nxt)
            if len(chain) == hops:
                return SearchTask(
                    id=f"synthetic-{index}",
                    question=f"What is {phrase}?",
                    answers=(self.names[path[-1]],),
                    hops=hops,
                    chain=tuple(chain),
                )
        raise RuntimeError(f"no {hops}-hop chain found: generate more entities")


def generate_encyclopedia(entities: int = 300, seed: int = 0) -> Encyclopedia:
    """A seeded encyclopedia: `entities` entities, their relations and one document each."""
    if entities < 20:
        raise ValueError(f"an encyclopedia needs at least 20 entities, got {entities}")
    rng = np.random.default_rng(seed)
    names: list[str] = []
    seen: set[str] = set()
    while len(names) < entities:
        first = _name(rng, int(rng.integers(2, 4)))
        name = first if rng.random() < 0.5 else f"{first} {_name(rng, 2)}"
        if name.lower() not in seen:
            seen.add(name.lower())
            names.append(name)
    counts = {t: max(2, int(entities * share)) for t, share in _SHARE.items()}
    counts["person"] = entities - sum(c for t, c in counts.items() if t != "person")
    types = [t for t, c in counts.items() for _ in range(c)]
    by_type: dict[str, list[int]] = {t: [] for t in counts}
    for i, t in enumerate(types):
        by_type[t].append(i)
    facts: list[dict[str, int]] = []
    for i, t in enumerate(types):
        own: dict[str, int] = {}
        for relation, target, _, _ in RELATIONS[t]:
            pool = by_type[target]
            j = int(pool[rng.integers(len(pool))])
            while j == i:  # nobody is their own mentor
                j = int(pool[rng.integers(len(pool))])
            own[relation] = j
        facts.append(own)
    # A country's capital is one of its own cities where it has one.
    cities_of: dict[int, list[int]] = {}
    for j in by_type["city"]:
        cities_of.setdefault(facts[j]["located_in"], []).append(j)
    for c in by_type["country"]:
        if c in cities_of:
            facts[c]["capital"] = int(rng.choice(cities_of[c]))
    book = Encyclopedia(names, types, facts)
    for i, t in enumerate(types):
        sentences = [_FILLER[t].format(s=names[i])]
        for relation, _, sentence, _ in RELATIONS[t]:
            sentences.append(sentence.format(s=names[i], o=names[facts[i][relation]]))
        book.docs.append(Doc(f"doc-{i}", f'"{names[i]}"\n' + " ".join(sentences)))
    return book


def generate_tasks(
    book: Encyclopedia, count: int, min_hops: int = 1, max_hops: int = 4, seed: int = 0
) -> list[SearchTask]:
    """`count` seeded questions with 1..4 hops, spread evenly over the hop counts."""
    rng = np.random.default_rng(seed)
    span = max_hops - min_hops + 1
    return [book.question(rng, min_hops + i % span, i) for i in range(count)]


# --- loaders ------------------------------------------------------------------------------


def _jsonl(path: str | Path) -> list[dict[str, Any]]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no JSONL file at {path}: pass the path of a local file")
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number} is not JSON ({exc.msg}): fix the line") from exc
    return rows


def load_qa_jsonl(path: str | Path, source: str | None = None) -> list[SearchTask]:
    """A FlashRAG QA file (NQ, HotpotQA, 2WikiMultihopQA, MuSiQue, Bamboogle):
    one `{"id", "question", "golden_answers": [...]}` per line."""
    name = source or Path(path).stem
    tasks = []
    for row in _jsonl(path):
        task = SearchTask.from_dict({**row, "source": name})
        tasks.append(task)
    if not tasks:
        raise ValueError(f"{path} holds no questions")
    return tasks


def load_corpus_jsonl(path: str | Path) -> list[Doc]:
    """A Wikipedia-style corpus: `{"id", "contents"}` or `{"id", "title", "text"}` per line."""
    docs = []
    for number, row in enumerate(_jsonl(path), 1):
        if "contents" in row:
            contents = str(row["contents"])
        elif "text" in row:
            contents = f'"{row.get("title", "")}"\n{row["text"]}'
        else:
            raise ValueError(
                f"{path}:{number} has neither 'contents' nor 'text': "
                'write {"id", "contents"} or {"id", "title", "text"} per line'
            )
        docs.append(Doc(str(row.get("id", number - 1)), contents))
    if not docs:
        raise ValueError(f"{path} holds no documents")
    return docs


def write_corpus_jsonl(docs: list[Doc], path: str | Path) -> Path:
    path = Path(path)
    path.write_text("".join(json.dumps(d.to_dict()) + "\n" for d in docs), encoding="utf-8")
    return path
