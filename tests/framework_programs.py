"""Small user programs for the framework tests, written as a user would write them.

Each factory takes the `WorkflowContext` masenvs hands it and returns the program. Every
program makes exactly two calls per agent (so the tests can check call numbering); the tiny
test model writes gibberish, so none of them depends on what the model says.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from masenvs.adapters.frameworks import WorkflowContext

# -- LangGraph ------------------------------------------------------------------------------


def langgraph_pair(ctx: WorkflowContext) -> Any:
    """solve -> check -> solve -> check -> end."""
    from langchain_core.messages import HumanMessage, SystemMessage
    from langgraph.graph import END, START, MessagesState, StateGraph

    solver, checker = ctx.clients["solver"], ctx.clients["checker"]

    class State(MessagesState):
        rounds: int

    async def solve(state: State) -> dict:
        reply = await solver.ainvoke([SystemMessage("Solve it."), *state["messages"]])
        return {"messages": [reply], "rounds": state.get("rounds", 0) + 1}

    def check(state: State) -> dict:  # a sync node: LangGraph runs it in a thread
        reply = checker.invoke([HumanMessage(f"Check: {state['messages'][-1].text}")])
        return {"messages": [reply]}

    graph = StateGraph(State)
    graph.add_node("solve", solve)
    graph.add_node("check", check)
    graph.add_edge(START, "solve")
    graph.add_edge("solve", "check")
    graph.add_conditional_edges("check", lambda s: END if s["rounds"] >= 2 else "solve")
    return graph.compile()


def langgraph_fails_first_run(ctx: WorkflowContext) -> Any:
    """One solver call, then the user's node raises, but only in run 0 of each task."""
    from langgraph.graph import END, START, MessagesState, StateGraph

    solver = ctx.clients["solver"]

    async def solve(state: MessagesState) -> dict:
        return {"messages": [await solver.ainvoke(state["messages"])]}

    def post(state: MessagesState) -> dict:
        if ctx.run_index == 0:
            raise ValueError("boom in the user's graph\nwith a second line")
        return {}

    graph = StateGraph(MessagesState)
    graph.add_node("solve", solve)
    graph.add_node("post", post)
    graph.add_edge(START, "solve")
    graph.add_edge("solve", "post")
    graph.add_edge("post", END)
    return graph.compile()


def langgraph_forever(ctx: WorkflowContext) -> Any:
    """A graph that never ends: the recursion limit stops it."""
    from langgraph.graph import START, MessagesState, StateGraph

    solver = ctx.clients["solver"]

    async def solve(state: MessagesState) -> dict:
        return {"messages": [await solver.ainvoke(state["messages"][:2])]}

    graph = StateGraph(MessagesState)
    graph.add_node("solve", solve)
    graph.add_edge(START, "solve")
    graph.add_edge("solve", "solve")
    return graph.compile()


# -- AutoGen --------------------------------------------------------------------------------


def autogen_pair(ctx: WorkflowContext) -> Any:
    """coder, reviewer, coder, reviewer in a round-robin team."""
    from autogen_agentchat.agents import AssistantAgent
    from autogen_agentchat.conditions import MaxMessageTermination
    from autogen_agentchat.teams import RoundRobinGroupChat

    coder = AssistantAgent("coder", model_client=ctx.clients["coder"])
    reviewer = AssistantAgent("reviewer", model_client=ctx.clients["reviewer"])
    # The task message counts: task + 4 agent messages.
    return RoundRobinGroupChat([coder, reviewer], termination_condition=MaxMessageTermination(5))


# -- LlamaIndex -----------------------------------------------------------------------------


def llamaindex_pair(ctx: WorkflowContext) -> Any:
    """A custom LlamaIndex Workflow: draft -> critique -> draft -> critique."""
    from llama_index.core.llms import ChatMessage
    from llama_index.core.workflow import Event, StartEvent, StopEvent, Workflow, step

    drafter, critic = ctx.clients["drafter"], ctx.clients["critic"]

    class Draft(Event):
        text: str
        round: int

    class Critique(Event):
        text: str
        round: int

    class DraftAndCritique(Workflow):
        @step
        async def start(self, ev: StartEvent) -> Draft:
            reply = await drafter.achat([ChatMessage(role="user", content=ev.user_msg)])
            return Draft(text=reply.message.content or "", round=1)

        @step
        async def critique(self, ev: Draft) -> Critique:
            reply = await critic.achat([ChatMessage(role="user", content=f"Critique: {ev.text}")])
            return Critique(text=reply.message.content or "", round=ev.round)

        @step
        async def redraft(self, ev: Critique) -> Draft | StopEvent:
            if ev.round >= 2:
                return StopEvent(result=ev.text)
            reply = await drafter.achat([ChatMessage(role="user", content=f"Improve: {ev.text}")])
            return Draft(text=reply.message.content or "", round=ev.round + 1)

    return DraftAndCritique(timeout=None)


