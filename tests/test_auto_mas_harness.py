"""`harness: published` of the auto_mas env: the inputs the authors' MetaAgent-X harness
gives a model, and the designs it can run, so that a designer trained here learns designs
their harness runs and the released model sees the prompts it was trained on.

Every expected text below is written from the authors' code (pettingllms-ai/PettingLLMs at
a054fb1, MIT; paths under pettingllms/multi_agent_env/autoevol/), never from our output.
Real endpoint, real gate, real sandbox, a scripted policy."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from framework_support import serve
from test_mas_published import ScriptedBackend

import masenvs
from masenvs.engine.protocol import GenerateRequest, Generation

MATH = {"id": "six-times-seven", "question": "What is 6 * 7?", "answer": "42"}

# gen_agent.py:123-124 (MASGenerator.update_from_env)
DESIGNER_SYSTEM = "You are an expert Python developer specializing in multi-agent workflow systems."
DESIGNER_USER = "Design Multi Agent System for the Question: What is 6 * 7?"
# workflow/nodes/agent_node.py:20-25 (DELIVERY_INSTRUCTION_MATH), appended to every AgentNode
DELIVERY_MATH = (
    "\n\nAfter solving, output two things:\n"
    "1. Wrap the key reasoning steps you want to share with the next agent "
    "in <delivery>...</delivery> tags.\n"
    "2. State your final answer as: FINAL ANSWER: \\boxed{your_answer}"
)
# agent_node.py:527: the forced final call after max_turns + 1 calls (math)
FORCE_FINAL_MATH = "Please provide your final answer now without using any tools."
# utils/environments/math_env.py:91-96: what a run of the Python tool shows the model
TOOL_OK = "Code executed successfully.\nOutput: {}"


def policy(messages: list[dict[str, Any]]) -> str:
    """Writes Python when its system prompt mentions Python, answers from a tool output,
    and (ALWAYS-CODE) states an answer and code in the same reply."""
    system = messages[0]["content"] if messages[0]["role"] == "system" else ""
    last = messages[-1]["content"]
    if "ALWAYS-CODE" in system:
        return "FINAL ANSWER: \\boxed{1}\n```python\nprint(1)\n```"
    printed = re.search(r"Output:\s*(\S+)", last)
    if printed or last == FORCE_FINAL_MATH:
        value = printed.group(1) if printed else "1"
        return f"<delivery>ran it</delivery>\nFINAL ANSWER: \\boxed{{{value}}}"
    if "Python" in system:
        return "Let me compute it.\n```python\nprint(6 * 7)\n```"
    return "<delivery>6 * 7 = 42</delivery>\nFINAL ANSWER: \\boxed{42}"


class Recording(ScriptedBackend):
    """The scripted policy, keeping each call's sampling parameters."""

    def __init__(self) -> None:
        super().__init__(policy)
        self.params: list[Any] = []

    async def generate(self, request: GenerateRequest) -> Generation:
        self.params.append(request.params)
        return await super().generate(request)


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    backend = Recording()
    policies = {"executor": "base", "designer": "base"}
    with serve(backend, tmp_path_factory.mktemp("h") / "traces", policy_map=policies) as s:
        s.backend = backend
        yield s


def env_for(url: str, harness: str, **options: Any):
    env = masenvs.make(
        "auto_mas", endpoint_url=url, executions=1, harness=harness, max_rounds=1, **options
    )
    env.reset(options={"task": MATH})
    return env


def run(env, body: str) -> dict[str, Any]:
    _, _, _, _, infos = env.step({"designer": f"My design.\n<code>\n{body}\n</code>"})
    return infos["designer"]


def calls_of(served, info: dict[str, Any]) -> list[Any]:
    """The execution's calls in the order they were made."""
    calls = served.store.rollout(info["executions"][0]["rollout_id"])
    return sorted(calls, key=lambda c: c.started_at)


TOOLS = """
from workflow import AgentNode, Workflow, AgentGraph, ToolRegistry
from workflow.nodes import EnsembleNode
from utils.environments.math_env import MathEnvironment

math_env = MathEnvironment(timeout=60)
tools = ToolRegistry()
tools.register(
    name="python_execute",
    func=math_env.execute,
    description="Run Python code.",
    parameters={"type": "object", "properties": {"code": {"type": "string"}}},
)
"""

