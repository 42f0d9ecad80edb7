"""The factory of an existing LangGraph agent: it imports its sibling module by name, as the
agent's own code does (no package, no PYTHONPATH)."""

from reviewer_graph import build


def make(ctx):
    return build(ctx.clients["writer"], ctx.clients["critic"])
