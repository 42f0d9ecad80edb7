"""MetaAgent-X as published: tool-using multi-turn agent nodes (code run in the sandbox),
the authors' `workflow` API running unchanged inside a design, and a mixed math + code
task source. Real endpoint, real gate, real sandbox; the tiny model or a scripted policy."""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from framework_support import serve

import masenvs
from masenvs import mas
from masenvs.engine.engine import EmbeddedBackend
from masenvs.engine.loading import load_model
from masenvs.engine.protocol import Completion, GenerateRequest, Generation, StreamDelta

ROOT = Path(__file__).resolve().parents[1]
MATH = {"id": "six-times-seven", "question": "What is 6 * 7?", "answer": "42"}


class ScriptedBackend:
    """A policy whose reply is a function of the messages (the tiny model writes noise, and a
    tool loop needs a model that writes code): tokens from the tiny model's tokenizer."""

    def __init__(self, script: Callable[[list[dict[str, Any]]], str]) -> None:
        self.tokenizer = load_model("tiny").tokenizer
        self.chat_template = self.tokenizer.chat_template
        self.script = script
        self.seen: list[list[dict[str, Any]]] = []

    async def generate(self, request: GenerateRequest) -> Generation:
        messages = [dict(m) for m in request.messages or []]
        self.seen.append(messages)
        reply = self.script(messages)
        prompt = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        ids = self.tokenizer(reply, add_special_tokens=False)["input_ids"]
        ids.append(self.tokenizer.eos_token_id)
        done = Completion(ids, reply, [-0.1] * len(ids), "stop", stop_reason=ids[-1])
        return Generation(list(prompt), [done] * request.params.n, request.model)

    async def stream(self, request: GenerateRequest) -> AsyncIterator[StreamDelta | Generation]:
        yield await self.generate(request)

    def model_names(self) -> list[str]:
        return ["base"]

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)

    def tokenizer_id(self) -> str:
        return "tiny"

    async def load_adapter(self, name: str, path: str) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        pass


def coder(messages: list[dict[str, Any]]) -> str:
    """Writes a program first; answers with what the program printed once it has seen it."""
    system = messages[0]["content"] if messages[0]["role"] == "system" else ""
    last = messages[-1]["content"]
    if "inside <solution>" in system:  # a workflow node told it is a code task
        return (
            "<delivery>read two integers, print the sum</delivery>\n<solution>\n"
            "a, b = map(int, input().split())\nprint(a + b)\n</solution>"
        )
    if "ALWAYS-CODE" in system:  # never answers on its own
        return "Still computing.\n```python\nprint(1)\n```"
    if "USE-LOOKUP" in system:  # calls the design's own tool, then answers with its result
        found = re.search(r"returned:\n(\S+)", last)
        if found:
            return f"FINAL ANSWER: \\boxed{{{found.group(1)}}}"
        return '<tool_call>{"name": "lookup", "arguments": {"key": "product"}}</tool_call>'
    printed = re.search(r"Output:\n(\S+)", last)
    if printed:
        return (
            f"The program printed {printed.group(1)}. FINAL ANSWER: \\boxed{{{printed.group(1)}}}"
        )
    if "Error" in last:
        return "The code failed; I give up. \\boxed{0}"
    return "Let me compute it.\n```python\nprint(6 * 7)\n```"


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    backend = ScriptedBackend(coder)
    policies = {"executor": "base", "designer": "base"}
    with serve(backend, tmp_path_factory.mktemp("s") / "traces", policy_map=policies) as s:
        s.backend = backend
        yield s


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    engine = EmbeddedBackend.from_spec("tiny", max_batch_size=32, max_model_len=2048)
    policies = {"executor": "base", "designer": "base"}
    with serve(engine, tmp_path_factory.mktemp("t") / "traces", policy_map=policies) as s:
        yield s
    engine.shutdown()


def step(env, action: str):
    _, rewards, _, _, infos = env.step({"designer": action})
    return rewards["designer"], infos["designer"]


def design(body: str) -> str:
    return f"Here is my team.\n<code>\n{body}\n</code>"


# --- tool-using, multi-turn agent nodes ------------------------------------------------------


