"""The building blocks of a designed multi-agent system (MetaAgent-X's library, our own).

Every block is an async function of chat messages that returns text: `await block(messages)`
(or a question string). Blocks nest: an `Ensemble` of `Reflect`s inside a `Sequential` is
still a block. Each LLM call goes to the executor model through `masenvs.mas.use(llm)`.

    solver = Agent("solver", "Solve the problem; end with \\\\boxed{answer}.")
    checker = Agent("checker", "Check the solution; reply APPROVE if it is right.")
    system = Sequential(Ensemble(solver, Agent("solver2"), judge=Agent("judge")),
                        Reflect(Agent("fixer"), checker))
    answer = await system("What is 6*7?")
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from masenvs.mas.llm import LLM, Message, current
from masenvs.parsing import last_boxed, last_code_block

Input = str | Sequence[Message]


def as_messages(value: Input) -> list[Message]:
    """A question string as one user message; a message list checked and copied."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    messages = list(value)
    for m in messages:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m):
            raise TypeError(f"a message must be a dict with 'role' and 'content', got {m!r}")
    if not messages:
        raise ValueError("a block needs at least one message")
    return messages


def answer_of(text: str) -> str | None:
    """The content of the last non-empty `\\boxed{...}` in `text`, or None."""
    return last_boxed(text)


def vote(texts: Sequence[str]) -> int | None:
    """Index of the first text whose boxed answer has a strict majority of the most votes;
    None when the top answers tie or no text has an answer."""
    keys = [_vote_key(t) for t in texts]
    counts = Counter(k for k in keys if k is not None)
    if not counts:
        return None
    ranked = counts.most_common()
    if len(ranked) > 1 and ranked[0][1] == ranked[1][1]:
        return None
    return keys.index(ranked[0][0])


def _vote_key(text: str) -> str | None:
    answer = answer_of(text)
    return None if answer is None else re.sub(r"\s+", "", answer).lower()


def extend(messages: Sequence[Message], text: str) -> list[Message]:
    """`messages` with `text` added to the last user turn (chat templates that insist on
    alternating roles accept it), or as a new user turn after an assistant turn."""
    out = [dict(m) for m in messages]
    if out and out[-1]["role"] == "user":
        out[-1]["content"] = f"{out[-1]['content']}\n\n{text}"
    else:
        out.append({"role": "user", "content": text})
    return out


class Block:
    """Base of all blocks: `await block(messages)` returns the block's answer text."""

    name: str = "block"

    async def __call__(self, messages: Input) -> str:
        return await self.run(as_messages(messages))

    async def run(self, messages: list[Message]) -> str:
        raise NotImplementedError

    # --- the design as a graph (see masenvs.mas.graph) -----------------------------------

    def children(self) -> list[Block]:
        return []

    def entries(self) -> list[str]:
        """Names of the agents that receive this block's input."""
        return [n for c in self.children()[:1] for n in c.entries()]

    def exits(self) -> list[str]:
        """Names of the agents whose output is this block's output."""
        return [n for c in self.children()[-1:] for n in c.exits()]

    def edges(self) -> list[tuple[str, str]]:
        """Who feeds whom inside this block, by agent name."""
        return [e for c in self.children() for e in c.edges()]

    def walk(self) -> Iterator[Block]:
        yield self
        for child in self.children():
            yield from child.walk()

    def describe(self) -> str:
        inner = ", ".join(c.describe() for c in self.children())
        return f"{type(self).__name__}({inner})"


class Agent(Block):
    """One LLM node: its system prompt, then the messages it is given."""

    def __init__(self, name: str, system: str | None = None, *, llm: LLM | None = None) -> None:
        if not isinstance(name, str) or not name.strip():
            raise ValueError("an Agent needs a non-empty name")
        self.name, self.system, self.llm = name, system, llm

    async def run(self, messages: list[Message]) -> str:
        if self.system:
            messages = [{"role": "system", "content": self.system}, *messages]
        return await (self.llm or current()).chat(self.name, messages)

    def entries(self) -> list[str]:
        return [self.name]

    def exits(self) -> list[str]:
        return [self.name]

    def describe(self) -> str:
        return self.name


FINAL_PROMPT = "Stop using tools now and give your final answer."


