"""A framework tool call round-trips through the endpoint, for each framework.

SmolLM2's chat template renders no tools, so these tests serve a tiny model with a
Hermes-style template (`<tool_call>{...}</tool_call>`) trained to call `add(2, 3)` and then
answer (see framework_support.tool_model_dir). The endpoint parses the call into OpenAI
`tool_calls`; the framework runs the tool and sends its result back in the next call.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import pytest
from framework_support import FINAL_ANSWER, serve, tool_model_dir

from masenvs.adapters.frameworks import Clients, ClientSettings, RunLimits, rollout_url, run_program
from masenvs.adapters.policy import Sampling
from masenvs.engine.engine import EmbeddedBackend

QUESTION = [{"role": "user", "content": "What is 2 + 3?"}]
GREEDY = ClientSettings(sampling=Sampling(temperature=0.0, max_tokens=48))


@pytest.fixture(scope="module")
def backend() -> Iterator[EmbeddedBackend]:
    engine = EmbeddedBackend.from_spec(str(tool_model_dir()), max_model_len=1024)
    yield engine
    engine.shutdown()


class Adder:
    """Records the calls of the `add` tool the frameworks get."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def tool(self):
        def add(a: int, b: int) -> int:
            """Add two integers."""
            self.calls.append((a, b))
            return a + b

        return add


def langgraph_agent(client, adder: Adder):
    from langchain_core.tools import StructuredTool
    from langgraph.graph import START, MessagesState, StateGraph
    from langgraph.prebuilt import ToolNode, tools_condition

    add = StructuredTool.from_function(adder.tool())
    llm = client.bind_tools([add])

    async def agent(state: MessagesState) -> dict:
        return {"messages": [await llm.ainvoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("agent", agent)
    graph.add_node("tools", ToolNode([add]))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition)
    graph.add_edge("tools", "agent")
    return graph.compile()


def autogen_agent(client, adder: Adder):
    from autogen_agentchat.agents import AssistantAgent
    from autogen_core.tools import FunctionTool

    add = FunctionTool(adder.tool(), description="Add two integers.")
    # reflect_on_tool_use: the tool's result goes back to the model for the final answer.
    return AssistantAgent("math", model_client=client, tools=[add], reflect_on_tool_use=True)


def llamaindex_agent(client, adder: Adder):
    from llama_index.core.agent.workflow import FunctionAgent
    from llama_index.core.tools import FunctionTool

    add = FunctionTool.from_defaults(adder.tool())
    return FunctionAgent(name="math", description="Adds.", llm=client, tools=[add])


BUILDERS = {"langgraph": langgraph_agent, "autogen": autogen_agent, "llamaindex": llamaindex_agent}


@pytest.mark.parametrize("framework", list(BUILDERS))
def test_tool_call_round_trips_through_the_endpoint(backend, tmp_path, caplog, framework) -> None:
    adder = Adder()
    with serve(backend, tmp_path) as served:

        async def run() -> str:
            clients = Clients(framework, rollout_url(served.url, "tools"), ["math"], GREEDY)
            try:
                program = BUILDERS[framework](clients["math"], adder)
                return await run_program(framework, program, QUESTION, RunLimits(timeout_s=120))
            finally:
                await clients.aclose()

        answer = asyncio.run(run())
        first, second = served.store.rollout("tools")

    assert adder.calls == [(2, 3)]  # the framework ran the tool the model asked for
    assert FINAL_ANSWER in answer
    # Call 0: the framework sent its tool schema; the endpoint parsed the model's call.
    assert (first.agent, first.call_index, second.call_index) == ("math", 0, 1)
    assert [t["function"]["name"] for t in first.tools] == ["add"]
    (call,) = first.choices[0].tool_calls
    assert call["function"]["name"] == "add"
    assert json.loads(call["function"]["arguments"]) == {"a": 2, "b": 3}
    assert first.choices[0].finish_reason == "tool_calls"
    # Call 1: the framework sent the call back with the tool's result.
    roles = [m["role"] for m in second.messages]
    assert "tool" in roles and "assistant" in roles
    tool_message = next(m for m in second.messages if m["role"] == "tool")
    assert tool_message["tool_call_id"] == call["id"]
    assert "5" in tool_message["content"]
    assert second.choices[0].finish_reason == "stop"
    assert second.choices[0].text == FINAL_ANSWER
    assert "no tool-call syntax" not in caplog.text  # this template renders tools
