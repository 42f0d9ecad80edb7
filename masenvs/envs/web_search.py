"""Web search: answer a (multi-hop) question from a document collection.

Roles, in turn order: `searcher` issues queries (`search: <query>` lines, or `<search>q</search>`
or a `{"name": "search", "arguments": {"query": ...}}` tool call) and reports what the results
say about the planner's sub-questions; its results are shown to both roles at once. `planner`
splits the question into sub-questions (`sub: <question>` lines) for the searcher's next turn
and ends the episode with the team's answer, `#### <answer>`. Success: the answer's exact
match (SQuAD normalisation) with a golden answer; the planner's own reward is its F1, the
team's its exact match, and every query costs `search_cost` (process part). Single-agent
mode: `planner` alone, which may search too; its results show next round.
Backends: embedded BM25 (bm25s, default), a FlashRAG `/retrieve` URL, or any object with
`search(queries, k)` passed as `search_backend=` (or named "module:attr" in the config).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np
from pydantic import Field

from masenvs.env import EnvConfig, EpisodeState, MASEnv, Message, RewardParts
from masenvs.parsing import clip_text
from masenvs.search.backends import (
    BM25Backend,
    Hit,
    HttpBackend,
    SearchBackend,
    SearchError,
    load_backend,
)
from masenvs.search.data import (
    Encyclopedia,
    SearchTask,
    generate_encyclopedia,
    load_corpus_jsonl,
    load_qa_jsonl,
)
from masenvs.search.metrics import contains_answer, exact_match, f1_score


class WebSearchConfig(EnvConfig):
    source: str = Field(
        "synthetic",
        description='Questions: "synthetic" (the generated encyclopedia) or "jsonl:/path" '
        "(a FlashRAG QA file: NQ, HotpotQA, 2WikiMultihopQA, MuSiQue, Bamboogle).",
    )
    corpus: str | None = Field(
        None,
        description="Corpus JSONL for the bm25 backend with a jsonl: source "
        '({"id","contents"} or {"id","title","text"}); synthetic questions use their own.',
    )
    backend: str = Field(
        "bm25",
        description='"bm25" (embedded, bm25s), "http" (search_url) or "module:attr" '
        "(an object or factory with search(queries, k)).",
    )
    search_url: str | None = Field(
        None, description="The /retrieve URL of a FlashRAG-style retriever (backend=http)."
    )
    search_timeout: float = Field(30.0, gt=0, description="Seconds for one HTTP search call.")
    search_api_key: str | None = Field(
        None,
        description="Key the search server wants (backend=http; None: $MASENVS_SEARCH_API_KEY).",
    )
    top_k: int = Field(3, ge=1, le=50, description="Documents returned per query.")
    max_queries: int = Field(3, ge=1, le=20, description="Queries run per turn; more are ignored.")
    search_cost: float = Field(
        0.02, ge=0, description="Subtracted (process part) for every query run."
    )
    entities: int = Field(300, ge=20, description="Entities in the synthetic encyclopedia.")
    world_seed: int = Field(0, description="Seed of the synthetic encyclopedia (fixed world).")
    min_hops: int = Field(1, ge=1, le=4, description="Fewest hops of a synthetic question.")
    max_hops: int = Field(4, ge=1, le=4, description="Most hops of a synthetic question.")
    max_rounds: int = Field(4, ge=1, le=1000, description="Rounds before the episode truncates.")
    correct_reward: float = Field(1.0, description="Reward for an exact-match answer.")
    evidence_reward: float = Field(
        0.2, description="Searcher's own reward when its results contain a golden answer."
    )
    format_penalty: float = Field(
        -0.5,
        description="Searcher: a turn without a query. Planner: a turn with neither an "
        "answer nor a sub-question, or no answer in the last round.",
    )
    doc_chars: int = Field(600, ge=50, description="Characters shown of each document.")
    shown_searches: int = Field(6, ge=1, description="Latest searches shown in prompts.")
    shown_chars: int = Field(2000, ge=100, description="Characters shown of the other's message.")


# --- parsing ------------------------------------------------------------------------------

_SEARCH_LINE = re.compile(r"^\s*(?:search|query)\s*:\s*(.+?)\s*$", re.I | re.M)
_SEARCH_TAG = re.compile(r"<search>(.*?)</search>", re.S | re.I)
_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
_SUB_LINE = re.compile(r"^\s*(?:sub|sub-question)\s*:\s*(.+?)\s*$", re.I | re.M)


def parse_queries(text: str) -> list[str]:
    """Queries in `text`: `search: q` lines, `<search>q</search>` tags and `search` tool calls."""
    queries = [m.group(1) for m in _SEARCH_LINE.finditer(text)]
    queries += [m.group(1).strip() for m in _SEARCH_TAG.finditer(text)]
    for block in _TOOL_CALL.findall(text):
        try:
            call = json.loads(block)
            if isinstance(call, dict) and call.get("name") == "search":
                query = (call.get("arguments") or {}).get("query")
                if isinstance(query, str):
                    queries.append(query)
        except (ValueError, AttributeError):
            continue
    return [q[:500] for q in queries if q.strip()]


def parse_answer(text: str) -> str | None:
    """The final answer: the rest of the line after the last `####`; None without one."""
    if "####" not in text:
        return None
    answer = text.rsplit("####", 1)[1].strip().split("\n", 1)[0].strip()
    return answer[:300] or None


def parse_subquestions(text: str) -> list[str]:
    return [m.group(1)[:300] for m in _SUB_LINE.finditer(text)]


# --- backends and task sources (built once per process for a given config) -----------------


@lru_cache(maxsize=4)
def _encyclopedia(entities: int, seed: int) -> Encyclopedia:
    return generate_encyclopedia(entities, seed)


@lru_cache(maxsize=4)
def _bm25(key: tuple[Any, ...]) -> BM25Backend:
    kind, *args = key
    docs = _encyclopedia(*args).docs if kind == "synthetic" else load_corpus_jsonl(args[0])
    return BM25Backend(docs)


@lru_cache(maxsize=8)
def _qa(path: str) -> tuple[SearchTask, ...]:
    return tuple(load_qa_jsonl(path))


def build_backend(cfg: WebSearchConfig) -> SearchBackend:
    """The backend `cfg` names; a misconfiguration is an error, never a stand-in."""
    if cfg.backend == "bm25":
        if cfg.source == "synthetic":
            return _bm25(("synthetic", cfg.entities, cfg.world_seed))
        if cfg.corpus is None:
            raise ValueError(
                "backend='bm25' with a jsonl: source needs corpus=/path/corpus.jsonl "
                "(or backend='http' with search_url)"
            )
        return _bm25(("corpus", cfg.corpus))
    if cfg.backend == "http":
        if not cfg.search_url:
            raise ValueError("backend='http' needs search_url=http://host:port/retrieve")
        return HttpBackend(cfg.search_url, cfg.search_timeout, cfg.search_api_key)
    if ":" in cfg.backend:
        return load_backend(cfg.backend)
    raise ValueError(f"backend must be 'bm25', 'http' or 'module:attr', got {cfg.backend!r}")


# --- prompts ------------------------------------------------------------------------------

FORMAT = (
    "Search with one line per query: `search: <query>` (at most {n} per turn; each query has a "
    "small cost). Keyword queries work best: names and relation words."
)
SYSTEM = {
    "searcher": (
        "You are the searcher of a research team answering a question from a document "
        "collection. " + FORMAT + " The results are shown to you and to the planner. Also "
        "report what the results you have seen say about the planner's sub-questions, one "
        "line each, e.g. `Kenzo was born in Arlo.`"
    ),
    "planner": (
        "You are the planner of a research team answering a question from a document "
        "collection. A searcher runs queries; you see its results and notes. Split the "
        "question into sub-questions for the searcher's next turn, one per line as "
        "`sub: <sub-question>`. When the results give the answer, end with `#### <answer>` "
        "(only the answer, e.g. `#### Arlo`): that ends the episode."
    ),
}
SOLO_SYSTEM = (
    "You answer a question from a document collection. "
    + FORMAT
    + " Results appear next round. When the results give the answer, end with "
    "`#### <answer>` (only the answer, e.g. `#### Arlo`): that ends the episode."
)


@dataclass
class SearchRecord:
    round: int
    agent: str
    query: str
    hits: list[Hit]


@dataclass
class WebSearchState(EpisodeState):
    searches: list[SearchRecord] = field(default_factory=list)
    subquestions: list[str] = field(default_factory=list)  # the planner's latest
    notes: str = ""  # the searcher's latest message
    answer: str | None = None
    em: float = 0.0
    f1: float = 0.0
    queries_run: int = 0


class WebSearchEnv(MASEnv):
    name = "web_search"
    roles = ("searcher", "planner")
    solo_role = "planner"
    config_class = WebSearchConfig

    config: WebSearchConfig
    task: SearchTask
    state: WebSearchState

    def __init__(
        self,
        config: WebSearchConfig | None = None,
        render_mode: str | None = None,
        search_backend: SearchBackend | None = None,
        **kw: Any,
    ) -> None:
        super().__init__(config, render_mode, **kw)
        cfg = self.config
        if cfg.min_hops > cfg.max_hops:
            raise ValueError(f"min_hops {cfg.min_hops} > max_hops {cfg.max_hops}: swap them")
        self.backend: SearchBackend = search_backend or build_backend(cfg)
        if cfg.source == "synthetic":
            self.book: Encyclopedia | None = _encyclopedia(cfg.entities, cfg.world_seed)
            self.dataset: tuple[SearchTask, ...] = ()
        elif cfg.source.startswith("jsonl:"):
            self.book, self.dataset = None, _qa(cfg.source.removeprefix("jsonl:"))
        else:
            raise ValueError(f"source must be 'synthetic' or 'jsonl:/path', got {cfg.source!r}")

    def generate_task(self, rng: np.random.Generator) -> SearchTask:
        cfg = self.config
        if self.book is not None:
            hops = int(rng.integers(cfg.min_hops, cfg.max_hops + 1))
            return self.book.question(rng, hops, int(rng.integers(1 << 30)))
        return self.dataset[int(rng.integers(len(self.dataset)))]

    def load_task(self, task: Any) -> SearchTask:
        return task if isinstance(task, SearchTask) else SearchTask.from_dict(task)

    def initial_state(self, task: SearchTask) -> WebSearchState:
        return WebSearchState()

    def task_info(self) -> dict[str, Any]:
        return {"id": self.task.id, "source": self.task.source, "hops": self.task.hops}

    # --- prompts ----------------------------------------------------------------------------

    def prompt(self, agent: str) -> list[Message]:
        cfg, state = self.config, self.state
        system = SOLO_SYSTEM if cfg.single_agent else SYSTEM[agent]
        system = system.replace("{n}", str(cfg.max_queries))
        lines = [
            f"Question: {self.task.question}",
            "",
            f"Round {self.round + 1} of {cfg.max_rounds}.",
        ]
        if state.searches:
            lines += ["", "Search results so far (latest last):"]
            for record in state.searches[-cfg.shown_searches :]:
                lines.append(f"search: {record.query}  (round {record.round + 1})")
                if not record.hits:
                    lines.append("  (no documents)")
                for rank, hit in enumerate(record.hits, 1):
                    lines.append(f"  [{rank}] {clip_text(hit.contents, cfg.doc_chars)}")
        if not cfg.single_agent:
            if agent == "searcher" and state.subquestions:
                lines += ["", "The planner's sub-questions:"] + [
                    f"- {q}" for q in state.subquestions
                ]
            if agent == "planner" and "searcher" in self.last_actions:
                lines += ["", "The searcher's latest message:"]
                lines.append(clip_text(self.last_actions["searcher"], cfg.shown_chars) or "(empty)")
        feedback = self.last_feedback.get(agent)
        if feedback:
            lines += ["", feedback]
        return [
            {"role": "system", "content": system},
            {"role": "user", "content": "\n".join(lines)},
        ]

    # --- one turn ---------------------------------------------------------------------------

    def _search(self, agent: str, text: str) -> tuple[int, bool]:
        """Run `text`'s queries; returns how many ran and whether a golden answer showed up."""
        cfg = self.config
        queries = parse_queries(text)[: cfg.max_queries]
        if not queries:
            return 0, False
        results = self.backend.search(queries, cfg.top_k)
        if len(results) != len(queries):
            raise SearchError(
                f"search backend {type(self.backend).__name__} returned {len(results)} result "
                f"lists for {len(queries)} queries: it must return one per query"
            )
        found = False
        for query, hits in zip(queries, results):
            hits = list(hits)[: cfg.top_k]
            self.state.searches.append(SearchRecord(self.round, agent, query, hits))
            found = found or any(contains_answer(h.contents, self.task.answers) for h in hits)
        self.state.queries_run += len(queries)
        return len(queries), found

    def play_turn(self, agent: str, action: str) -> RewardParts:
        if agent == "searcher":
            ran, found = self._search(agent, action)
            self.state.notes = action
            self.last_feedback[agent] = (
                "" if ran else "No query found: write `search: <query>` lines."
            )
            own = (
                self.config.evidence_reward
                if found
                else (0.0 if ran else self.config.format_penalty)
            )
            return RewardParts(process=-self.config.search_cost * ran if ran else 0.0, agent=own)
        return self._planner_turn(action)

    def _planner_turn(self, text: str) -> RewardParts:
        cfg, state = self.config, self.state
        ran = self._search("planner", text)[0] if cfg.single_agent else 0
        process = -cfg.search_cost * ran if ran else 0.0
        subs = parse_subquestions(text)
        if subs:
            state.subquestions = subs
        answer = parse_answer(text)
        if answer is None:
            last = self.round + 1 >= cfg.max_rounds
            useful = bool(subs or ran) and not last
            self.last_feedback["planner"] = (
                ""
                if useful
                else "No `#### <answer>` line: give the answer when the results hold it."
            )
            return RewardParts(process=process, agent=0.0 if useful else cfg.format_penalty)
        state.answer = answer
        state.em = exact_match(answer, self.task.answers)
        state.f1 = f1_score(answer, self.task.answers)
        state.success, state.failed = state.em == 1.0, state.em != 1.0
        self.last_feedback["planner"] = ""
        return RewardParts(
            process=process,
            agent=cfg.correct_reward * state.f1,
            team=cfg.correct_reward * state.em,
        )

    def _info(self, agent: str, parts: RewardParts | None) -> dict[str, Any]:
        info = super()._info(agent, parts)
        state = self.state
        info.update(answer=state.answer, em=state.em, f1=state.f1, queries=state.queries_run)
        return info

    def render_text(self) -> str:
        state = self.state
        over = self.round > 0 and not self.agents
        golden = " | ".join(self.task.answers) if over else "shown at the end"
        answer = state.answer if state.answer is not None else "no answer yet"
        return (
            f"web_search {self.task.id} ({self.task.hops or '?'} hops, round {self.round}): "
            f"{state.queries_run} queries, answer {answer!r} (EM {state.em:.0f}, F1 "
            f"{state.f1:.2f}); golden {golden}"
        )
