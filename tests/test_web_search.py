"""web_search: rewards, parsing, every backend (bm25s, HTTP through a real search-serve,
custom), the generated questions' answerability, the loaders, and a 2-step tiny training run."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import masenvs
from masenvs.envs.web_search import parse_answer, parse_queries
from masenvs.search import (
    BM25Backend,
    Hit,
    HttpBackend,
    PlainBM25,
    SearchError,
    exact_match,
    f1_score,
    generate_encyclopedia,
    generate_tasks,
    load_corpus_jsonl,
    load_qa_jsonl,
    normalize_answer,
    write_corpus_jsonl,
)

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "search"


def answer_episode(env: masenvs.MASEnv, answer: str) -> tuple[dict, dict]:
    """Searcher searches the question, planner answers: returns the planner step's results."""
    env.step({"searcher": f"search: {env.task.question}"})
    _, rewards, terms, _, infos = env.step({"planner": f"I think so.\n#### {answer}"})
    assert all(terms.values()) and not env.agents
    return rewards, infos


# --- rewards and parsing --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prediction", "golden", "em", "f1"),
    [
        ("The Eiffel Tower!", ["eiffel tower"], 1.0, 1.0),
        ("  an   Apple ", ["apple"], 1.0, 1.0),
        ("Hemingway", ["Ernest Hemingway", "Hemingway"], 1.0, 1.0),  # max over golden answers
        ("Ernest Miller Hemingway", ["Ernest Hemingway"], 0.0, 0.8),
        ("Paris, France", ["Paris"], 0.0, 2 / 3),  # no substring leniency for EM
        ("Canberra is the capital", ["Canberra"], 0.0, 0.5),
        ("", ["Canberra"], 0.0, 0.0),
        ("the", ["a"], 1.0, 1.0),  # both normalise to nothing
    ],
)
def test_em_and_f1_after_squad_normalisation(prediction, golden, em, f1) -> None:
    assert exact_match(prediction, golden) == em
    assert f1_score(prediction, golden) == pytest.approx(f1)


def test_normalisation_steps() -> None:
    assert normalize_answer("The  Cat's   HAT, a tale.") == "cats hat tale"
    assert normalize_answer("Theatre and Anthem") == "theatre and anthem"  # words, not prefixes


def test_actions_parse_in_text_and_tool_call_syntax() -> None:
    text = (
        "search: founder of Zorvex\nQuery: born in Arlo\n<search>capital of Kenz</search>\n"
        '<tool_call>{"name": "search", "arguments": {"query": "mentor of Bo"}}</tool_call>\n'
        "<tool_call>not json</tool_call>"
    )
    assert parse_queries(text) == [
        "founder of Zorvex",
        "born in Arlo",
        "capital of Kenz",
        "mentor of Bo",
    ]
    assert parse_answer("so\n#### Arlo Bay \nthanks") == "Arlo Bay"
    assert parse_answer("#### first\n#### second") == "second"
    assert parse_answer("no marker") is None and parse_answer("####   ") is None


def test_golden_answers_succeed_in_one_round() -> None:
    env = masenvs.make("web_search")
    for seed in range(6):
        env.reset(seed=seed)
        rewards, infos = answer_episode(env, env.task.answers[0].upper() + ".")
        assert infos["planner"]["success"] and infos["planner"]["em"] == 1.0
        parts = infos["planner"]["reward_parts"]
        assert parts == {"process": 0.0, "agent": 1.0, "team": 1.0}
        assert infos["searcher"]["reward_parts"]["team"] == 1.0


def test_golden_chain_succeeds_hop_by_hop() -> None:
    """One golden query per round: each round's results name the next entity, and the
    planner answers in the round of the last hop, within the default 4 rounds."""
    env = masenvs.make("web_search")
    for seed in range(12):
        env.reset(seed=seed)
        for i, (subject, relation, obj) in enumerate(env.task.chain):
            obs = env.step({"searcher": f"search: {relation.replace('_', ' ')} {subject}"})[0]
            assert obj in obs["planner"].split("Search results")[1]
            last = i == env.task.hops - 1
            step = env.step({"planner": f"#### {obj}" if last else f"sub: what about {obj}?"})
        assert step[4]["planner"]["success"] and env.round == env.task.hops
        assert step[4]["searcher"]["reward_parts"]["team"] == 1.0


