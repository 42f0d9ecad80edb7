"""User programs for the workflow training tests (unknown agents, group keys), written as a
user would write them. The tiny model writes gibberish: nothing depends on what it says."""

from __future__ import annotations

from typing import Any

from masenvs.adapters.frameworks import WorkflowContext


def langgraph_own_critic(ctx: WorkflowContext) -> Any:
    """solve -> critique, the critic a ChatOpenAI the user built with a model name of its own."""
    from langchain_core.messages import HumanMessage
    from langchain_openai import ChatOpenAI
    from langgraph.graph import END, START, MessagesState, StateGraph

    solver = ctx.clients["solver"]
    critic = ChatOpenAI(
        model="critic_v2",
        base_url=ctx.base_url,
        api_key="masenvs",
        max_tokens=8,
        max_retries=0,
        use_responses_api=False,
    )

    async def solve(state: MessagesState) -> dict:
        return {"messages": [await solver.ainvoke(state["messages"])]}

    async def critique(state: MessagesState) -> dict:
        reply = await critic.ainvoke([HumanMessage(f"Critique: {state['messages'][-1].text}")])
        return {"messages": [reply]}

    graph = StateGraph(MessagesState)
    graph.add_node("solve", solve)
    graph.add_node("critique", critique)
    graph.add_edge(START, "solve")
    graph.add_edge("solve", "critique")
    graph.add_edge("critique", END)
    return graph.compile()


def llamaindex_mapped_critic(ctx: WorkflowContext) -> Any:
    """draft -> critique (critic) -> second opinion (critic_v2, mapped to the critic)."""
    from llama_index.core.llms import ChatMessage
    from llama_index.core.workflow import Event, StartEvent, StopEvent, Workflow, step

    drafter, critic, second = (ctx.clients[a] for a in ("drafter", "critic", "critic_v2"))

    class Draft(Event):
        text: str

    class Critique(Event):
        text: str

    class DraftCritiqueSecondOpinion(Workflow):
        @step
        async def draft(self, ev: StartEvent) -> Draft:
            reply = await drafter.achat([ChatMessage(role="user", content=ev.user_msg)])
            return Draft(text=reply.message.content or "")

        @step
        async def critique(self, ev: Draft) -> Critique:
            reply = await critic.achat([ChatMessage(role="user", content=f"Critique: {ev.text}")])
            return Critique(text=reply.message.content or "")

        @step
        async def second_opinion(self, ev: Critique) -> StopEvent:
            reply = await second.achat([ChatMessage(role="user", content=f"Again: {ev.text}")])
            return StopEvent(result=reply.message.content or "")

    return DraftCritiqueSecondOpinion(timeout=None)


# -- programs that always fail ----------------------------------------------------------------


def langgraph_fails(ctx: WorkflowContext) -> Any:
    """One solver call, then the user's node raises."""
    from langgraph.graph import END, START, MessagesState, StateGraph

    solver = ctx.clients["solver"]

    async def solve(state: MessagesState) -> dict:
        return {"messages": [await solver.ainvoke(state["messages"])]}

    def parse(state: MessagesState) -> dict:
        raise ValueError("no answer in the solver's reply")

    graph = StateGraph(MessagesState)
    graph.add_node("solve", solve)
    graph.add_node("parse", parse)
    graph.add_edge(START, "solve")
    graph.add_edge("solve", "parse")
    graph.add_edge("parse", END)
    return graph.compile()


def langgraph_fails_at_once(ctx: WorkflowContext) -> Any:
    """A graph that raises before any model call."""
    from langgraph.graph import END, START, MessagesState, StateGraph

    def load(state: MessagesState) -> dict:
        raise FileNotFoundError("prompts.yaml")

    graph = StateGraph(MessagesState)
    graph.add_node("load", load)
    graph.add_edge(START, "load")
    graph.add_edge("load", END)
    return graph.compile()


def autogen_fails(ctx: WorkflowContext) -> Any:
    """The coder answers, then a custom agent of the team raises."""
    from autogen_agentchat.agents import AssistantAgent, BaseChatAgent
    from autogen_agentchat.base import Response
    from autogen_agentchat.conditions import MaxMessageTermination
    from autogen_agentchat.messages import TextMessage
    from autogen_agentchat.teams import RoundRobinGroupChat

    class Runner(BaseChatAgent):
        @property
        def produced_message_types(self) -> tuple:
            return (TextMessage,)

        async def on_messages(self, messages: Any, cancellation_token: Any) -> Response:
            raise RuntimeError("sandbox unavailable")

        async def on_reset(self, cancellation_token: Any) -> None:
            pass

    coder = AssistantAgent("coder", model_client=ctx.clients["coder"])
    runner = Runner("runner", description="Runs the code.")
    return RoundRobinGroupChat([coder, runner], termination_condition=MaxMessageTermination(4))


