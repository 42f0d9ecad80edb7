"""The executor LLM behind every block: one OpenAI client, a call budget, calls per node.

Blocks find the LLM to call in a context variable (`use`), so a design reads as plain
building blocks and the same design runs against any OpenAI-compatible URL, or, inside
the sandbox, through the Unix socket of its rollout's gate.
"""

from __future__ import annotations

import contextlib
import contextvars
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

Message = dict[str, str]

EXECUTOR = "executor"  # the model name every node sends; the gate maps it to the policy


class BudgetExceeded(RuntimeError):
    """The design made more LLM calls than its budget allows."""


@dataclass
class NodeCall:
    """One LLM call a node made: the node's name and the trace id the endpoint returned."""

    node: str
    call_id: str


@dataclass
class LLM:
    """An OpenAI-compatible chat model that the blocks call, with an optional call budget."""

    client: Any  # openai.AsyncOpenAI
    model: str = EXECUTOR
    max_calls: int | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    per_node: bool = False  # send `model@node`: the endpoint records the node as the step
    calls: list[NodeCall] = field(default_factory=list)
    # Inside a design's sandbox: the client of its gate, which runs the Python tool outside
    # (a sandboxed design cannot start a sandbox); None runs it in a local sandbox.
    gate: Any = None
    socket: str | None = None  # the gate's Unix socket (for the synchronous tool call)
    tool_runs: int = 0
    # "published": nodes and tool output as the published MetaAgent-X harness words them
    # (masenvs.mas.compat.published); "masenvs": ours.
    harness: str = "masenvs"

    async def chat(self, node: str, messages: list[Message]) -> str:
        """One completion for `node`; its call id is recorded under the node's name."""
        if self.max_calls is not None and len(self.calls) >= self.max_calls:
            raise BudgetExceeded(f"the design made more than {self.max_calls} LLM calls")
        options: dict[str, Any] = {}
        if self.max_tokens is not None:
            options["max_tokens"] = self.max_tokens
        if self.temperature is not None:
            options["temperature"] = self.temperature
        # Count before awaiting, so concurrent nodes cannot overrun the budget together.
        record = NodeCall(node, "")
        self.calls.append(record)
        model = f"{self.model}@{node_tag(node)}" if self.per_node else self.model
        response = await self.client.chat.completions.create(
            model=model, messages=messages, **options
        )
        record.call_id = response.id
        return response.choices[0].message.content or ""

    async def execute_python(self, code: str) -> str:
        """Run `code` in the sandbox (through the gate inside a design) and return what the
        agent is shown: its output, or why it failed. Bad code never raises."""
        self.tool_runs += 1
        if self.gate is None:
            import asyncio

            from masenvs.mas.tools import run_python

            return self._words((await asyncio.to_thread(run_python, code)).to_dict())
        reply = await self.gate.post(TOOL_URL, json={"code": code})
        return _observation(reply, self._words)

    def execute_python_sync(self, code: str) -> str:
        """`execute_python` for synchronous callers (the `workflow` API's tools)."""
        if self.socket is None:
            from masenvs.mas.tools import run_python

            self.tool_runs += 1
            return self._words(run_python(code).to_dict())
        import httpx

        self.tool_runs += 1
        transport = httpx.HTTPTransport(uds=self.socket, verify=False)
        with httpx.Client(transport=transport, timeout=300.0) as http:
            return _observation(http.post(TOOL_URL, json={"code": code}), self._words)

    def _words(self, run: dict[str, Any]) -> str:
        """A tool run (verdict, stdout, stderr, returncode) as this harness shows it."""
        from masenvs.mas.tools import TOOL_SECONDS, ToolResult

        if self.harness == "published":
            from masenvs.mas.compat.published import observation

            return observation(run, TOOL_SECONDS)
        return ToolResult(run["verdict"], run["stdout"], run["stderr"]).observation()

    def calls_by_node(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for call in self.calls:
            out.setdefault(call.node, []).append(call.call_id)
        return out

    async def aclose(self) -> None:
        await self.client.close()


TOOL_URL = "http://gate/v1/tools/python"


def _observation(reply: Any, words: Any) -> str:
    """The gate's answer to a tool run as the text the agent is shown (`words` the run's
    fields)."""
    try:
        body = reply.json()
    except ValueError:
        body = {}
    if not isinstance(body, dict):
        body = {}
    fields = ("verdict", "stdout", "stderr")
    if reply.status_code == 200 and all(isinstance(body.get(k), str) for k in fields):
        return words(body)
    if reply.status_code == 200 and isinstance(body.get("observation"), str):
        return body["observation"]
    message = (body.get("error") or {}).get("message") or f"HTTP {reply.status_code}"
    return f"Error: the Python tool is not available: {message}"


def node_tag(node: str) -> str:
    """A node name as the step part of a model name: [A-Za-z0-9_.:-], at most 64 characters."""
    return re.sub(r"[^A-Za-z0-9_.:-]", "_", node)[:64] or "node"


def connect(
    base_url: str | None = None,
    *,
    uds: str | None = None,
    model: str = EXECUTOR,
    api_key: str = "masenvs",
    max_calls: int | None = None,
    max_tokens: int | None = None,
    temperature: float | None = None,
    timeout: float = 300.0,
    per_node: bool = False,
    harness: str = "masenvs",
) -> LLM:
    """An LLM at an OpenAI base URL (`http://host:port/v1`), or behind a Unix socket (`uds`)."""
    import httpx
    from openai import AsyncOpenAI

    if base_url is None and uds is None:
        raise ValueError("connect() needs a base_url (e.g. http://127.0.0.1:8000/v1) or uds=")
    http_client = None
    if uds is not None:
        # verify=False: no TLS over a Unix socket, and no CA file to read (a sandboxed
        # design may not see the one in site-packages).
        transport = httpx.AsyncHTTPTransport(uds=uds, verify=False)
        http_client = httpx.AsyncClient(transport=transport, timeout=timeout)
        base_url = base_url or "http://gate/v1"
    client = AsyncOpenAI(
        base_url=base_url, api_key=api_key, http_client=http_client, max_retries=0, timeout=timeout
    )
    return LLM(
        client,
        model,
        max_calls,
        max_tokens,
        temperature,
        per_node,
        gate=http_client,
        socket=uds,
        harness=harness,
    )


_current: contextvars.ContextVar[LLM | None] = contextvars.ContextVar(
    "masenvs_mas_llm", default=None
)


@contextlib.contextmanager
def use(llm: LLM) -> Iterator[LLM]:
    """Make `llm` the one every block in this context calls."""
    token = _current.set(llm)
    try:
        yield llm
    finally:
        _current.reset(token)


def current_harness() -> str:
    """The harness of the LLM in use ("masenvs" where none is)."""
    llm = _current.get()
    return "masenvs" if llm is None else llm.harness


def current() -> LLM:
    llm = _current.get()
    if llm is None:
        raise RuntimeError(
            "no LLM to call: wrap the call in `with masenvs.mas.use(masenvs.mas.connect(url)):` "
            "or give the Agent llm=..."
        )
    return llm