def test_wrong_and_partial_answers_fail_with_f1() -> None:
    env = masenvs.make("web_search")
    env.reset(seed=0)
    golden = env.task.answers[0]
    _, infos = answer_episode(env, f"{golden} Extra")
    assert not infos["planner"]["success"] and infos["planner"]["em"] == 0.0
    assert 0 < infos["planner"]["reward_parts"]["agent"] < 1
    assert infos["planner"]["reward_parts"]["team"] == 0.0


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.text(max_size=200))
def test_fuzzed_actions_never_succeed(text: str) -> None:
    env = masenvs.make("web_search", max_rounds=2)
    env.reset(seed=1)
    golden = {normalize_answer(a) for a in env.task.answers}
    while env.agents:
        env.step(dict.fromkeys(env.agents, text))
    assert env.state.success == (normalize_answer(parse_answer(text) or "") in golden)
    assert not env.state.success


def test_each_query_costs_and_searcher_finds_evidence() -> None:
    env = masenvs.make("web_search", search_cost=0.1, max_queries=2, min_hops=1, max_hops=1)
    env.reset(seed=2)
    subject = env.task.chain[0][0]
    _, _, _, _, infos = env.step({"searcher": f"search: {subject}\nsearch: x\nsearch: y"})
    parts = infos["searcher"]["reward_parts"]
    assert parts["process"] == pytest.approx(-0.2)  # the third query is over max_queries
    assert parts["agent"] == pytest.approx(0.2)  # a result holds the answer
    assert env.state.queries_run == 2
    planner_prompt = infos["planner"]["messages"][-1]["content"]
    assert f"search: {subject}" in planner_prompt and env.task.answers[0] in planner_prompt
    _, _, _, _, infos = env.step({"planner": "sub: who is it?"})
    assert infos["planner"]["reward_parts"]["agent"] == 0.0
    assert "sub-questions:\n- who is it?" in env.prompt("searcher")[-1]["content"]
    _, _, _, _, infos = env.step({"searcher": "nothing"})
    assert infos["searcher"]["reward_parts"] == {"process": 0.0, "agent": -0.5, "team": 0.0}


def test_single_agent_searches_and_answers() -> None:
    env = masenvs.make("web_search", single_agent=True, min_hops=1, max_hops=1)
    _, infos = env.reset(seed=4)
    assert env.agents == ["planner"] and "search:" in infos["planner"]["messages"][0]["content"]
    _, _, _, _, infos = env.step({"planner": f"search: {env.task.chain[0][0]}"})
    assert env.task.answers[0] in infos["planner"]["messages"][-1]["content"]
    _, rewards, terms, _, infos = env.step({"planner": f"#### {env.task.answers[0]}"})
    assert terms["planner"] and infos["planner"]["success"]


# --- the generator ---------------------------------------------------------------------------


def test_generated_questions_follow_from_their_documents() -> None:
    """Walking the golden chain with BM25 reaches the answer: every hop's query returns the
    hop's document in the top 3, and that document names the next entity."""
    book = generate_encyclopedia(300, seed=0)
    assert book.docs == generate_encyclopedia(300, seed=0).docs  # seeded
    backend = BM25Backend(book.docs)
    tasks = generate_tasks(book, 40, 1, 4, seed=1)
    assert {t.hops for t in tasks} == {1, 2, 3, 4}
    for task in tasks:
        assert len(task.chain) == task.hops and task.chain[-1][2] == task.answers[0]
        for subject, relation, obj in task.chain:
            hits = backend.search([f"{relation.replace('_', ' ')} {subject}"], 3)[0]
            doc = next(h for h in hits if h.contents.startswith(f'"{subject}"'))
            assert obj in doc.contents
        names = [hop[0] for hop in task.chain] + [task.answers[0]]
        assert len(set(names)) == len(names)  # the answer is never in the question's chain


# --- backends --------------------------------------------------------------------------------


