"""Building blocks for designed multi-agent systems (auto-MAS); see docs/auto-mas.md.

Usable on its own against any OpenAI-compatible server:

    from masenvs import mas
    with mas.use(mas.connect("http://127.0.0.1:8000/v1", model="executor")):
        answer = await mas.Ensemble(mas.Agent("a"), mas.Agent("b"), judge=mas.Agent("j"))(question)
"""

from masenvs.mas.blocks import (
    Agent,
    Block,
    Debate,
    Ensemble,
    Loop,
    Reflect,
    Router,
    Sequential,
    ToolAgent,
    answer_of,
    vote,
)
from masenvs.mas.graph import DesignGraph
from masenvs.mas.llm import EXECUTOR, LLM, BudgetExceeded, connect, current, use

__all__ = [
    "EXECUTOR",
    "LLM",
    "Agent",
    "Block",
    "BudgetExceeded",
    "Debate",
    "DesignGraph",
    "Ensemble",
    "Loop",
    "Reflect",
    "Router",
    "Sequential",
    "ToolAgent",
    "answer_of",
    "connect",
    "current",
    "use",
    "vote",
]