class ToolAgent(Agent):
    """An agent that works in turns with a Python tool. A reply holding a ```python block
    (and no final answer: no `\\boxed{}`, `<solution>` or `FINAL ANSWER`) is a tool call:
    the code runs in the sandbox and its output is shown back as the next user turn. The
    first reply without a tool call is the answer; the code runs at most `max_turns` times,
    and the last observation tells the agent to stop and answer (at most max_turns + 1
    calls). `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` calls a
    tool of `tools` (name -> function) instead."""

    def __init__(
        self,
        name: str,
        system: str | None = None,
        *,
        max_turns: int = 4,
        tools: dict[str, Callable[..., Any]] | None = None,
        llm: LLM | None = None,
    ) -> None:
        super().__init__(name, system, llm=llm)
        if not isinstance(max_turns, int) or isinstance(max_turns, bool) or max_turns < 1:
            raise ValueError(f"ToolAgent max_turns must be an integer >= 1, got {max_turns!r}")
        self.max_turns, self.tools = max_turns, dict(tools or {})

    async def run(self, messages: list[Message]) -> str:
        llm = self.llm or current()
        talk = [dict(m) for m in messages]
        if self.system:
            talk = [{"role": "system", "content": self.system}, *talk]
        for turn in range(self.max_turns + 1):
            reply = await llm.chat(self.name, talk)
            call = tool_call(reply)
            if call is None or turn == self.max_turns:  # its answer, or out of turns
                return reply
            observation = await self.use_tool(llm, *call)
            if turn + 1 == self.max_turns:
                observation += f"\n\n{FINAL_PROMPT}"
            talk += [
                {"role": "assistant", "content": reply},
                {"role": "user", "content": observation},
            ]
        raise AssertionError("unreachable")

    async def use_tool(self, llm: LLM, name: str, arguments: dict[str, Any]) -> str:
        """Run one tool call and return what the agent is shown; errors become text."""
        if not name:
            return (
                'Error: the <tool_call> is not valid: write <tool_call>{"name": "...", '
                '"arguments": {...}}</tool_call>, or a ```python block.'
            )
        if name in ("python", "python_execute") and name not in self.tools:
            return await llm.execute_python(str(arguments.get("code", "")))
        if name not in self.tools:
            known = ", ".join(["python", *self.tools]) if self.tools else "python"
            return f"Error: there is no tool {name!r}; the tools are: {known}."
        try:
            result = self.tools[name](**arguments)
            if inspect.isawaitable(result):
                result = await result
        except Exception as exc:  # the tool's failure is the agent's observation
            return f"Error: the tool {name!r} failed: {type(exc).__name__}: {exc}"
        return f"Tool {name!r} returned:\n{result}"


def tool_call(reply: str) -> tuple[str, dict[str, Any]] | None:
    """The tool call in an agent's reply, as (tool, arguments), or None when it answers."""
    if answer_of(reply) is not None or "<solution>" in reply or "FINAL ANSWER" in reply.upper():
        return None
    start = reply.find("<tool_call>")
    end = reply.find("</tool_call>", start)
    if start >= 0 and end > start:
        try:
            call = json.loads(reply[start + len("<tool_call>") : end])
        except (ValueError, RecursionError):
            call = None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return "", {}
        arguments = call.get("arguments") or call.get("parameters") or {}
        return call["name"], arguments if isinstance(arguments, dict) else {}
    code = last_code_block(reply, ("python", "py"))
    return ("python", {"code": code}) if code and code.strip() else None


class Sequential(Block):
    """Blocks in a row: each sees the question and the previous block's answer."""

    def __init__(self, *blocks: Block, name: str = "sequential") -> None:
        self.blocks, self.name = _blocks(blocks, "Sequential"), name

    async def run(self, messages: list[Message]) -> str:
        out = await self.blocks[0].run(messages)
        for prev, block in zip(self.blocks, self.blocks[1:]):
            out = await block.run(extend(messages, f"The previous step ({prev.name}) said:\n{out}"))
        return out

    def children(self) -> list[Block]:
        return list(self.blocks)

    def edges(self) -> list[tuple[str, str]]:
        links = [
            (a, b)
            for p, n in zip(self.blocks, self.blocks[1:])
            for a in p.exits()
            for b in n.entries()
        ]
        return super().edges() + links