def test_bm25s_and_plain_bm25_agree() -> None:
    docs = generate_encyclopedia(200, seed=3).docs
    fast, plain = BM25Backend(docs), PlainBM25(docs)
    queries = [d.title for d in docs[:30]] + ["capital of nowhere", "zzzz"]
    for a, b in zip(fast.search(queries, 3), plain.search(queries, 3)):
        assert [h.score for h in a] == pytest.approx([h.score for h in b], rel=1e-4)
        if a:  # the same top document, up to ties in score
            assert a[0].id in {h.id for h in b if h.score == pytest.approx(b[0].score)}
    assert fast.search(["zzzz"], 3) == [[]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def search_server(tmp_path: Path) -> Iterator[str]:
    """A real `masenvs search-serve` process over the synthetic corpus, on loopback."""
    corpus = write_corpus_jsonl(generate_encyclopedia(300, seed=0).docs, tmp_path / "c.jsonl")
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "masenvs.cli", "search-serve", str(corpus), "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert "serving BM25 over 300 documents" in proc.stdout.readline()
        yield f"http://127.0.0.1:{port}/retrieve"
    finally:
        proc.terminate()
        proc.wait(10)


def test_http_backend_against_search_serve(search_server: str) -> None:
    import httpx

    raw = httpx.post(
        search_server, json={"queries": ["mentor", "qqqq"], "topk": 2, "return_scores": True}
    ).json()
    assert set(raw) == {"result"} and len(raw["result"]) == 2 and raw["result"][1] == []
    first = raw["result"][0][0]
    assert set(first) == {"document", "score"} and set(first["document"]) == {"id", "contents"}
    env = masenvs.make("web_search", backend="http", search_url=search_server)
    local = masenvs.make("web_search")
    env.reset(seed=5), local.reset(seed=5)
    query = f"search: {env.task.chain[0][0]}"
    remote_obs = env.step({"searcher": query})[0]
    local_obs = local.step({"searcher": query})[0]
    assert remote_obs == local_obs  # the same BM25 over the same corpus, through HTTP
    env.reset(seed=6)
    rewards, infos = answer_episode(env, env.task.answers[0])
    assert infos["planner"]["success"]


def test_failing_backends_raise_clear_errors(search_server: str) -> None:
    port = free_port()  # nothing listens there
    env = masenvs.make("web_search", backend="http", search_url=f"http://127.0.0.1:{port}")
    env.reset(seed=0)
    with pytest.raises(SearchError, match="unreachable.*search-serve"):
        env.step({"searcher": "search: anything"})
    import httpx

    bad = httpx.post(search_server, json={"queries": "not a list"})
    assert bad.status_code == 400 and "list of strings" in bad.json()["error"]
    with pytest.raises(SearchError, match="HTTP 404"):
        HttpBackend(search_server.replace("/retrieve", "/nope/retrieve")).search(["a"], 1)
    with pytest.raises(ValueError, match="search_url"):
        masenvs.make("web_search", backend="http")
    with pytest.raises(ValueError, match="corpus="):
        masenvs.make("web_search", source=f"jsonl:{DATA / 'nq.jsonl'}")

    class Broken:
        def search(self, queries: Sequence[str], k: int) -> list[list[Hit]]:
            raise SearchError("index offline")

    env = masenvs.make("web_search", search_backend=Broken())
    env.reset(seed=0)
    with pytest.raises(SearchError, match="index offline"):
        env.step({"searcher": "search: anything"})
    assert env.step({"searcher": "no query, no call"})  # no search, no backend call


class FixedBackend:
    """A custom backend: every query returns one document naming the answer."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[str], int]] = []

    def search(self, queries: Sequence[str], k: int) -> list[list[Hit]]:
        self.calls.append((list(queries), k))
        return [[Hit("x", '"Note"\nThe answer is Canberra.', 1.0)] for _ in queries]


def custom_backend() -> FixedBackend:
    return FixedBackend()


def test_custom_backend_and_qa_source() -> None:
    backend = FixedBackend()
    env = masenvs.make(
        "web_search", source=f"jsonl:{DATA / 'nq.jsonl'}", search_backend=backend, top_k=4
    )
    env.reset(
        options={"task": {"question": "capital of australia?", "golden_answers": ["Canberra"]}}
    )
    obs = env.step({"searcher": "search: capital of australia"})[0]
    assert "The answer is Canberra." in obs["planner"] and backend.calls == [
        (["capital of australia"], 4)
    ]
    _, _, _, _, infos = env.step({"planner": "#### canberra"})
    assert infos["planner"]["success"] and infos["searcher"]["reward_parts"]["team"] == 1.0
    by_path = masenvs.make("web_search", backend="test_web_search:custom_backend")
    # (pytest may import this file under another module name: compare by behaviour)
    by_path.reset(seed=0)
    by_path.step({"searcher": "search: q"})
    assert type(by_path.backend).__name__ == "FixedBackend" and by_path.backend.calls == [
        (["q"], 3)
    ]


def test_bm25_over_a_loaded_corpus_answers_a_loaded_question() -> None:
    env = masenvs.make(
        "web_search",
        source=f"jsonl:{DATA / 'nq.jsonl'}",
        corpus=str(DATA / "corpus_contents.jsonl"),
        top_k=1,
    )
    env.reset(options={"task": load_qa_jsonl(DATA / "nq.jsonl")[1]})
    obs = env.step({"searcher": "search: capital city of Australia"})[0]
    assert "Canberra is the capital city of Australia" in obs["planner"]
    assert "Sydney" not in obs["planner"].split("Search results")[1]


# --- loaders ---------------------------------------------------------------------------------


def test_loaders_read_the_fixtures(tmp_path: Path) -> None:
    nq = load_qa_jsonl(DATA / "nq.jsonl")
    assert [t.id for t in nq] == ["test_0", "test_1"] and nq[0].source == "nq"
    assert nq[0].answers == ("Ernest Hemingway", "Hemingway")
    hotpot = load_qa_jsonl(DATA / "hotpotqa.jsonl")
    assert hotpot[0].answers == ("yes",) and hotpot[0].source == "hotpotqa"
    contents = load_corpus_jsonl(DATA / "corpus_contents.jsonl")
    titled = load_corpus_jsonl(DATA / "corpus_title_text.jsonl")
    assert contents[1].title == "Canberra" and titled[1].title == "Ed Wood"
    assert (
        titled[0].contents
        == '"Scott Derrickson"\nScott Derrickson is an American director, screenwriter and producer.'
    )
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": 1, "body": "x"}) + "\n")
    with pytest.raises(ValueError, match="neither 'contents' nor 'text'"):
        load_corpus_jsonl(bad)
    bad.write_text(json.dumps({"id": 1, "question": "q"}) + "\n")
    with pytest.raises(ValueError, match="golden_answers"):
        load_qa_jsonl(bad)
    with pytest.raises(FileNotFoundError, match="local file"):
        load_qa_jsonl(tmp_path / "missing.jsonl")


# --- training --------------------------------------------------------------------------------


def test_two_tiny_training_steps(tmp_path: Path) -> None:
    from masenvs.trainer.config import load_config
    from masenvs.trainer.run.train import train

    overrides = [
        "model.name=tiny",
        "model.device=cpu",
        "model.dtype=auto",
        "backend.kind=embedded",
        "steps=2",
        "rollout.tasks_per_step=1",
        "rollout.branches=2",
        "rollout.max_tokens=8",
        "rollout.max_rounds=1",
        "rollout.concurrency=2",
        "validation.episodes=1",
        "validation.every=2",
        "checkpoint.every=2",
        "logging.tensorboard=false",
        "logging.plot_every=0",
        f"run_dir={tmp_path / 'run'}",
    ]
    start = time.perf_counter()
    result = train(load_config(ROOT / "examples" / "web_search.yaml", overrides))
    rows = [
        json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in rows if "time/update_s" in r] == [1, 2]
    adapters = result.run_dir / "checkpoints" / "step_00000002" / "adapters"
    assert sorted(p.name for p in adapters.iterdir()) == ["planner", "searcher"]
    assert time.perf_counter() - start < 300