def test_a_tool_agent_runs_its_code_in_the_sandbox_and_answers_from_the_output(
    scripted,
) -> None:
    env = masenvs.make("auto_mas", endpoint_url=scripted.url, executions=1, max_rounds=1)
    env.reset(options={"task": MATH})
    reward, info = step(env, design('system = ToolAgent("calc", "Use Python.", max_turns=3)'))
    assert info["error"] is None and reward == pytest.approx(1.05), info
    calls = scripted.store.rollout(info["captured"][0]["rollout_id"])
    assert len(calls) == 2  # a tool turn, then the answer
    second = calls[1].messages
    assert second[-2]["role"] == "assistant" and "```python" in second[-2]["content"]
    assert second[-1]["role"] == "user" and second[-1]["content"].startswith("Output:\n42")
    assert info["graph"]["structure"] == "calc"


def test_tool_code_runs_without_network_and_its_failure_is_the_observation(scripted) -> None:
    import asyncio

    llm = mas.connect(scripted.url + "/v1")  # outside a design: a local sandbox

    def run(code: str) -> str:
        return asyncio.run(llm.execute_python(code))

    assert run("print(sum(range(10)))") == "Output:\n45\n"
    net = run("import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=2)")
    assert net.startswith("Error:") and "Network is unreachable" in net
    assert "Read-only file system" in run("open('/etc/x', 'w')")
    assert "SyntaxError" in run("print(")
    assert run("while True: pass").startswith("Timeout:")
    assert llm.tool_runs == 5


def test_a_tool_agent_is_told_to_answer_after_max_turns_and_the_gate_bounds_tool_runs(
    scripted,
) -> None:
    env = masenvs.make(
        "auto_mas", endpoint_url=scripted.url, executions=1, max_rounds=1, max_tool_runs=1
    )
    env.reset(options={"task": MATH})
    _, info = step(env, design('system = ToolAgent("loop", "ALWAYS-CODE", max_turns=2)'))
    run = info["executions"][0]
    assert run["error"] is None and "```python" in run["answer"]  # its last reply stands
    calls = scripted.store.rollout(run["rollout_id"])
    assert len(calls) == 3  # max_turns runs, then one more turn
    first, second = calls[1].messages[-1]["content"], calls[2].messages[-1]["content"]
    assert first.startswith("Output:\n1")
    assert "budget of 1 tool runs is spent" in second  # the gate refused the second run
    assert second.endswith(mas.blocks.FINAL_PROMPT)


def test_tool_calls_parse_or_explain_themselves() -> None:
    from masenvs.mas.blocks import tool_call

    assert tool_call("```python\nprint(2)\n```") == ("python", {"code": "print(2)\n"})
    assert tool_call("```python\nprint(2)\n```\nso \\boxed{2}") is None  # an answer
    assert tool_call("<solution>\nprint(2)\n</solution>") is None
    assert tool_call('<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>') == (
        "f",
        {"x": 1},
    )
    assert tool_call("<tool_call>{not json</tool_call>") == ("", {})
    assert tool_call("just text") is None
    with pytest.raises(ValueError, match="max_turns"):
        mas.ToolAgent("a", max_turns=0)


# --- the published `workflow` API, unchanged -------------------------------------------------

# Written the way the released designer writes its scripts (imports, a ToolRegistry with
# python_execute, nodes, `workflow = Workflow(...)`, `workflow.run(question)`, printing the
# result), not copied from them.
ENSEMBLE_THEN_CHECK = """
import os
import sys

from workflow import AgentNode, Workflow, ToolRegistry
from workflow.nodes import EnsembleNode, ReflectionNode
from utils.environments.math_env import MathEnvironment

question = "What is 6 * 7?"

math_env = MathEnvironment(timeout=60)
tool_registry = ToolRegistry()
tool_registry.register(
    name="python_execute",
    func=math_env.execute,
    description="Run Python code and return what it prints.",
    parameters={
        "type": "object",
        "properties": {"code": {"type": "string", "description": "Self-contained code"}},
        "required": ["code"],
    },
)

calculator = AgentNode(
    name="Calculator",
    system_prompt="Compute the answer with Python code.",
    tool_registry=tool_registry,
    max_turns=3,
)
reasoner = AgentNode(
    name="Reasoner",
    system_prompt="Reason step by step, checking arithmetic with Python.",
    tool_registry=tool_registry,
    max_turns=3,
)
judge = AgentNode(name="Judge", system_prompt="Decide which answer is right.", max_turns=2)
ensemble = EnsembleNode(
    name="Solvers",
    agents=[calculator, reasoner],
    strategy="majority_vote",
    consensus_agent=judge,
)
checker = AgentNode(
    name="Checker",
    system_prompt="Verify the answer independently.",
    tool_registry=tool_registry,
    max_turns=2,
)
reflection = ReflectionNode(name="Verification", agent=checker, num_iterations=1)

workflow = Workflow(name="ensemble_then_check")
workflow.add_nodes([ensemble, reflection])

print("Starting workflow...")
try:
    result = workflow.run(question)
    print("FINAL ANSWER:")
    print(result.content)
except Exception as e:
    print(f"Error during workflow execution: {e}")
    sys.exit(1)
"""

