"""masenvs.mas: the building blocks against the tiny model through the real endpoint, their
decision logic with a scripted model, the design graph, the gate's refusals, and hostile
designs contained in the sandbox and scored 0 with their cause."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from framework_support import serve

from masenvs import mas
from masenvs.engine.engine import EmbeddedBackend
from masenvs.mas.design import DesignRunner, extract_design
from masenvs.mas.gate import Gate

QUESTION = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture(scope="module")
def backend() -> Iterator[EmbeddedBackend]:
    engine = EmbeddedBackend.from_spec("tiny", max_batch_size=32, max_model_len=1024)
    yield engine
    engine.shutdown()


@pytest.fixture
def served(backend, tmp_path):
    with serve(backend, tmp_path / "traces", policy_map={"executor": "base"}) as s:
        yield s


class Scripted:
    """A stand-in chat model for the blocks' decision logic: replies by node name, in turn."""

    def __init__(self, replies: dict[str, list[str]]) -> None:
        self.replies = {k: list(v) for k, v in replies.items()}
        self.seen: list[tuple[str, list[dict]]] = []

    async def chat(self, node: str, messages: list[dict]) -> str:
        self.seen.append((node, messages))
        return self.replies[node].pop(0)


def run(block: mas.Block, llm, question=QUESTION) -> str:
    async def go() -> str:
        with mas.use(llm):
            try:
                return await block(question)
            finally:
                if isinstance(llm, mas.LLM):
                    await llm.aclose()

    return asyncio.run(go())


# --- every block through the endpoint ---------------------------------------------------------

BLOCKS = {
    "agent": lambda: mas.Agent("solo", "Answer briefly."),
    "sequential": lambda: mas.Sequential(mas.Agent("draft"), mas.Agent("polish")),
    "ensemble": lambda: mas.Ensemble(mas.Agent("a"), mas.Agent("b"), judge=mas.Agent("judge")),
    "debate": lambda: mas.Debate(mas.Agent("pro"), mas.Agent("con"), rounds=2),
    "reflect": lambda: mas.Reflect(mas.Agent("actor"), mas.Agent("critic"), rounds=2),
    "router": lambda: mas.Router(
        mas.Agent("router"), {"algebra": mas.Agent("alg"), "counting": mas.Agent("cnt")}
    ),
    "loop": lambda: mas.Loop(mas.Agent("trier"), max_iters=2),
}


@pytest.mark.parametrize("kind", BLOCKS)
def test_each_block_calls_the_executor_through_the_endpoint(served, kind) -> None:
    block = BLOCKS[kind]()
    llm = mas.connect(f"{served.url}/r/blk-{kind}/v1", max_tokens=6)
    answer = run(block, llm)
    assert isinstance(answer, str) and answer
    records = served.store.rollout(f"blk-{kind}")
    assert len(records) == len(llm.calls) >= 1
    assert {r.agent for r in records} == {"executor"}  # every node is the executor policy
    assert sorted(r.id for r in records) == sorted(c.call_id for c in llm.calls)
    graph = mas.DesignGraph.of(block, llm.calls_by_node())
    called = {n.name for n in graph.nodes if n.calls}
    assert called <= {a.name for a in block.walk() if isinstance(a, mas.Agent)}
    assert sum(len(n.calls) for n in graph.nodes) == len(records)


# --- decisions, with a scripted model -----------------------------------------------------------


def test_ensemble_takes_the_majority_and_asks_the_judge_only_on_a_tie() -> None:
    trio = mas.Ensemble(mas.Agent("a"), mas.Agent("b"), mas.Agent("c"), judge=mas.Agent("j"))
    llm = Scripted({"a": ["\\boxed{4}"], "b": ["so \\boxed{ 4 }"], "c": ["\\boxed{5}"], "j": []})
    assert run(trio, llm) == "\\boxed{4}"
    assert [n for n, _ in llm.seen] == ["a", "b", "c"]
    pair = mas.Ensemble(mas.Agent("a"), mas.Agent("b"), judge=mas.Agent("j"))
    llm = Scripted({"a": ["\\boxed{4}"], "b": ["\\boxed{5}"], "j": ["\\boxed{4} it is"]})
    assert run(pair, llm) == "\\boxed{4} it is"
    assert "Candidate 1:\n\\boxed{4}" in llm.seen[-1][1][-1]["content"]