# The audit's graph design (paper-audit-2026-12-07.md, "my_graph_design.py"): an ensemble of
# a tool solver and a tool-less one with a judge, then a finalizer; here as a `workflow`.
VOTE_THEN_FINAL = """
solver_a = AgentNode(name="SolverA", system_prompt="You compute answers with Python.",
                     tool_registry=tools, max_turns=3)
solver_b = AgentNode(name="SolverB", system_prompt="You reason step by step.", max_turns=3)
judge = AgentNode(name="Judge", system_prompt="Pick the right answer.", max_turns=1)
vote = EnsembleNode(name="vote", agents=[solver_a, solver_b], strategy="majority_vote",
                    consensus_agent=judge)
final = AgentNode(name="Finalizer", system_prompt="Give the final answer.", max_turns=1)
"""

SOLO = """
from workflow import AgentGraph, AgentNode, LoopWorkflow, Workflow
final = AgentNode(name="Finalizer", system_prompt="Give the final answer.", max_turns=1)
vote = final
"""

AS_WORKFLOW = """
workflow = Workflow(name="vote_then_final")
workflow.add_nodes([vote, final])
result = workflow.run("What is 6 * 7?")
print(result.content)
"""

AS_GRAPH = """
graph = AgentGraph(name="vote_then_final")
graph.add_node("vote", vote)
graph.add_node("final", final)
graph.add_edge("vote", "final")
graph.set_entry_point("vote")
graph.set_finish_point("final")
result = graph.run("What is 6 * 7?")
print(result.content)
"""


def test_the_designer_is_prompted_as_the_published_designer(scripted) -> None:
    def seen(harness: str) -> list[dict[str, str]]:
        env = env_for(scripted.url, harness)
        _, infos = env.reset(options={"task": MATH})
        return infos["designer"]["messages"]

    assert seen("published") == [
        {"role": "system", "content": DESIGNER_SYSTEM},
        {"role": "user", "content": DESIGNER_USER},
    ]
    assert seen("masenvs")[0]["content"] != DESIGNER_SYSTEM  # our default: the block library


def test_the_audit_design_makes_4_calls_as_published_and_6_with_ours(scripted) -> None:
    published = run(env_for(scripted.url, "published"), TOOLS + VOTE_THEN_FINAL + AS_WORKFLOW)
    ours = run(env_for(scripted.url, "masenvs"), TOOLS + VOTE_THEN_FINAL + AS_WORKFLOW)
    assert published["error"] is None and ours["error"] is None, (published, ours)
    assert published["executions"][0]["correctness"] == 1.0
    # SolverA: code, then its answer; SolverB and the Finalizer: one answer each (no node is
    # told to use Python but the one whose designer said so). Ours tells every node.
    assert published["executions"][0]["calls"] == 4
    assert ours["executions"][0]["calls"] == 6
    calls = calls_of(scripted, published)
    systems = [c.messages[0]["content"] for c in calls]
    assert systems == [
        "You compute answers with Python." + DELIVERY_MATH,
        "You compute answers with Python." + DELIVERY_MATH,
        "You reason step by step." + DELIVERY_MATH,
        "Give the final answer." + DELIVERY_MATH,
    ]
    assert calls[1].messages[-1] == {"role": "user", "content": TOOL_OK.format(42)}
    # agent_node.py:326-347: what the finalizer reads of the earlier agents
    assert (
        calls[3]
        .messages[-1]["content"]
        .endswith(
            "Based on the original question and the analysis above, provide your own solution."
        )
    )


def test_agent_graph_and_other_workflow_names_fail_as_in_the_published_harness(scripted) -> None:
    def published(body: str) -> dict[str, Any]:
        info = run(env_for(scripted.url, "published"), body)
        assert info["executions"][0]["calls"] == 0 and info["error"] is not None, info
        return info

    # agent_node.py:547-548: an AgentGraph never puts a workflow in the context, so each
    # node fails; the audit's graph design printed {'error': 'All agents failed'} there
    assert "All agents failed" in published(TOOLS + VOTE_THEN_FINAL + AS_GRAPH)["error"]
    single = SOLO + AS_GRAPH  # one node, under two names
    error = published(single)["error"]
    assert "'NoneType' object has no attribute 'ai_client'" in error
    # gen_agent.py:575: only `workflow = Workflow(...)` is given the harness's client
    error = published(SOLO + AS_WORKFLOW.replace("workflow", "pipeline"))["error"]
    assert "'NoneType' object has no attribute 'chat'" in error
    # ours runs all three
    for body in (
        TOOLS + VOTE_THEN_FINAL + AS_GRAPH,
        single,
        SOLO + AS_WORKFLOW.replace("workflow", "pipeline"),
    ):
        assert run(env_for(scripted.url, "masenvs"), body)["error"] is None