def llamaindex_fails(ctx: WorkflowContext) -> Any:
    """A draft, then the workflow's own step raises."""
    from llama_index.core.llms import ChatMessage
    from llama_index.core.workflow import StartEvent, StopEvent, Workflow, step

    drafter = ctx.clients["drafter"]

    class DraftThenFail(Workflow):
        @step
        async def draft(self, ev: StartEvent) -> StopEvent:
            await drafter.achat([ChatMessage(role="user", content=ev.user_msg)])
            raise KeyError("citation index")

    return DraftThenFail(timeout=None)


# -- named steps: critiques then one verdict; run k critiques k + 1 times --------------------


def langgraph_steps(ctx: WorkflowContext) -> Any:
    """solve -> critique x (run_index + 1) -> verdict; steps named with the header."""
    from langchain_core.messages import HumanMessage
    from langgraph.graph import END, START, MessagesState, StateGraph

    from masenvs.adapters.endpoint import STEP_HEADER

    solver = ctx.clients["solver"]
    critique_llm = ctx.clients["critic"].bind(extra_headers={STEP_HEADER: "critique"})
    verdict_llm = ctx.clients["critic"].bind(extra_headers={STEP_HEADER: "verdict"})

    class State(MessagesState):
        critiques: int

    async def solve(state: State) -> dict:
        return {"messages": [await solver.ainvoke(state["messages"])]}

    async def critique(state: State) -> dict:
        reply = await critique_llm.ainvoke([HumanMessage("Critique the answer.")])
        return {"messages": [reply], "critiques": state.get("critiques", 0) + 1}

    async def verdict(state: State) -> dict:
        return {"messages": [await verdict_llm.ainvoke([HumanMessage("Verdict?")])]}

    graph = StateGraph(State)
    for name, node in (("solve", solve), ("critique", critique), ("verdict", verdict)):
        graph.add_node(name, node)
    graph.add_edge(START, "solve")
    graph.add_edge("solve", "critique")
    graph.add_conditional_edges(
        "critique", lambda s: "verdict" if s["critiques"] > ctx.run_index else "critique"
    )
    graph.add_edge("verdict", END)
    return graph.compile()


def autogen_steps(ctx: WorkflowContext) -> Any:
    """coder, critique x (run_index + 1), verdict: one critic policy, two steps by model name."""
    from autogen_agentchat.agents import AssistantAgent
    from autogen_agentchat.conditions import MaxMessageTermination
    from autogen_agentchat.teams import RoundRobinGroupChat

    coder = AssistantAgent("coder", model_client=ctx.clients["coder"])
    critiques = [
        AssistantAgent(f"critique{k}", model_client=ctx.clients["critic@critique"])
        for k in range(ctx.run_index + 1)
    ]
    judge = AssistantAgent("judge", model_client=ctx.clients["critic@verdict"])
    team = [coder, *critiques, judge]
    return RoundRobinGroupChat(team, termination_condition=MaxMessageTermination(len(team) + 1))


def llamaindex_steps(ctx: WorkflowContext) -> Any:
    """draft, critique x (run_index + 1), verdict; steps named in the model string."""
    from llama_index.core.llms import ChatMessage
    from llama_index.core.workflow import StartEvent, StopEvent, Workflow, step

    drafter, critic, judge = (
        ctx.clients[name] for name in ("drafter", "critic@critique", "critic@verdict")
    )

    class Critiqued(Workflow):
        @step
        async def run_all(self, ev: StartEvent) -> StopEvent:
            await drafter.achat([ChatMessage(role="user", content=ev.user_msg)])
            for _ in range(ctx.run_index + 1):
                await critic.achat([ChatMessage(role="user", content="Critique it.")])
            reply = await judge.achat([ChatMessage(role="user", content="Verdict?")])
            return StopEvent(result=reply.message.content or "")

    return Critiqued(timeout=None)


def langgraph_cold_solver(ctx: WorkflowContext) -> Any:
    """solve -> check, the solver a client the program made at its own temperature (0.2);
    the checker samples at the run's (rollout.temperature)."""
    from langchain_core.messages import HumanMessage
    from langgraph.graph import END, START, MessagesState, StateGraph

    solver, checker = ctx.clients.client("solver", temperature=0.2), ctx.clients["checker"]

    async def solve(state: MessagesState) -> dict:
        return {"messages": [await solver.ainvoke(state["messages"])]}

    async def check(state: MessagesState) -> dict:
        reply = await checker.ainvoke([HumanMessage(f"Check: {state['messages'][-1].text}")])
        return {"messages": [reply]}

    graph = StateGraph(MessagesState)
    graph.add_node("solve", solve)
    graph.add_node("check", check)
    graph.add_edge(START, "solve")
    graph.add_edge("solve", "check")
    graph.add_edge("check", END)
    return graph.compile()