class _Panel(Block):
    """Members answering side by side; the answer is the majority's, or the judge's on a tie."""

    def __init__(self, members: Sequence[Block], judge: Block | None, kind: str) -> None:
        self.members = _blocks(members, kind)
        if judge is not None and not isinstance(judge, Block):
            raise TypeError(f"{kind} judge must be a block, got {type(judge).__name__}")
        self.judge = judge

    async def decide(self, messages: list[Message], answers: list[str]) -> str:
        winner = vote(answers)
        if winner is not None or self.judge is None:
            return answers[0 if winner is None else winner]
        listing = "\n\n".join(f"Candidate {i + 1}:\n{a}" for i, a in enumerate(answers))
        prompt = f"{listing}\n\nThe candidates disagree. Give the correct final answer."
        return await self.judge.run(extend(messages, prompt))

    def children(self) -> list[Block]:
        return [*self.members, *([self.judge] if self.judge else [])]

    def entries(self) -> list[str]:
        return [n for m in self.members for n in m.entries()]

    def exits(self) -> list[str]:
        if self.judge is not None:
            return self.judge.exits()
        return [n for m in self.members for n in m.exits()]

    def edges(self) -> list[tuple[str, str]]:
        links = []
        if self.judge is not None:
            links = [(a, b) for m in self.members for a in m.exits() for b in self.judge.entries()]
        return [e for c in self.children() for e in c.edges()] + links


class Ensemble(_Panel):
    """Members answer independently; majority vote over their boxed answers, judge on ties."""

    def __init__(self, *members: Block, judge: Block | None = None, name: str = "ensemble"):
        super().__init__(members, judge, "Ensemble")
        self.name = name

    async def run(self, messages: list[Message]) -> str:
        answers = list(await asyncio.gather(*(m.run(messages) for m in self.members)))
        return await self.decide(messages, answers)


class Debate(_Panel):
    """Members answer, then for `rounds - 1` more rounds each revises after reading the
    others' latest answers; majority vote at the end, judge on ties."""

    def __init__(
        self, *members: Block, rounds: int = 2, judge: Block | None = None, name: str = "debate"
    ):
        super().__init__(members, judge, "Debate")
        if not isinstance(rounds, int) or rounds < 1:
            raise ValueError(f"Debate rounds must be an integer >= 1, got {rounds!r}")
        self.rounds, self.name = rounds, name

    async def run(self, messages: list[Message]) -> str:
        answers = list(await asyncio.gather(*(m.run(messages) for m in self.members)))
        for _ in range(self.rounds - 1):
            answers = list(
                await asyncio.gather(
                    *(
                        m.run(extend(messages, _others(answers, i)))
                        for i, m in enumerate(self.members)
                    )
                )
            )
        return await self.decide(messages, answers)

    def edges(self) -> list[tuple[str, str]]:
        links = []
        if self.rounds > 1:
            outs = [m.exits() for m in self.members]
            ins = [m.entries() for m in self.members]
            links = [
                (a, b)
                for i in range(len(self.members))
                for j in range(len(self.members))
                if i != j
                for a in outs[i]
                for b in ins[j]
            ]
        return super().edges() + links


class Reflect(Block):
    """An actor answers, a critic reviews; the actor revises until the critic approves
    (its reply contains `approve`) or `rounds` reviews have passed."""

    def __init__(
        self,
        actor: Block,
        critic: Block,
        *,
        rounds: int = 1,
        approve: str = "APPROVE",
        name: str = "reflect",
    ) -> None:
        self.actor, self.critic = _blocks([actor, critic], "Reflect")
        if not isinstance(rounds, int) or rounds < 1:
            raise ValueError(f"Reflect rounds must be an integer >= 1, got {rounds!r}")
        self.rounds, self.approve, self.name = rounds, approve, name

    async def run(self, messages: list[Message]) -> str:
        answer = await self.actor.run(messages)
        for _ in range(self.rounds):
            review = await self.critic.run(
                extend(
                    messages,
                    f"Proposed solution:\n{answer}\n\nCheck it. Reply {self.approve} if it is "
                    "correct; otherwise explain the mistake.",
                )
            )
            if self.approve.lower() in review.lower():
                break
            answer = await self.actor.run(
                extend(
                    messages,
                    f"Your previous answer:\n{answer}\n\nA reviewer said:\n{review}\n\n"
                    "Give a corrected answer.",
                )
            )
        return answer

    def children(self) -> list[Block]:
        return [self.actor, self.critic]

    def exits(self) -> list[str]:
        return self.actor.exits()

    def edges(self) -> list[tuple[str, str]]:
        there = [(a, b) for a in self.actor.exits() for b in self.critic.entries()]
        back = [(a, b) for a in self.critic.exits() for b in self.actor.entries()]
        return super().edges() + there + back