GRAPH_WITH_LOOP = """
from workflow import AgentGraph, AgentNode, ConditionalWorkflow, LoopWorkflow
from workflow.core import MessageType

question = os.environ.get("WORKFLOW_QUESTION", "What is 6 * 7?")

solver = AgentNode(name="Solver", system_prompt="Solve the problem.", max_turns=2)
critic = AgentNode(name="Critic", system_prompt="Say CORRECT or point out the error.", max_turns=1)
fixer = AgentNode(name="Fixer", system_prompt="Fix the solution.", max_turns=1)

graph = AgentGraph(name="solve_and_review", max_steps=6)
graph.add_node("solve", solver)
graph.add_node("review", critic)
graph.add_node("fix", fixer)
graph.add_edge("solve", "review")
graph.add_conditional_edges(
    "review",
    lambda ctx: "fix" if "CORRECT" not in str(ctx.get_latest_message().content) else "done",
)
graph.add_edge("fix", "review")
graph.set_entry_point("solve")
graph.set_finish_point("fix")

refine = LoopWorkflow(name="refine", max_iterations=2)
refine.add_node(AgentNode(name="Refiner", system_prompt="Improve the answer.", max_turns=1))
refine.set_loop_condition(
    lambda ctx: "\\\\boxed" not in str(ctx.get_latest_message(MessageType.AGENT_RESPONSE).content)
)

draft = graph.run(question)
polished = refine.run(str(draft.content))

workflow = ConditionalWorkflow(name="finish")
workflow.add_node(AgentNode(name="Finisher", system_prompt="State the final answer.", max_turns=1))
workflow.add_node(
    AgentNode(name="Skipped", system_prompt="Never runs."), condition=lambda ctx: False
)
result = workflow.run(question + "\\n\\nDraft: " + str(polished.content))
print(result.content)
"""


def designer_reply(script: str) -> str:
    """A design in the released designer's output format: its analysis, then the code."""
    return (
        "<think>\nProblem Type: MATH\nWorkflow Pattern: math_ensemble_then_reflection\n</think>\n"
        f"<code>\n```python\n{script}\n```\n</code>"
    )


def test_a_workflow_api_script_runs_unchanged_its_nodes_use_the_sandboxed_tool(scripted) -> None:
    env = masenvs.make("auto_mas", endpoint_url=scripted.url, executions=2, max_rounds=1)
    env.reset(options={"task": MATH})
    reward, info = step(env, designer_reply(ENSEMBLE_THEN_CHECK))
    assert info["error"] is None, info["executions"]
    assert reward == pytest.approx(1.05) and info["success"]
    graph = info["graph"]
    assert graph["structure"] == (
        "Workflow(EnsembleNode(Calculator, Reasoner, judge=Judge), "
        "ReflectionNode(Checker, iterations=1))"
    )
    by_name = {n["name"]: n for n in graph["nodes"]}
    assert set(by_name) == {"Calculator", "Reasoner", "Judge", "Checker"}
    assert by_name["Judge"]["calls"] == []  # unanimous vote: the judge is not asked
    assert by_name["Calculator"]["system"].startswith("Compute the answer with Python code.")
    calls = scripted.store.rollout(info["captured"][0]["rollout_id"])
    assert {c.step for c in calls} == {"Calculator", "Reasoner", "Checker"}  # node = trace step
    assert sum(len(by_name[n]["calls"]) for n in by_name) == len(calls)
    # Each AgentNode ran its ```python block in the sandbox and saw the output.
    tool_turns = [c for c in calls if c.messages[-1]["content"].startswith("Output:\n42")]
    assert {c.step for c in tool_turns} == {"Calculator", "Reasoner", "Checker"}
    system = calls[0].messages[0]["content"]
    assert "<delivery>" in system and "FINAL ANSWER: \\boxed{" in system  # as the original