@pytest.mark.parametrize(
    ("body", "error"),
    [
        # a masenvs blocks design: their harness has no blocks in scope
        ('system = Agent("solver", "Solve it.")', "NameError: name 'Agent' is not defined"),
        # workflow.py:206-260, 295-355: these runs put no workflow in the context
        (
            SOLO + 'workflow = LoopWorkflow(name="w", max_iterations=1)\n'
            "workflow.add_node(final)\nworkflow.set_loop_condition(lambda c: False)\n"
            'print(workflow.run("What is 6 * 7?").content)',
            "'NoneType' object has no attribute 'ai_client'",
        ),
        # gen_agent.py:575-590: the patch matches `math_workflow = Workflow(`, then names
        # `workflow`, which the script never defined
        (
            SOLO + AS_WORKFLOW.replace("workflow", "math_workflow"),
            "NameError: name 'workflow' is not defined",
        ),
    ],
)
def test_other_design_forms_fail_as_in_the_published_harness(scripted, body, error) -> None:
    info = run(env_for(scripted.url, "published"), body)
    assert info["error"] is not None and error in info["error"], info
    assert info["executions"][0]["calls"] == 0


def test_a_reply_with_code_is_always_run_and_a_final_call_is_forced(scripted) -> None:
    body = """
from workflow import AgentNode, Workflow
looper = AgentNode(name="Looper", system_prompt="ALWAYS-CODE", max_turns=1)
workflow = Workflow(name="loop")
workflow.add_node(looper)
print(workflow.run("What is 6 * 7?").content)
"""
    info = run(env_for(scripted.url, "published"), body)
    calls = calls_of(scripted, info)
    # agent_node.py:406-530: max_turns + 1 calls, each reply's code run although it also
    # states FINAL ANSWER, then one forced final call
    assert len(calls) == 3, info
    assert calls[1].messages[-1] == {"role": "user", "content": TOOL_OK.format(1)}
    assert calls[2].messages[-1] == {"role": "user", "content": FORCE_FINAL_MATH}
    ours = run(env_for(scripted.url, "masenvs"), body)
    assert ours["executions"][0]["calls"] == 1  # ours: a stated answer ends the node


def test_a_fence_inside_a_prompt_string_is_extracted_as_published(scripted) -> None:
    # paper-audit-2026-12-07.md 5a.i: the audit's my_design.py failed only here
    body = """from workflow import AgentNode, Workflow
solver = AgentNode(name="Solver", system_prompt="Write a ```python block, then answer.",
                   max_turns=2)
workflow = Workflow(name="solve")
workflow.add_node(solver)
print(workflow.run("What is 6 * 7?").content)"""
    published = run(env_for(scripted.url, "published"), body)
    assert published["design"] == body and published["error"] is None, published
    ours = run(env_for(scripted.url, "masenvs"), body)
    assert ours["error"] is not None and ours["error"].startswith("syntax error"), ours


@pytest.mark.parametrize(
    ("reply", "code"),
    [
        # gen_agent.py:133-146: inside <code>, the first ```python block
        ("<code>\n```python\nx = 1\n```\n```python\ny = 2\n```\n</code>", "x = 1"),
        # gen_agent.py:141-146: a body with a single fence is taken whole
        ('<code>\np = "a ```python fence"\n</code>', 'p = "a ```python fence"'),
        # gen_agent.py:149-153: no tags: the last ```python block of the reply
        ("```python\na = 1\n```\ntext\n```python\nb = 2\n```", "b = 2"),
        # gen_agent.py:155-159: then the last plain ``` block
        ("```\nc = 3\n```", "c = 3"),
        # gen_agent.py:65-104: raw workflow code, cut at the model's afterthought
        (
            "Plan.\nfrom workflow import Workflow\nworkflow = Workflow(name='w')\n"
            "r = workflow.run('q')\nWait, maybe more.",
            "from workflow import Workflow\nworkflow = Workflow(name='w')\nr = workflow.run('q')",
        ),
        ("no code at all", None),
    ],
)
def test_design_extraction_follows_the_published_strategies(reply: str, code: str | None) -> None:
    from masenvs.mas.compat.published import extract_design

    assert extract_design(reply) == code