class Router(Block):
    """A router agent names one of `routes`; that route answers (a conditional branch)."""

    def __init__(
        self,
        router: Block,
        routes: dict[str, Block],
        *,
        default: str | None = None,
        name: str = "router",
    ) -> None:
        if not isinstance(routes, dict) or not routes:
            raise ValueError("Router needs a non-empty dict of routes {name: block}")
        _blocks([router, *routes.values()], "Router")
        if default is not None and default not in routes:
            raise ValueError(f"Router default {default!r} is not one of {sorted(routes)}")
        self.router, self.routes, self.default, self.name = router, dict(routes), default, name

    def pick(self, reply: str) -> str:
        """The route named in the router's reply (the earliest mention), else the default."""
        found = [
            (m.start(), key)
            for key in self.routes
            for m in [re.search(rf"(?<!\w){re.escape(key)}(?!\w)", reply, re.IGNORECASE)]
            if m
        ]
        if found:
            return min(found)[1]
        return self.default or next(iter(self.routes))

    async def run(self, messages: list[Message]) -> str:
        options = ", ".join(self.routes)
        reply = await self.router.run(
            extend(messages, f"Which of these should handle it: {options}? Reply with one name.")
        )
        return await self.routes[self.pick(reply)].run(messages)

    def children(self) -> list[Block]:
        return [self.router, *self.routes.values()]

    def entries(self) -> list[str]:
        return self.router.entries()

    def exits(self) -> list[str]:
        return [n for r in self.routes.values() for n in r.exits()]

    def edges(self) -> list[tuple[str, str]]:
        links = [
            (a, b) for r in self.routes.values() for a in self.router.exits() for b in r.entries()
        ]
        return super().edges() + links

    def describe(self) -> str:
        routes = ", ".join(f"{k}={v.describe()}" for k, v in self.routes.items())
        return f"Router({self.router.describe()}, {routes})"


class Loop(Block):
    """The body runs again on its own last answer until `until(answer)` holds, at most
    `max_iters` times (default stop: the answer has a `\\boxed{}`)."""

    def __init__(
        self,
        body: Block,
        *,
        until: Callable[[str], bool] | None = None,
        max_iters: int = 3,
        name: str = "loop",
    ) -> None:
        (self.body,) = _blocks([body], "Loop")
        if not isinstance(max_iters, int) or max_iters < 1:
            raise ValueError(f"Loop max_iters must be an integer >= 1, got {max_iters!r}")
        self.until = until or (lambda text: answer_of(text) is not None)
        self.max_iters, self.name = max_iters, name

    async def run(self, messages: list[Message]) -> str:
        answer = await self.body.run(messages)
        for _ in range(self.max_iters - 1):
            if self.until(answer):
                break
            answer = await self.body.run(
                extend(messages, f"Your previous attempt:\n{answer}\n\nImprove it.")
            )
        return answer

    def children(self) -> list[Block]:
        return [self.body]

    def edges(self) -> list[tuple[str, str]]:
        back = [(a, b) for a in self.body.exits() for b in self.body.entries()]
        return super().edges() + back


def _blocks(items: Sequence[Block], kind: str) -> list[Block]:
    items = list(items)
    if not items:
        raise ValueError(f"{kind} needs at least one block")
    for item in items:
        if not isinstance(item, Block):
            raise TypeError(
                f"{kind} takes blocks (Agent, Sequential, ...), got {type(item).__name__}"
            )
    return items


def _others(answers: list[str], me: int) -> str:
    shown = "\n\n".join(f"Agent {i + 1}:\n{a}" for i, a in enumerate(answers) if i != me)
    return f"Other agents answered:\n{shown}\n\nConsider their reasoning and give your answer."
