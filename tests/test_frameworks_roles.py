"""Role mode: a framework program plays one env role inside `run_episode`, unchanged.

plan_path has two roles, `tool` and `plan`. A LangGraph graph, an AutoGen agent or a
LlamaIndex agent plays `plan`; `tool` stays with `ChatPolicy`. The framework's final text
must be the action the env received, and its calls must be in the episode's trace under
the role's name.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from framework_support import random_lora, serve

from masenvs.adapters.episodes import run_episode
from masenvs.adapters.frameworks import ClientSettings, FrameworkRole, RolePolicy, RunLimits
from masenvs.adapters.policy import Sampling
from masenvs.engine.engine import EmbeddedBackend
from masenvs.registry import make

SETTINGS = ClientSettings(sampling=Sampling(max_tokens=12))
PLANNER_PROMPT = "You are the planner of a LangGraph graph."


@pytest.fixture(scope="module")
def backend() -> Iterator[EmbeddedBackend]:
    engine = EmbeddedBackend.from_spec("tiny", max_batch_size=32, max_model_len=1024)
    random_lora(engine, "plan_lora", seed=5)
    yield engine
    engine.shutdown()


def langgraph_planner(client):
    from langchain_core.messages import SystemMessage
    from langgraph.graph import END, START, MessagesState, StateGraph

    async def plan(state: MessagesState) -> dict:
        return {
            "messages": [await client.ainvoke([SystemMessage(PLANNER_PROMPT), *state["messages"]])]
        }

    graph = StateGraph(MessagesState)
    graph.add_node("plan", plan)
    graph.add_edge(START, "plan")
    graph.add_edge("plan", END)
    return graph.compile()


def autogen_planner(client):
    from autogen_agentchat.agents import AssistantAgent

    return AssistantAgent("plan", model_client=client, system_message=PLANNER_PROMPT)


def llamaindex_planner(client):
    from llama_index.core.agent.workflow import FunctionAgent

    return FunctionAgent(
        name="plan", description="Plans.", llm=client, system_prompt=PLANNER_PROMPT
    )


PLANNERS = {
    "langgraph": langgraph_planner,
    "autogen": autogen_planner,
    "llamaindex": llamaindex_planner,
}


@pytest.mark.parametrize("framework", list(PLANNERS))
def test_a_framework_plays_one_role_and_chat_policy_the_other(backend, tmp_path, framework) -> None:
    env = make("plan_path", max_rounds=2)
    with serve(backend, tmp_path, policy_map={"plan": "plan_lora"}) as served:

        async def episode():
            policy = RolePolicy(
                served.url,
                {"plan": FrameworkRole(framework, PLANNERS[framework])},
                settings=SETTINGS,
                store=served.store,
            )
            try:
                return await run_episode(env, policy, seed=3, rollout_id="ep", store=served.store)
            finally:
                await policy.aclose()

        result = asyncio.run(episode())
        calls = served.store.rollout("ep")

    assert result.error is None and result.rounds == 2
    plan_calls = [c for c in calls if c.agent == "plan"]
    tool_calls = [c for c in calls if c.agent == "tool"]
    assert [c.call_index for c in plan_calls] == [0, 1]
    assert [c.call_index for c in tool_calls] == [0, 1]
    assert {c.model for c in plan_calls} == {"plan_lora"}  # the role's adapter served it
    # The plan calls came from the framework program (its system prompt), the tool calls
    # from ChatPolicy (the env's prompt as is).
    assert all(c.messages[0]["content"] == PLANNER_PROMPT for c in plan_calls)
    assert all(PLANNER_PROMPT not in str(c.messages) for c in tool_calls)
    # The framework's final text is the action the env got, round by round.
    assert [a["plan"] for a in result.actions] == [c.choices[0].text for c in plan_calls]
    assert result.completion_tokens == sum(len(c.choices[0].token_ids) for c in calls)


def test_n_candidates_run_the_program_n_times(backend, tmp_path) -> None:
    env = make("plan_path")
    _, infos = env.reset(seed=0)
    with serve(backend, tmp_path) as served:

        async def act():
            policy = RolePolicy(
                served.url,
                {"plan": FrameworkRole("langgraph", langgraph_planner)},
                settings=SETTINGS,
            )
            try:
                return await policy.act_all("cands", infos, n=3)
            finally:
                await policy.aclose()

        replies = asyncio.run(act())
        calls = served.store.rollout("cands")
    assert len(replies["plan"]) == len(replies["tool"]) == 3
    plan_calls = [c for c in calls if c.agent == "plan"]
    assert sorted(c.call_index for c in plan_calls) == [0, 1, 2]
    assert sorted(r.text for r in replies["plan"]) == sorted(c.choices[0].text for c in plan_calls)


def broken_planner(client):
    async def run(messages: list[dict]) -> str:
        await client.ainvoke(messages)
        raise RuntimeError("the planner's graph broke")

    return run


def test_a_failing_role_ends_its_episode_and_the_next_one_runs(backend, tmp_path, caplog) -> None:
    with serve(backend, tmp_path) as served:

        async def episodes(on_failure: str):
            policy = RolePolicy(
                served.url,
                {"plan": FrameworkRole("langgraph", broken_planner, RunLimits(timeout_s=60))},
                settings=SETTINGS,
                on_failure=on_failure,
            )
            try:
                first = await run_episode(make("plan_path", max_rounds=2), policy, seed=0)
                second = await run_episode(make("plan_path", max_rounds=2), policy, seed=1)
                return first, second
            finally:
                await policy.aclose()

        raised = asyncio.run(episodes("raise"))
        played = asyncio.run(episodes("empty"))

    for result in raised:  # each episode ends at its first round, with the reason
        assert result.rounds == 0
        assert "role 'plan' failed: RuntimeError: the planner's graph broke" in result.error
    assert "the planner's graph broke" in caplog.text
    for result in played:  # the role's action is empty: the env's invalid answer
        assert result.error is None and result.rounds == 2
        assert all(a["plan"] == "" for a in result.actions)
        assert result.rewards["plan"] <= 2 * make("plan_path").config.format_penalty + 1e-9


def test_a_blocking_candidate_times_out_alone(backend, tmp_path) -> None:
    """Role mode runs each act in its own thread too: of n concurrent candidates, the one
    whose node blocks times out on time, and the other answers."""
    import time

    block_next = [False]

    def blocking_planner(client):
        from langgraph.graph import END, START, MessagesState, StateGraph

        blocks, block_next[0] = block_next[0], False

        async def plan(state: MessagesState) -> dict:
            if blocks:
                time.sleep(8)  # the user meant `await asyncio.sleep(8)`
            return {"messages": [await client.ainvoke(state["messages"])]}

        graph = StateGraph(MessagesState)
        graph.add_node("plan", plan)
        graph.add_edge(START, "plan")
        graph.add_edge("plan", END)
        return graph.compile()

    env = make("plan_path")
    _, infos = env.reset(seed=0)
    messages = infos["plan"]["messages"]
    with serve(backend, tmp_path) as served:
        role = FrameworkRole("langgraph", blocking_planner, RunLimits(timeout_s=5))
        policy = RolePolicy(served.url, {"plan": role}, settings=SETTINGS, on_failure="empty")
        asyncio.run(policy.act("r-warm", "plan", messages))  # imports, outside the timing
        block_next[0] = True
        started = time.perf_counter()
        replies = asyncio.run(policy.act("r-block", "plan", messages, n=2))
        elapsed = time.perf_counter() - started
    assert elapsed < 8
    assert sorted(bool(r.text) for r in replies) == [False, True]  # "" for the timed-out one