def test_workflow_graphs_loops_and_conditions_run_on_the_tiny_model(served) -> None:
    env = masenvs.make(
        "auto_mas",
        endpoint_url=served.url,
        executions=1,
        max_rounds=1,
        max_tokens=8,
        max_calls=24,
    )
    script = "import os\n" + GRAPH_WITH_LOOP
    steps = []
    for action in (designer_reply(script), designer_reply(ENSEMBLE_THEN_CHECK)):
        env.reset(options={"task": MATH})
        _, info = step(env, action)
        run = info["executions"][0]
        assert run["error"] is None and run["answer"], run
        calls = served.store.rollout(run["rollout_id"])
        assert calls and {c.agent for c in calls} == {"executor"}
        assert run["calls"] == len(calls)
        nodes = {n["name"]: n["calls"] for n in info["graph"]["nodes"]}
        assert sorted(i for ids in nodes.values() for i in ids) == sorted(c.id for c in calls)
        steps.append({c.step for c in calls})
    assert {"Solver", "Critic", "Refiner", "Finisher"} <= steps[0] and "Skipped" not in steps[0]
    assert {"Calculator", "Reasoner", "Checker"} <= steps[1]


# --- a mixed math + code task source ---------------------------------------------------------


def code_file(path, prefix: str, n: int = 3):
    rows = [
        {
            "id": f"{prefix}-{i}",
            "prompt": f"Print {i}.",
            "tests": [{"input": "", "output": f"{i}\n"}],
        }
        for i in range(n)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f"jsonl:{path}"


def test_a_mixed_source_draws_math_and_code_at_its_ratios(tmp_path) -> None:
    apps, contests = code_file(tmp_path / "a.jsonl", "a"), code_file(tmp_path / "b.jsonl", "b")
    env = masenvs.make(
        "auto_mas", task="mixed", math_ratio=0.25, code_sources={apps: 0.7, contests: 0.3}
    )
    kinds, origins = Counter(), Counter()
    for seed in range(1500):
        env.reset(seed=seed)
        kind = env.task_info()["kind"]
        kinds[kind] += 1
        if kind == "code":
            origins[env.task.id[0]] += 1
            assert "<solution>" in env.question()  # code tasks say how to answer
    assert abs(kinds["math"] / 1500 - 0.25) < 0.04, kinds
    assert abs(origins["a"] / kinds["code"] - 0.7) < 0.05, origins
    ids = []
    for seed in (3, 4, 3):
        env.reset(seed=seed)
        ids.append(env.task.id)
    assert ids[0] == ids[2]  # a seed gives the same task
    assert env.source.name == f"mixed(generated:0.25, {apps}:0.52, {contests}:0.22)"


def test_mixed_sources_are_checked_and_selectable_from_a_train_config(tmp_path) -> None:
    from masenvs.tasks.mixed import MixedSource, mixed_math_code
    from masenvs.trainer.config import load_config
    from masenvs.trainer.rollout.sources import env_factory

    with pytest.raises(ValueError, match="not source"):
        masenvs.make("auto_mas", task="mixed", source="generated")
    with pytest.raises(ValueError, match="for task: mixed"):
        masenvs.make("auto_mas", math_ratio=0.5, code_sources={"builtin": 1})
    with pytest.raises(ValueError):
        masenvs.make("auto_mas", task="mixed", math_ratio=1.5)
    with pytest.raises(ValueError, match="must not all be 0"):
        MixedSource(((object(), 0.0),))
    with pytest.raises(ValueError, match=">= 0"):
        MixedSource(((object(), -1.0),))
    with pytest.raises(ValueError, match="between 0 and 1"):
        mixed_math_code(object(), [(object(), 1.0)], math_ratio=2)
    cfg = load_config(
        ROOT / "examples" / "auto_mas.yaml",
        ["env.options.task=mixed", "env.options.math_ratio=0.5", f"run_dir={tmp_path}"],
    )
    env = env_factory(cfg)()
    assert env.source.name == "mixed(generated:0.50, builtin:0.50)"
    kinds = set()
    for seed in range(40):
        env.reset(seed=seed)
        kinds.add(env.task_info()["kind"])
    assert kinds == {"math", "code"}


OWN_TOOL = """
from workflow import AgentNode, ToolRegistry, Workflow

def lookup(key):
    return {"product": "42"}[key]

registry = ToolRegistry()
registry.register("lookup", lookup, "Look a value up.", {"type": "object"})
workflow = Workflow(name="lookup")
workflow.add_node(AgentNode(name="Finder", system_prompt="USE-LOOKUP", tool_registry=registry))
result = workflow.run("What is 6 * 7?")
print(result.content)
"""


@pytest.mark.parametrize(
    ("script", "cause"),
    [
        (
            "from workflow import AgentGraph, AgentNode\n"
            "g = AgentGraph()\ng.add_node('a', AgentNode(name='A', system_prompt='x'))\n"
            "g.run('q')",
            "error: ValueError: Entry point not set",
        ),
        (
            "from workflow import AgentNode, LoopWorkflow\n"
            "w = LoopWorkflow(max_iterations=50)\n"
            "w.add_node(AgentNode(name='A', system_prompt='ALWAYS-CODE', max_turns=1))\n"
            "w.set_loop_condition(lambda ctx: True)\nw.run('q')",
            "budget: the design made more than 4 LLM calls",
        ),
        ("import workflow\nprint('no run, no answer')\nraise SystemExit(3)", "exited with 3"),
    ],
)
def test_a_failing_workflow_script_scores_zero_with_its_cause(scripted, script, cause) -> None:
    env = masenvs.make(
        "auto_mas", endpoint_url=scripted.url, executions=1, max_rounds=1, max_calls=4
    )
    env.reset(options={"task": MATH})
    reward, info = step(env, designer_reply(script))
    assert reward == 0.0 and cause in info["error"], info["error"]


@pytest.mark.parametrize(
    "imports",
    [
        "from workflow import AgentNode, ToolRegistry, Workflow",
        # the import path the published harness rewrites designs to
        "from pettingllms.multi_agent_env.autoevol.workflow import AgentNode, ToolRegistry, "
        "Workflow",
    ],
)
def test_a_workflow_node_calls_the_designs_own_registered_tool(scripted, imports) -> None:
    env = masenvs.make("auto_mas", endpoint_url=scripted.url, executions=1, max_rounds=1)
    env.reset(options={"task": MATH})
    script = OWN_TOOL.replace("from workflow import AgentNode, ToolRegistry, Workflow", imports)
    reward, info = step(env, designer_reply(script))
    assert reward == pytest.approx(1.05), info["executions"]
    calls = scripted.store.rollout(info["captured"][0]["rollout_id"])
    assert calls[1].messages[-1]["content"] == "Tool 'lookup' returned:\n42"


TWO_NODES = """
from workflow import AgentNode, Workflow

solver = AgentNode(name="Solver", system_prompt="Solve it.", max_turns=1)
checker = AgentNode(name="Checker", system_prompt="Check it.", max_turns=1)
workflow = Workflow(name="solve_check")
workflow.add_nodes([solver, checker])
result = workflow.run("What is 2 + 2?")
print(result.content)
"""


def test_a_training_step_learns_from_the_calls_of_workflow_api_nodes(tmp_path, monkeypatch):
    # The tiny model writes noise, never a design: its replies are swapped for a script
    # written against the published API, whose nodes' calls become executor samples.
    import masenvs.envs.auto_mas as auto_mas
    from masenvs.trainer.config import load_config
    from masenvs.trainer.run.train import train

    monkeypatch.setattr(auto_mas, "extract_design", lambda text: TWO_NODES)
    cfg = load_config(
        ROOT / "examples" / "auto_mas.yaml",
        [
            "model.name=tiny",
            f"run_dir={tmp_path / 'run'}",
            "steps=1",
            "schedule.every=1",
            "validation.every=0",
            "rollout.tasks_per_step=1",
            "env.options.max_tokens=6",
            "rollout.max_tokens=8",
        ],
    )
    result = train(cfg)
    rows = [
        json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    (trained,) = [r for r in rows if r.get("step") == 1]
    assert trained["train/captured_runs"] == 4  # 2 designs x 2 runs
    assert trained["learner/executor/samples"] == 8  # 4 runs x 2 nodes (one call each)
    designs = [
        json.loads(line) for line in (result.run_dir / "designs.jsonl").read_text().splitlines()
    ]
    assert {d["graph"]["structure"] for d in designs} == {"Workflow(Solver, Checker)"}


def test_a_workflow_script_on_a_code_task_delivers_a_solution_the_tests_judge(scripted) -> None:
    task = {
        "id": "add",
        "prompt": "Read two integers and print their sum.",
        "tests": [{"input": "1 2\n", "output": "3\n"}, {"input": "5 5\n", "output": "10\n"}],
    }
    script = TWO_NODES.replace("What is 2 + 2?", "Read two integers and print their sum.")
    env = masenvs.make("auto_mas", task="code", endpoint_url=scripted.url, executions=1)
    env.reset(options={"task": task})
    reward, info = step(env, designer_reply(script))
    assert reward == pytest.approx(1.05), info["executions"]
    calls = scripted.store.rollout(info["captured"][0]["rollout_id"])
    # TASK_TYPE=code: each node is told to answer in <solution>, and the second node sees
    # the first one's <delivery>, as in the published system.
    assert all("<solution>" in c.messages[0]["content"] for c in calls)
    assert "read two integers, print the sum" in calls[1].messages[-1]["content"]