def test_debaters_read_each_other_then_vote() -> None:
    debate = mas.Debate(mas.Agent("x"), mas.Agent("y"), mas.Agent("z"), rounds=2)
    llm = Scripted(
        {
            "x": ["\\boxed{1}", "\\boxed{2}"],
            "y": ["\\boxed{2}", "\\boxed{2}"],
            "z": ["\\boxed{3}", "\\boxed{3}"],
        }
    )
    assert run(debate, llm) == "\\boxed{2}"
    second_x = [m for n, m in llm.seen if n == "x"][1]
    assert "\\boxed{2}" in second_x[-1]["content"] and "\\boxed{3}" in second_x[-1]["content"]


def test_reflect_revises_until_the_critic_approves() -> None:
    block = mas.Reflect(mas.Agent("actor"), mas.Agent("critic"), rounds=3)
    llm = Scripted(
        {"actor": ["\\boxed{5}", "\\boxed{4}"], "critic": ["2+2 is not 5", "APPROVE, correct"]}
    )
    assert run(block, llm) == "\\boxed{4}"
    assert [n for n, _ in llm.seen] == ["actor", "critic", "actor", "critic"]
    assert "2+2 is not 5" in llm.seen[2][1][-1]["content"]


def test_router_runs_the_route_it_names_and_falls_back_to_the_default() -> None:
    routes = {"algebra": mas.Agent("alg"), "geometry": mas.Agent("geo")}
    block = mas.Router(mas.Agent("r"), routes, default="algebra")
    llm = Scripted({"r": ["I pick Geometry."], "geo": ["\\boxed{1}"], "alg": []})
    assert run(block, llm) == "\\boxed{1}"
    llm = Scripted({"r": ["no idea"], "alg": ["\\boxed{2}"], "geo": []})
    assert run(block, llm) == "\\boxed{2}"


def test_loop_stops_at_the_first_boxed_answer() -> None:
    llm = Scripted({"t": ["thinking", "more", "\\boxed{7}", "never"]})
    assert run(mas.Loop(mas.Agent("t"), max_iters=5), llm) == "\\boxed{7}"
    assert len(llm.seen) == 3


def test_bad_blocks_fail_when_built_with_a_clear_message() -> None:
    with pytest.raises(TypeError, match="takes blocks"):
        mas.Sequential(mas.Agent("a"), "not a block")
    with pytest.raises(ValueError, match="rounds"):
        mas.Debate(mas.Agent("a"), rounds=0)
    with pytest.raises(ValueError, match="default"):
        mas.Router(mas.Agent("r"), {"a": mas.Agent("a")}, default="b")
    with pytest.raises(RuntimeError, match="no LLM"):
        asyncio.run(mas.Agent("a")("hi"))


def test_the_graph_names_nodes_edges_and_round_trips_through_json(tmp_path: Path) -> None:
    system = mas.Sequential(
        mas.Ensemble(mas.Agent("a"), mas.Agent("b"), judge=mas.Agent("j")),
        mas.Reflect(mas.Agent("fix"), mas.Agent("check")),
    )
    graph = mas.DesignGraph.of(system, {"a": ["c1"], "fix": ["c2", "c3"]})
    assert [n.name for n in graph.nodes] == ["a", "b", "j", "fix", "check"]
    assert set(graph.edges) == {
        ("a", "j"),
        ("b", "j"),
        ("j", "fix"),
        ("fix", "check"),
        ("check", "fix"),
    }
    assert graph.structure == "Sequential(Ensemble(a, b, j), Reflect(fix, check))"
    again = mas.DesignGraph.from_dict(json.loads(graph.to_json()))
    assert again == graph
    png = graph.render(tmp_path / "g.png", title="test")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_the_design_is_read_from_code_tags_or_a_python_fence() -> None:
    assert extract_design("x <code>\nsystem = Agent('a')\n</code> y") == "system = Agent('a')"
    assert extract_design("<code>```python\nsystem = 1\n```</code>") == "system = 1"
    assert extract_design("```python\na = 1\n```\n```python\nsystem = 2\n```") == "system = 2"
    assert extract_design("no code at all") is None


# --- the gate -------------------------------------------------------------------------------------


def post(gate: Gate, path: str, body: dict) -> httpx.Response:
    with httpx.Client(transport=httpx.HTTPTransport(uds=gate.path)) as client:
        return client.post(f"http://gate{path}", json=body, timeout=60)  # a first call warms up