def llamaindex_agents(ctx: WorkflowContext) -> Any:
    """An AgentWorkflow; the tiny model never hands off, so only the root agent speaks."""
    from llama_index.core.agent.workflow import AgentWorkflow, FunctionAgent

    planner = FunctionAgent(
        name="planner",
        description="Plans.",
        llm=ctx.clients["planner"],
        can_handoff_to=["critic"],
    )
    critic = FunctionAgent(name="critic", description="Critiques.", llm=ctx.clients["critic"])
    return AgentWorkflow(agents=[planner, critic], root_agent="planner")


# -- anything else --------------------------------------------------------------------------


def sleeps(ctx: WorkflowContext) -> Any:
    async def run(messages: list[dict]) -> str:
        await asyncio.sleep(30)
        return "too late"

    return run


def calls_then_sleeps(ctx: WorkflowContext) -> Any:
    """One LLM call, then a wait past any small `timeout_s`: a run too slow for its limit."""
    solver = ctx.clients["solver"]

    async def run(messages: list[dict]) -> str:
        await solver.ainvoke(messages)
        await asyncio.sleep(30)
        return "too late"

    return run


def not_a_program(ctx: WorkflowContext) -> Any:
    return 42


def autogen_selector(ctx: WorkflowContext) -> Any:
    """A SelectorGroupChat: its speaker selection is a model call of its own agent."""
    from autogen_agentchat.agents import AssistantAgent
    from autogen_agentchat.conditions import MaxMessageTermination
    from autogen_agentchat.teams import SelectorGroupChat

    coder = AssistantAgent("coder", model_client=ctx.clients["coder"], description="Writes code.")
    reviewer = AssistantAgent(
        "reviewer", model_client=ctx.clients["reviewer"], description="Reviews code."
    )
    return SelectorGroupChat(
        [coder, reviewer],
        model_client=ctx.clients["selector"],
        termination_condition=MaxMessageTermination(3),
    )


# -- programs that block instead of awaiting (only run 0 of seed 0) -------------------------

BLOCK_S = 8.0  # longer than the tests' timeout_s
LATE: dict[str, str] = {}  # rollout id -> what the hung run's call after its sleep got


def _blocks(ctx: WorkflowContext) -> bool:
    return ctx.seed == 0 and ctx.run_index == 0


async def _late(ctx: WorkflowContext, make_call: Any) -> None:
    """The call a hung run makes once its blocking call returns, past its deadline."""
    try:
        await make_call()
        LATE[ctx.rollout_id] = "sent"
    except BaseException as exc:  # cancelled, or refused by its revoked client
        cause = exc.__cause__ or exc
        LATE[ctx.rollout_id] = f"{type(cause).__name__}: {cause}"
        if isinstance(exc, asyncio.CancelledError):
            raise