def test_executors_sample_greedily_with_repetition_penalty_1_2(scripted) -> None:
    env = env_for(scripted.url, "published")
    assert env.config.temperature == 0.0 and env.config.repetition_penalty == 1.2
    before = len(scripted.backend.params)
    body = TOOLS + VOTE_THEN_FINAL + AS_WORKFLOW
    assert run(env, body)["error"] is None
    sampled = scripted.backend.params[before:]
    assert sampled and all(p.temperature == 0.0 for p in sampled)
    assert all(
        p.repetition_penalty == pytest.approx(1.2) for p in sampled
    )  # async_generate.py:451-458


def test_the_published_harness_asks_for_one_design() -> None:
    assert masenvs.make("auto_mas", harness="published").config.max_rounds == 1
    with pytest.raises(ValueError, match="max_rounds"):
        masenvs.make("auto_mas", harness="published", max_rounds=2)
    assert masenvs.make("auto_mas").config.harness == "masenvs"


# --- the authors' SFT: loss on every token, LoRA r64 / alpha 16 --------------------------------


def test_sft_loss_on_all_tokens_learns_the_prompt_too() -> None:
    from masenvs.engine.loading import load_tokenizer
    from masenvs.trainer.commands.sft import Conversation, targets

    tokenizer = load_tokenizer("tiny")
    messages = [
        {"role": "system", "content": DESIGNER_SYSTEM},
        {"role": "user", "content": DESIGNER_USER},
        {"role": "assistant", "content": "<code>\nprint(42)\n</code>"},
    ]
    conversation = Conversation("designer", messages, "x:1")
    # sft_train/train_sft.py:145-176: the conversation rendered whole, labels = input_ids
    whole = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
    (target,), cut = targets(conversation, tokenizer, {}, 4096, loss_on="all")
    assert cut == 0
    assert target.prompt_token_ids + target.completion_token_ids == list(whole)
    assert len(target.prompt_token_ids) == 1  # every token after the first is a label
    (reply,), _ = targets(conversation, tokenizer, {}, 4096)  # ours: the reply only
    assert len(reply.completion_token_ids) < len(target.completion_token_ids) // 2


def test_sft_flags_set_the_authors_lora_shape() -> None:
    from masenvs.trainer.commands.sft import build_parser, overrides

    args = build_parser().parse_args(
        ["cfg.yaml", "d.jsonl", "--loss-on", "all", "--lora-rank", "64", "--lora-alpha", "16"]
    )
    assert args.loss_on == "all"
    assert overrides(args) == ["lora.rank=64", "lora.alpha=16"]
    assert build_parser().parse_args(["c", "d"]).loss_on == "completion"
    assert json.dumps(overrides(build_parser().parse_args(["c", "d"]))) == "[]"