def test_the_gate_forwards_only_its_rollouts_chat_calls_within_budget(served) -> None:
    chat = {"model": "executor", "messages": QUESTION, "max_tokens": 4}
    with Gate(served.url, "gated", {"executor": "executor"}, max_calls=2, max_tokens=4) as gate:
        assert post(gate, "/v1/chat/completions", chat).status_code == 200
        assert post(gate, "/r/other/v1/chat/completions", chat).status_code == 403
        assert post(gate, "/v1/completions", chat).status_code == 404
        assert post(gate, "/v1/chat/completions", {**chat, "model": "designer"}).status_code == 400
        bad_node = {**chat, "model": "executor@../../r/x"}
        assert post(gate, "/v1/chat/completions", bad_node).status_code == 400
        assert post(gate, "/v1/chat/completions", {**chat, "stream": True}).status_code == 400
        named = post(gate, "/v1/chat/completions", {**chat, "model": "executor@solver"})
        assert named.status_code == 200
        over = post(gate, "/v1/chat/completions", chat)
        assert over.status_code == 429 and "budget" in over.json()["error"]["message"]
        assert gate.calls == 2 and len(gate.refused) == 6
    records = served.store.rollout("gated")
    assert [(r.agent, r.step) for r in records] == [("executor", None), ("executor", "solver")]
    assert served.store.rollout("other") == []


def test_the_gate_sends_the_endpoint_api_key(backend, tmp_path) -> None:
    chat = {"model": "executor", "messages": QUESTION, "max_tokens": 4}
    with serve(backend, tmp_path / "t", policy_map={"executor": "base"}, api_key="s3cret") as s:
        with Gate(s.url, "keyed", {"executor": "executor"}, max_tokens=4) as gate:
            assert post(gate, "/v1/chat/completions", chat).status_code == 401
        with Gate(s.url, "keyed", {"executor": "executor"}, api_key="s3cret", max_tokens=4) as gate:
            assert post(gate, "/v1/chat/completions", chat).status_code == 200


# --- designs in the sandbox -----------------------------------------------------------------------

GOOD = """
solver = Agent("solver", "Answer with \\\\boxed{}.")
system = Reflect(solver, Agent("checker"))
"""

HOSTILE = {
    "infinite loop": ("while True:\n    pass\n", "timeout"),
    "fork bomb": ("import os\nwhile True:\n    os.fork()\n", ""),
    "memory blow-up": ("x = bytearray(8 << 30)\n", ""),
    "network socket": (
        "import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=2)\n",
        "error: OSError",
    ),
    "write outside": ("open('/etc/masenvs-pwned', 'w').write('x')\n", "error: OSError"),
    "another rollout": (
        "async def solve(messages):\n"
        "    llm = current()\n"
        "    other = llm.client.with_options(base_url='http://gate/r/victim/v1')\n"
        "    await other.chat.completions.create(model='executor', messages=messages)\n",
        "PermissionDeniedError",
    ),
    "forged model": (
        "async def solve(messages):\n"
        "    llm = current()\n"
        "    llm.model = 'designer'\n"
        "    return await Agent('x')(messages)\n",
        "BadRequestError",
    ),
    "thousands of calls": (
        "system = Loop(Agent('again'), until=lambda text: False, max_iters=5000)\n",
        "budget:",
    ),
    "budget dodge": (
        "async def solve(messages):\n"
        "    llm = current()\n"
        "    llm.max_calls = None\n"
        "    for _ in range(100):\n"
        "        await Agent('x')(messages)\n",
        "RateLimitError",
    ),
    "megabytes of output": ("print('x' * (8 << 20))\n", "output limit"),
    "no system": ("x = 1\n", "defines no `system`"),
    "syntax error": ("system = (\n", "syntax error"),
    "returns a list": ("async def solve(messages):\n    return ['\\\\boxed{4}']\n", "not text"),
}


def test_a_design_runs_in_the_sandbox_and_its_calls_are_recorded(served) -> None:
    run = DesignRunner(served.url, max_tokens=6).run(GOOD, QUESTION, "design-ok")
    assert run.ok, run.error
    assert run.calls == len(served.store.rollout("design-ok")) >= 2
    graph = mas.DesignGraph.from_dict(run.graph)
    assert graph.structure == "Reflect(solver, checker)"
    ids = [c for n in graph.nodes for c in n.calls]
    records = served.store.rollout("design-ok")
    assert sorted(ids) == sorted(r.id for r in records)
    # The trace names each call's node (its step); the policy is the executor's.
    node_of = {c: n.name for n in graph.nodes for c in n.calls}
    assert all(r.agent == "executor" and r.step == node_of[r.id] for r in records)


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_designs_are_contained_and_fail_with_their_cause(served, name) -> None:
    source, cause = HOSTILE[name]
    runner = DesignRunner(served.url, max_calls=3, max_tokens=4, seconds=8, memory_mb=1024)
    run = runner.run(source, QUESTION, f"hostile-{name.replace(' ', '-')}")
    assert not run.ok and run.answer in (None, "")
    assert cause in run.error, run.error
    assert not Path("/etc/masenvs-pwned").exists()
    assert served.store.rollout("victim") == []
    assert run.calls <= 3