def langgraph_blocking(ctx: WorkflowContext) -> Any:
    """`time.sleep` in an async node (the user meant `await asyncio.sleep`)."""
    from langgraph.graph import END, START, MessagesState, StateGraph

    solver = ctx.clients["solver"]

    async def solve(state: MessagesState) -> dict:
        if _blocks(ctx):
            time.sleep(BLOCK_S)
            await _late(ctx, lambda: solver.ainvoke(state["messages"]))
        return {"messages": [await solver.ainvoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("solve", solve)
    graph.add_edge(START, "solve")
    graph.add_edge("solve", END)
    return graph.compile()


def autogen_blocking(ctx: WorkflowContext) -> Any:
    """A custom AutoGen agent that looks something up with a blocking call."""
    from autogen_agentchat.agents import AssistantAgent, BaseChatAgent
    from autogen_agentchat.base import Response
    from autogen_agentchat.conditions import MaxMessageTermination
    from autogen_agentchat.messages import TextMessage
    from autogen_agentchat.teams import RoundRobinGroupChat
    from autogen_core.models import UserMessage

    client = ctx.clients["coder"]

    class Lookup(BaseChatAgent):
        @property
        def produced_message_types(self) -> tuple:
            return (TextMessage,)

        async def on_messages(self, messages: Any, cancellation_token: Any) -> Response:
            if _blocks(ctx):
                time.sleep(BLOCK_S)
                await _late(ctx, lambda: client.create([UserMessage(content="hi", source="u")]))
            return Response(chat_message=TextMessage(content="docs: none", source=self.name))

        async def on_reset(self, cancellation_token: Any) -> None:
            pass

    coder = AssistantAgent("coder", model_client=client)
    return RoundRobinGroupChat(
        [Lookup("lookup", description="Looks things up."), coder],
        termination_condition=MaxMessageTermination(3),
    )


def llamaindex_blocking(ctx: WorkflowContext) -> Any:
    """A LlamaIndex step that blocks before its model call."""
    from llama_index.core.llms import ChatMessage
    from llama_index.core.workflow import StartEvent, StopEvent, Workflow, step

    drafter = ctx.clients["drafter"]

    class Draft(Workflow):
        @step
        async def draft(self, ev: StartEvent) -> StopEvent:
            message = [ChatMessage(role="user", content=ev.user_msg)]
            if _blocks(ctx):
                time.sleep(BLOCK_S)
                await _late(ctx, lambda: drafter.achat(message))
            reply = await drafter.achat(message)
            return StopEvent(result=reply.message.content or "")

    return Draft(timeout=None)


def own_client_blocking(ctx: WorkflowContext) -> Any:
    """Ignores `ctx.clients`: a sync openai client of its own, and a blocking sleep."""
    import openai

    client = openai.OpenAI(base_url=ctx.base_url, api_key="-", max_retries=0)

    def ask(messages: list[dict]) -> str:
        reply = client.chat.completions.create(model="solver", messages=messages, max_tokens=4)
        return reply.choices[0].message.content or ""

    async def run(messages: list[dict]) -> str:
        if _blocks(ctx):
            time.sleep(BLOCK_S)
            try:  # sync, so no cancellation can stop it: only the endpoint can refuse it
                ask(messages)
                LATE[ctx.rollout_id] = "sent"
            except openai.APIStatusError as exc:
                LATE[ctx.rollout_id] = f"{exc.status_code}: {exc.message}"
        return ask(messages)

    return run


# -- programs whose own code raises (run 0 of every task) -----------------------------------


def autogen_fails(ctx: WorkflowContext) -> Any:
    """A custom AutoGen agent that raises: AutoGen logs a many-line traceback of its own."""
    from autogen_agentchat.agents import AssistantAgent, BaseChatAgent
    from autogen_agentchat.conditions import MaxMessageTermination
    from autogen_agentchat.messages import TextMessage
    from autogen_agentchat.teams import RoundRobinGroupChat

    class Lookup(BaseChatAgent):
        @property
        def produced_message_types(self) -> tuple:
            return (TextMessage,)

        async def on_messages(self, messages: Any, cancellation_token: Any) -> Any:
            raise ValueError("boom in the user's agent\nwith a second line")

        async def on_reset(self, cancellation_token: Any) -> None:
            pass

    coder = AssistantAgent("coder", model_client=ctx.clients["coder"])
    return RoundRobinGroupChat(
        [coder, Lookup("lookup", description="Looks things up.")],
        termination_condition=MaxMessageTermination(4),
    )


def llamaindex_fails(ctx: WorkflowContext) -> Any:
    """A LlamaIndex step that raises after one model call."""
    from llama_index.core.llms import ChatMessage
    from llama_index.core.workflow import StartEvent, StopEvent, Workflow, step

    drafter = ctx.clients["drafter"]

    class Draft(Workflow):
        @step
        async def draft(self, ev: StartEvent) -> StopEvent:
            await drafter.achat([ChatMessage(role="user", content=ev.user_msg)])
            raise ValueError("boom in the user's step\nwith a second line")

    return Draft(timeout=None)


# -- programs whose answer is not text -------------------------------------------------------


def returns_a_list(ctx: WorkflowContext) -> Any:
    """`(messages) -> str` documented, a list returned: its repr holds a correct answer."""

    async def run(messages: list[dict]) -> Any:
        return ["\\boxed{9}", "\\boxed{9}"]

    return run


def langgraph_answer_dict(ctx: WorkflowContext) -> Any:
    """The answer key holds a dict (the user meant its 'value')."""
    from typing import TypedDict

    from langgraph.graph import END, START, StateGraph

    class State(TypedDict, total=False):
        messages: list
        answer: dict

    async def solve(state: State) -> dict:
        return {"answer": {"value": "\\boxed{9}", "confidence": 0.9}}

    graph = StateGraph(State)
    graph.add_node("solve", solve)
    graph.add_edge(START, "solve")
    graph.add_edge("solve", END)
    return graph.compile()


def autogen_returns_none(ctx: WorkflowContext) -> Any:
    """An async function that runs an AutoGen agent and forgets to return its answer."""
    from autogen_agentchat.agents import AssistantAgent

    agent = AssistantAgent("coder", model_client=ctx.clients["coder"])

    async def run(messages: list[dict]) -> Any:
        await agent.run(task=messages[-1]["content"])

    return run


def llamaindex_stops_with_a_list(ctx: WorkflowContext) -> Any:
    """A LlamaIndex workflow that stops with a list of drafts."""
    from llama_index.core.workflow import StartEvent, StopEvent, Workflow, step

    class Drafts(Workflow):
        @step
        async def draft(self, ev: StartEvent) -> StopEvent:
            return StopEvent(result=["\\boxed{9}"])

    return Drafts(timeout=None)


# -- programs whose final answer is empty ----------------------------------------------------


def langgraph_custom_key(ctx: WorkflowContext) -> Any:
    """Keeps its answer in state["final"], not in an AI message."""
    from typing import TypedDict

    from langgraph.graph import END, START, StateGraph

    solver = ctx.clients["solver"]

    class State(TypedDict, total=False):
        messages: list
        final: str

    async def solve(state: State) -> dict:
        reply = await solver.ainvoke(state["messages"])
        return {"final": reply.text}

    graph = StateGraph(State)
    graph.add_node("solve", solve)
    graph.add_edge(START, "solve")
    graph.add_edge("solve", END)
    return graph.compile()


def autogen_quiet_last_speaker(ctx: WorkflowContext) -> Any:
    """The team's last speaker says nothing; the coder's answer came before."""
    from autogen_agentchat.agents import AssistantAgent, BaseChatAgent
    from autogen_agentchat.base import Response
    from autogen_agentchat.conditions import MaxMessageTermination
    from autogen_agentchat.messages import TextMessage
    from autogen_agentchat.teams import RoundRobinGroupChat

    class Approver(BaseChatAgent):
        @property
        def produced_message_types(self) -> tuple:
            return (TextMessage,)

        async def on_messages(self, messages: Any, cancellation_token: Any) -> Response:
            return Response(chat_message=TextMessage(content="", source=self.name))

        async def on_reset(self, cancellation_token: Any) -> None:
            pass

    coder = AssistantAgent("coder", model_client=ctx.clients["coder"])
    return RoundRobinGroupChat(
        [coder, Approver("approver", description="Approves.")],
        termination_condition=MaxMessageTermination(3),
    )


def llamaindex_empty_result(ctx: WorkflowContext) -> Any:
    """Stops with an empty text: the draft was left in an event field."""
    from llama_index.core.llms import ChatMessage
    from llama_index.core.workflow import StartEvent, StopEvent, Workflow, step

    drafter = ctx.clients["drafter"]

    class Draft(Workflow):
        @step
        async def draft(self, ev: StartEvent) -> StopEvent:
            await drafter.achat([ChatMessage(role="user", content=ev.user_msg)])
            return StopEvent(result="")

    return Draft(timeout=None)


# -- programs with a tool (the tiny model's template renders none) ---------------------------


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def langgraph_with_tool(ctx: WorkflowContext) -> Any:
    from langgraph.graph import END, START, MessagesState, StateGraph

    llm = ctx.clients["solver"].bind_tools([add])

    async def solve(state: MessagesState) -> dict:
        return {"messages": [await llm.ainvoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("solve", solve)
    graph.add_edge(START, "solve")
    graph.add_edge("solve", END)
    return graph.compile()


def autogen_with_tool(ctx: WorkflowContext) -> Any:
    from autogen_agentchat.agents import AssistantAgent

    return AssistantAgent("coder", model_client=ctx.clients["coder"], tools=[add])


def llamaindex_with_tool(ctx: WorkflowContext) -> Any:
    from llama_index.core.agent.workflow import FunctionAgent

    return FunctionAgent(name="drafter", llm=ctx.clients["drafter"], tools=[add])