@pytest.mark.learning
def test_the_authors_sft_trains_every_token_with_a_rank_64_adapter(tmp_path) -> None:
    from pathlib import Path

    from safetensors.torch import load_file

    from masenvs.cli import main
    from masenvs.engine.loading import load_tokenizer
    from masenvs.trainer.commands.sft import read_traces

    root = Path(__file__).resolve().parents[1]
    data = tmp_path / "traces.jsonl"
    data.write_text(
        "\n".join((root / "examples/sft/auto_mas_math.jsonl").read_text().split("\n")[:3])
    )
    run = tmp_path / "run"
    flags = ["--loss-on", "all", "--lora-rank", "64", "--lora-alpha", "16", "--lr", "1e-2"]
    config = str(root / "examples" / "auto_mas.yaml")
    args = ["sft", config, str(data), "--set", "model.name=tiny", "--set", f"run_dir={run}"]
    assert main([*args, *flags, "--epochs", "2"]) == 0
    rows = [json.loads(line) for line in (run / "sft_metrics.jsonl").read_text().splitlines()]
    tokenizer = load_tokenizer("tiny")
    whole = [
        len(tokenizer.apply_chat_template(c.messages, tokenize=True, return_dict=False)) - 1
        for c in read_traces([data])
    ]
    # every token of every conversation but its first is a label (train_sft.py:170-173)
    assert sum(r["tokens"] for r in rows if r["epoch"] == 1) == sum(whole)
    first, last = (sum(r["loss"] * r["tokens"] for r in rows if r["epoch"] == e) for e in (1, 2))
    assert last < first
    state = json.loads((run / "checkpoints" / "step_00000000" / "state.json").read_text())
    assert state["extra"]["sft"]["loss_on"] == "all"
    weights = load_file(
        str(run / "checkpoints/step_00000000/adapters/designer/adapter_model.safetensors")
    )
    ranks = {v.shape[0] for k, v in weights.items() if "lora_A" in k}
    assert ranks == {64}  # train_sft.py:64-66: r 64, alpha 16
    saved = (run / "checkpoints" / "step_00000000" / "config.yaml").read_text()
    assert "rank: 64" in saved and "alpha: 16" in saved


# reflection_node.py:82-101
REFLECTION = (
    "You are a critical reviewer. Analyze the following response to a question.\n\n"
    "Original question: {question}\n\n"
    "Response to review:\n{response}\n\n"
    "Provide a thorough critique:\n"
    "1. Identify any errors, inaccuracies, or logical flaws\n"
    "2. Check if the response is complete and addresses all aspects of the question\n"
    "3. Evaluate the clarity and structure of the response\n"
    "4. Suggest specific improvements\n\n"
    "Be constructive but rigorous in your critique."
)
REFINEMENT = (
    "Original question: {question}\n\n"
    "Your previous response:\n{response}\n\n"
    "Critique from reviewer:\n{reflection}\n\n"
    "Based on this critique, provide an improved response that addresses all the issues raised."
)


def test_reflection_and_debate_nodes_speak_in_the_published_words(scripted) -> None:
    answer = "<delivery>6 * 7 = 42</delivery>\nFINAL ANSWER: \\boxed{42}"  # policy()'s
    question = "What is 6 * 7?"
    reflect = """
from workflow import AgentNode, Workflow
from workflow.nodes import ReflectionNode
solver = AgentNode(name="Solver", system_prompt="Solve it.", max_turns=1)
checker = AgentNode(name="Checker", system_prompt="Check it.", max_turns=1)
workflow = Workflow(name="reflect")
workflow.add_node(ReflectionNode(name="r", agent=solver, critic_agent=checker, num_iterations=1))
print(workflow.run("What is 6 * 7?").content)
"""
    info = run(env_for(scripted.url, "published"), reflect)
    calls = calls_of(scripted, info)
    assert [c.messages[-1]["content"] for c in calls] == [
        question,
        REFLECTION.format(question=question, response=answer),
        REFINEMENT.format(question=question, response=answer, reflection=answer),
    ], info
    debate = """
from workflow import AgentNode, Workflow
from workflow.nodes import DebateNode
a = AgentNode(name="A", system_prompt="Argue.", max_turns=1)
b = AgentNode(name="B", system_prompt="Argue.", max_turns=1)
workflow = Workflow(name="debate")
workflow.add_node(DebateNode(name="d", debaters=[a, b], num_rounds=2))
print(workflow.run("What is 6 * 7?").content)
"""
    calls = calls_of(scripted, run(env_for(scripted.url, "published"), debate))
    rounds = f"=== Round 1 ===\nAgent 1 (A):\n{answer}\n\nAgent 2 (B):\n{answer}\n\n"
    # debate_node.py:46-63, 100-106, 146-159
    assert calls[2].messages[-1]["content"] == (
        f"Original question: {question}\n\nPrevious debate rounds:\n\n{rounds}\n"
        "Based on the discussion above, please provide your refined answer. "
        "You may critique other responses and improve your own."
    )
    assert calls[4].messages[-1]["content"] == (
        f"Original question: {question}\n\nAfter 2 rounds of debate, here are the final "
        f"responses:\n\nResponse 1 from A:\n{answer}\n\nResponse 2 from B:\n{answer}\n\n"
        "Please select the best response or synthesize a better answer based on the debate. "
        "Provide your final answer."
    )
