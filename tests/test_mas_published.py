"""MetaAgent-X as published: tool-using multi-turn agent nodes (code run in the sandbox),
the authors' `workflow` API running unchanged inside a design, and a mixed math + code
task source. Real endpoint, real gate, real sandbox; the tiny model or a scripted policy."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from framework_support import serve

import masenvs
from masenvs import mas
from masenvs.adapters.backends.base import Completion, GenerateRequest, Generation, StreamDelta
from masenvs.adapters.backends.embedded import EmbeddedBackend
from masenvs.adapters.models import load_model

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
    last = messages[-1]["content"]
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
