"""The capture endpoint over real HTTP: official `openai` client, tiny embedded model, traces."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch

from masenvs.adapters.endpoint import EndpointServer, create_app
from masenvs.adapters.policy_map import PolicyMap
from masenvs.adapters.tool_parsers import HermesToolParser, MistralToolParser, tool_parser_for
from masenvs.engine.engine import EmbeddedBackend
from masenvs.engine.loading import load_model
from masenvs.engine.protocol import GenerateRequest, Generation
from masenvs.traces import CallRecord, TraceStore

HELLO = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def backend() -> Iterator[EmbeddedBackend]:
    engine = EmbeddedBackend.from_spec("tiny", max_batch_size=32, max_model_len=512)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def adapters(backend: EmbeddedBackend, tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    root = tmp_path_factory.mktemp("adapters")
    for seed, name in enumerate(("tool_lora", "plan_lora"), start=1):
        asyncio.run(backend.load_adapter(name, str(make_adapter(root / name, seed))))
    return ["tool_lora", "plan_lora"]


def make_adapter(directory: Path, seed: int) -> Path:
    """A peft LoRA adapter for the tiny model whose B matrices are not zero."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    model = get_peft_model(load_model("tiny").model, config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    model.save_pretrained(directory)
    return directory


@pytest.fixture
def serve(backend: EmbeddedBackend, tmp_path: Path):
    """Start an endpoint over the shared backend; returns (server, store)."""
    servers: list[EndpointServer] = []

    def start(**options) -> tuple[EndpointServer, TraceStore]:
        store = TraceStore(tmp_path / f"traces{len(servers)}")
        server = EndpointServer(create_app(backend, store=store, **options))
        server.start()
        servers.append(server)
        return server, store

    yield start
    for server in servers:
        server.stop()


def client(url: str, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key=api_key, max_retries=0)


def visible_ids(choice) -> list[int]:
    """Token ids whose decoding is the text: all but a final stop token."""
    ids = choice.token_ids
    return ids[:-1] if isinstance(choice.stop_reason, int) else ids


def test_chat_call_is_answered_and_traced_with_exact_token_ids(serve, backend) -> None:
    server, store = serve()
    response = client(server.rollout_url("r1")).chat.completions.create(
        model="planner",
        messages=HELLO,
        max_tokens=12,
        seed=7,
        extra_body={"return_token_ids": True},
    )
    (choice,) = response.choices
    (record,) = store.calls()
    assert record.id == response.id
    assert (record.rollout_id, record.agent, record.model, record.call_index) == (
        "r1",
        "planner",
        "base",
        0,
    )
    assert record.messages == HELLO and record.kind == "chat"
    assert record.prompt_token_ids == response.prompt_token_ids
    assert record.choices[0].token_ids == choice.token_ids
    assert choice.message.content == record.choices[0].text
    assert backend.decode(visible_ids(record.choices[0])) == choice.message.content
    # The prompt ids are the chat template's rendering of the messages, by the backend.
    assert "Say hello." in backend.decode(record.prompt_token_ids)
    assert response.usage.prompt_tokens == len(record.prompt_token_ids)
    assert response.usage.completion_tokens == len(choice.token_ids)
    assert record.tokenizer_id == backend.tokenizer_id() and record.backend == "tiny"
    assert record.params["max_tokens"] == 12 and record.params["seed"] == 7


def test_ignore_eos_generates_exactly_max_tokens(serve) -> None:
    server, store = serve()
    # vLLM's extra, which bench/endpoint.py uses: every request runs to max_tokens
    response = client(server.base_url).chat.completions.create(
        model="base", messages=HELLO, max_tokens=48, extra_body={"ignore_eos": True}
    )
    assert response.usage.completion_tokens == 48
    assert response.choices[0].finish_reason == "length"
    (record,) = store.calls()
    assert record.params["ignore_eos"] is True


def test_streaming_chunks_add_up_to_the_traced_call(serve, backend) -> None:
    server, store = serve()
    stream = client(server.rollout_url("r2")).chat.completions.create(
        model="coder",
        messages=HELLO,
        max_tokens=16,
        stream=True,
        stream_options={"include_usage": True},
        logprobs=True,
        extra_body={"return_token_ids": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    ids = [t for c in chunks if c.choices for t in (c.choices[0].token_ids or [])]
    logprobs = [
        t.logprob
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content
    ]
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    prompt_ids = [c.prompt_token_ids for c in chunks if getattr(c, "prompt_token_ids", None)]
    (record,) = store.calls()
    assert record.stream and record.choices[0].token_ids == ids
    assert record.choices[0].text == text == backend.decode(visible_ids(record.choices[0]))
    assert record.choices[0].logprobs == logprobs
    assert finish == [record.choices[0].finish_reason]
    assert prompt_ids == [record.prompt_token_ids]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ids)
    assert chunks[0].choices[0].delta.role == "assistant"


def test_n_choices_and_logprobs_match_the_trace(serve, backend) -> None:
    server, store = serve()
    response = client(server.base_url).chat.completions.create(
        model="planner",
        messages=HELLO,
        n=3,
        max_tokens=8,
        logprobs=True,
        top_logprobs=3,
        extra_body={"return_token_ids": True},
    )
    (record,) = store.calls()
    assert record.rollout_id is None  # the plain /v1 API is traced outside any rollout
    assert len(response.choices) == len(record.choices) == 3
    for choice, traced in zip(response.choices, record.choices, strict=True):
        content = choice.logprobs.content
        assert [t.logprob for t in content] == traced.logprobs
        assert [t.token for t in content] == [backend.decode([i]) for i in traced.token_ids]
        for position, token in enumerate(content):
            assert len(token.top_logprobs) == 3
            best = sorted(traced.top_logprobs[position].values(), reverse=True)[:3]
            assert [alt.logprob for alt in token.top_logprobs] == best
        assert backend.decode(visible_ids(traced)) == choice.message.content
    assert response.usage.completion_tokens == sum(len(c.token_ids) for c in record.choices)


def test_completions_with_text_and_token_id_prompts(serve, backend) -> None:
    server, store = serve()
    api = client(server.rollout_url("r3"))
    by_text = api.completions.create(
        model="solver", prompt="Once upon a time", max_tokens=6, logprobs=2, seed=1
    )
    by_ids = api.completions.create(
        model="solver",
        prompt=[1, 2, 3, 4],
        max_tokens=6,
        seed=1,
        extra_body={"return_token_ids": True},
    )
    first, second = store.calls()
    assert (first.kind, first.call_index, second.call_index) == ("completion", 0, 1)
    assert first.prompt == "Once upon a time" and second.prompt == [1, 2, 3, 4]
    assert second.prompt_token_ids == [1, 2, 3, 4]
    assert by_ids.choices[0].prompt_token_ids == [1, 2, 3, 4]  # vLLM's place: on the choice
    assert by_ids.choices[0].token_ids == second.choices[0].token_ids
    legacy = by_text.choices[0].logprobs
    assert legacy.token_logprobs == first.choices[0].logprobs
    assert "".join(legacy.tokens) == backend.decode(first.choices[0].token_ids)
    assert all(len(top) == 2 for top in legacy.top_logprobs)
    assert by_text.choices[0].text == backend.decode(visible_ids(first.choices[0]))


def test_streamed_completion_is_traced(serve, backend) -> None:
    server, store = serve()
    stream = client(server.base_url).completions.create(
        model="solver", prompt="Count: 1, 2,", max_tokens=10, stream=True
    )
    text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    (record,) = store.calls()
    assert text == record.choices[0].text == backend.decode(visible_ids(record.choices[0]))


def test_rollout_urls_attribute_calls_and_count_per_agent(serve) -> None:
    server, store = serve()
    server_endpoint = server.app
    server_endpoint.set_rollout_metadata("ep-1", {"task": "sudoku:3"})
    server_endpoint.policy_version = 5
    for rollout, agent in [("ep-1", "a"), ("ep-1", "b"), ("ep-1", "a"), ("ep-2", "a")]:
        with pytest.raises(openai.BadRequestError):  # rejected calls take no index
            client(server.rollout_url(rollout)).chat.completions.create(
                model=agent, messages=HELLO, max_tokens=0
            )
        client(server.rollout_url(rollout)).chat.completions.create(
            model=agent, messages=HELLO, max_tokens=2
        )
    calls = [(c.rollout_id, c.agent, c.call_index) for c in store.calls()]
    assert calls == [("ep-1", "a", 0), ("ep-1", "b", 0), ("ep-1", "a", 1), ("ep-2", "a", 0)]
    assert [c.metadata for c in store.calls(rollout_id="ep-1")] == [{"task": "sudoku:3"}] * 3
    assert {c.policy_version for c in store.calls()} == {5}
    server_endpoint.end_rollout("ep-1")
    client(server.rollout_url("ep-1")).chat.completions.create(
        model="a", messages=HELLO, max_tokens=2
    )
    assert list(store.calls())[-1].call_index == 0 and list(store.calls())[-1].metadata == {}


def test_policy_map_routes_agents_to_their_adapters(serve, backend, adapters) -> None:
    server, store = serve(policy_map={"tool": "tool_lora", "plan": "plan_lora"})
    api = client(server.rollout_url("r4"))
    answers = {
        agent: api.chat.completions.create(
            model=agent,
            messages=HELLO,
            max_tokens=8,
            temperature=0,
            extra_body={"return_token_ids": True},
        ).choices[0]
        for agent in ("tool", "plan", "critic")
    }
    models = {c.agent: c.model for c in store.calls()}
    assert models == {"tool": "tool_lora", "plan": "plan_lora", "critic": "base"}
    # Greedy decoding differs between adapters: each call really ran its adapter.
    assert len({tuple(a.token_ids) for a in answers.values()}) == 3
    direct = asyncio.run(
        backend.generate(
            GenerateRequest(
                model="tool_lora",
                params=_greedy(8),
                messages=HELLO,
            )
        )
    )
    assert direct.completions[0].token_ids == answers["tool"].token_ids
    listed = {m.id for m in client(server.base_url).models.list().data}
    assert {"tiny", "tool_lora", "plan_lora", "tool", "plan"} <= listed


def _greedy(max_tokens: int):
    from masenvs.engine.protocol import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0)


def test_unknown_agents_can_be_rejected(serve, adapters) -> None:
    server, store = serve(
        policy_map=PolicyMap({"tool": "tool_lora"}, default=None),
        served_model_names=["gpt-4o-mini"],  # an alias of the base model
    )
    api = client(server.base_url)
    with pytest.raises(openai.NotFoundError) as caught:
        api.chat.completions.create(model="stranger", messages=HELLO, max_tokens=2)
    assert caught.value.body["code"] == "model_not_found"
    # An adapter named directly is still served, and the server keeps serving.
    api.chat.completions.create(model="plan_lora", messages=HELLO, max_tokens=2)
    api.chat.completions.create(model="gpt-4o-mini", messages=HELLO, max_tokens=2)
    assert [c.model for c in store.calls()] == ["plan_lora", "gpt-4o-mini"]


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(serve) -> None:
    server, store = serve(api_key="sekret", policy_map=PolicyMap(default=None))
    url = f"{server.base_url}/chat/completions"
    auth = {"Authorization": "Bearer sekret"}
    good = {"model": "tiny", "messages": HELLO, "max_tokens": 2}
    cases = [
        (400, None, {"content": b"{not json", "headers": auth}),
        (400, None, {"json": {"model": "tiny"}, "headers": auth}),  # no messages
        (404, "model_not_found", {"json": {**good, "model": "nope"}, "headers": auth}),
        (400, "integer_below_min_value", {"json": {**good, "max_tokens": -1}, "headers": auth}),
        (
            400,
            "context_length_exceeded",
            {
                "json": {**good, "messages": [{"role": "user", "content": "word " * 2000}]},
                "headers": auth,
            },
        ),
        (
            400,
            None,
            {"json": {**good, "messages": [{"role": "wizard", "content": "x"}]}, "headers": auth},
        ),
        (400, None, {"json": {**good, "n": 0}, "headers": auth}),
        (400, None, {"json": {**good, "temperature": "hot"}, "headers": auth}),
        (400, None, {"json": [1, 2], "headers": auth}),
        (401, "invalid_api_key", {"json": good, "headers": {"Authorization": "Bearer wrong"}}),
        (401, "invalid_api_key", {"json": good}),
        (405, None, {"method": "GET", "headers": auth}),
    ]
    with httpx.Client(timeout=30) as http:
        for status, code, kwargs in cases:
            method = kwargs.pop("method", "POST")
            response = http.request(method, url, **kwargs)
            assert response.status_code == status, (kwargs, response.text)
            error = response.json()["error"]
            assert error["message"] and set(error) == {"message", "type", "param", "code"}
            if code is not None:
                assert error["code"] == code
            ok = http.post(url, json=good, headers=auth)
            assert ok.status_code == 200, ok.text
        assert http.get(f"{server.url}/v1/nowhere", headers=auth).status_code == 404
        assert http.get(f"{server.url}/health").status_code == 200
    assert len(list(store.calls())) == len(cases)  # only the good calls are traced
    # The official client sees the same errors as its typed exceptions.
    with pytest.raises(openai.AuthenticationError):
        client(server.base_url, "wrong").chat.completions.create(model="tiny", messages=HELLO)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client(server.base_url, "sekret").chat.completions.create(
            model="tiny", messages=HELLO, max_tokens=-5
        )


def test_streams_reject_bad_requests_before_they_start(serve) -> None:
    server, _ = serve()
    long = [{"role": "user", "content": "word " * 2000}]
    with pytest.raises(openai.BadRequestError) as caught:
        client(server.base_url).chat.completions.create(
            model="tiny", messages=long, max_tokens=4, stream=True
        )
    assert caught.value.body["code"] == "context_length_exceeded"


class WatchesStreams:
    """The real backend, noting whether each stream ran to its end or was closed early."""

    def __init__(self, backend: EmbeddedBackend) -> None:
        self._backend = backend
        self.closed_early: list[bool] = []

    def __getattr__(self, name: str):
        return getattr(self._backend, name)

    async def stream(self, request: GenerateRequest):
        finished = False
        try:
            async for event in self._backend.stream(request):
                yield event
            finished = True
        finally:
            self.closed_early.append(not finished)


def test_a_client_that_leaves_mid_stream_stops_its_generation(backend, tmp_path) -> None:
    watched, store = WatchesStreams(backend), TraceStore(tmp_path)
    body = {"model": "tiny", "messages": HELLO, "max_tokens": 400, "stream": True}
    with EndpointServer(create_app(watched, store=store)) as server, httpx.Client() as http:
        with http.stream("POST", f"{server.base_url}/chat/completions", json=body) as response:
            assert response.status_code == 200
            next(response.iter_lines())  # one event, then hang up
        deadline = time.monotonic() + 10
        while not watched.closed_early and time.monotonic() < deadline:
            time.sleep(0.02)
        assert watched.closed_early == [True]  # the backend's stream was closed, not drained
        assert list(store.calls()) == []  # the answer never reached the client
        answer = client(server.base_url).chat.completions.create(
            model="tiny", messages=HELLO, max_tokens=2
        )
        assert answer.choices


class FailsOnMagic:
    """The real backend, except that one prompt raises an unexpected exception (a bug)."""

    def __init__(self, backend: EmbeddedBackend) -> None:
        self._backend = backend

    def __getattr__(self, name: str):
        return getattr(self._backend, name)

    async def generate(self, request: GenerateRequest) -> Generation:
        if request.messages and request.messages[-1]["content"] == "boom":
            raise RuntimeError("a bug")
        return await self._backend.generate(request)


def test_an_unexpected_error_is_a_500_and_the_server_keeps_serving(backend, tmp_path) -> None:
    with EndpointServer(create_app(FailsOnMagic(backend))) as server:
        api = client(server.base_url)
        with pytest.raises(openai.InternalServerError) as caught:
            api.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "boom"}], max_tokens=2
            )
        assert caught.value.status_code == 500 and caught.value.body["type"] == "server_error"
        assert api.chat.completions.create(model="tiny", messages=HELLO, max_tokens=2).choices


def test_64_concurrent_clients_all_succeed(serve) -> None:
    server, store = serve()

    async def one(i: int) -> str:
        api = openai.AsyncOpenAI(base_url=server.rollout_url(f"c{i}"), api_key="x", max_retries=0)
        try:
            response = await api.chat.completions.create(
                model="agent", messages=[{"role": "user", "content": f"n={i}"}], max_tokens=8
            )
            return response.id
        finally:
            await api.close()

    async def all_of_them() -> list[str]:
        return await asyncio.gather(*(one(i) for i in range(64)))

    ids = asyncio.run(all_of_them())
    records = {c.id: c for c in store.calls()}
    assert len(set(ids)) == 64 and set(ids) == set(records)
    assert {records[i].rollout_id for i in ids} == {f"c{i}" for i in range(64)}


class ScriptedToolCall:
    """The real backend and chat template, but the model "writes" a Hermes tool call.

    A random tiny model never emits `<tool_call>` by itself; this forces the completion's
    tokens (encoded by the real tokenizer) so the endpoint's parsing path is exercised.
    """

    TEXT = 'Let me add.<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'

    def __init__(self, backend: EmbeddedBackend) -> None:
        self._backend = backend
        self.chat_template = HERMES_TEMPLATE

    def __getattr__(self, name: str):
        return getattr(self._backend, name)

    async def generate(self, request: GenerateRequest) -> Generation:
        generation = await self._backend.generate(request)
        ids = self._backend.tokenizer(self.TEXT, add_special_tokens=False)["input_ids"]
        for completion in generation.completions:
            completion.token_ids, completion.text = ids, self._backend.decode(ids)
            completion.logprobs, completion.finish_reason, completion.stop_reason = (
                [0.0] * len(ids),
                "stop",
                None,
            )
        return generation

    async def stream(self, request: GenerateRequest):
        from masenvs.engine.protocol import StreamDelta

        generation = await self.generate(request)
        ids = generation.completions[0].token_ids
        for k in range(0, len(ids), 3):
            piece = ids[k : k + 3]
            text = self._backend.decode(ids[: k + 3])[len(self._backend.decode(ids[:k])) :]
            yield StreamDelta(0, piece, text, [0.0] * len(piece))
        yield generation


HERMES_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>"
    "Call a tool as <tool_call>{json}</tool_call>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "<|im_start|>assistant\n"
)
ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two numbers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "number"}}},
    },
}


def test_tool_calls_are_parsed_into_message_tool_calls(backend, tmp_path) -> None:
    store = TraceStore(tmp_path)
    with EndpointServer(create_app(ScriptedToolCall(backend), store=store)) as server:
        api = client(server.base_url)
        message = api.chat.completions.create(
            model="tiny", messages=HELLO, tools=[ADD_TOOL], max_tokens=40
        ).choices[0]
        assert message.finish_reason == "tool_calls"
        assert message.message.content == "Let me add."
        (call,) = message.message.tool_calls
        assert call.function.name == "add"
        assert json.loads(call.function.arguments) == {"a": 1, "b": 2}
        chunks = list(
            api.chat.completions.create(
                model="tiny", messages=HELLO, tools=[ADD_TOOL], max_tokens=40, stream=True
            )
        )
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
        assert streamed == "Let me add."  # the call's text is held back, not streamed
        calls = [t for c in chunks for t in (c.choices[0].delta.tool_calls or [])]
        assert [(t.index, t.function.name) for t in calls] == [(0, "add")]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        plain = api.chat.completions.create(
            model="tiny", messages=HELLO, tools=[ADD_TOOL], tool_choice="none", max_tokens=40
        )
        assert plain.choices[0].message.content == ScriptedToolCall.TEXT
    records = list(store.calls())
    assert records[0].tools == [ADD_TOOL]
    assert records[0].choices[0].tool_calls[0]["function"]["name"] == "add"
    assert records[0].choices[0].text == ScriptedToolCall.TEXT  # the trace keeps the raw text


def test_tools_reach_the_chat_template(serve, backend) -> None:
    original = backend.tokenizer.chat_template
    backend.tokenizer.chat_template = HERMES_TEMPLATE
    try:
        server, store = serve()
        client(server.base_url).chat.completions.create(
            model="tiny", messages=HELLO, tools=[ADD_TOOL], max_tokens=2
        )
    finally:
        backend.tokenizer.chat_template = original
    (record,) = store.calls()
    assert '"name": "add"' in backend.decode(record.prompt_token_ids)


def test_tool_parser_registry_follows_the_template() -> None:
    assert isinstance(tool_parser_for(HERMES_TEMPLATE), HermesToolParser)
    assert isinstance(tool_parser_for("{{ '[TOOL_CALLS]' }}"), MistralToolParser)
    assert tool_parser_for(load_model_template()) is None  # SmolLM2 renders no tools
    hermes = HermesToolParser()
    two = hermes.parse(
        '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {"x": 1}}</tool_call>'
    )
    assert [c["function"]["name"] for c in two.tool_calls] == ["a", "b"] and two.content is None
    broken = hermes.parse("<tool_call>{not json</tool_call>")
    assert broken.tool_calls == [] and broken.content == "<tool_call>{not json</tool_call>"
    mistral = MistralToolParser().parse('[TOOL_CALLS][{"name": "f", "arguments": {"q": "x"}}]')
    assert json.loads(mistral.tool_calls[0]["function"]["arguments"]) == {"q": "x"}


def load_model_template() -> str:
    from masenvs.engine.loading import load_tokenizer

    return load_tokenizer("tiny").chat_template


def _serve_cmd(traces: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "masenvs.adapters.serve",
        "--model",
        "tiny",
        "--traces",
        str(traces),
        "--port",
        "0",
        *extra,
    ]


def test_kill_9_after_n_responses_keeps_all_n_in_the_store(tmp_path: Path) -> None:
    traces = tmp_path / "traces"
    server = subprocess.Popen(
        _serve_cmd(traces), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        url = _wait_for_url(server)
        assert server.stdout is not None
        banner = [server.stdout.readline() for _ in range(2)]  # models, then the engine
        assert re.fullmatch(r"  engine: \w+, native CPU kernels (avx512|avx2|off .*)\n", banner[1])
        api = client(f"{url}/r/kill/v1")
        ids = [
            api.chat.completions.create(model="tiny", messages=HELLO, max_tokens=4).id
            for _ in range(5)
        ]
        chunks = list(
            api.chat.completions.create(model="tiny", messages=HELLO, max_tokens=4, stream=True)
        )
        ids.append(chunks[0].id)
        ids.append(api.completions.create(model="tiny", prompt="x", max_tokens=3).id)
    finally:
        os.kill(server.pid, signal.SIGKILL)
        server.wait()
    records: list[CallRecord] = list(TraceStore(traces).calls())
    assert [r.id for r in records] == ids


def _wait_for_url(process: subprocess.Popen) -> str:
    assert process.stdout is not None
    lines = []
    for line in process.stdout:
        lines.append(line)
        if "http://" in line and "/v1" in line:
            url = line[line.index("http://") :].split()[0].rstrip("/.")
            return url.removesuffix("/v1")
    raise AssertionError("serve exited before printing its URL:\n" + "".join(lines))


def test_serve_refuses_a_public_host_without_an_api_key(capsys, monkeypatch) -> None:
    from masenvs.adapters import serve

    monkeypatch.delenv("MASENVS_API_KEY", raising=False)
    assert serve.main(["--model", "tiny", "--host", "0.0.0.0"]) == 2
    assert "API key" in capsys.readouterr().err


def test_the_endpoint_package_exports_its_modules_public_names() -> None:
    import masenvs.adapters.endpoint as endpoint
    from masenvs.adapters.endpoint import routes, server, wire

    assert endpoint.Endpoint is routes.Endpoint and endpoint.create_app is routes.create_app
    assert endpoint.EndpointServer is server.EndpointServer
    assert endpoint.read_body is wire.read_body and endpoint.json_body is wire.json_body
    assert endpoint.STEP_HEADER == "X-Masenvs-Step" and endpoint.MAX_BODY_BYTES == 32 << 20
    assert endpoint.agent_and_step("critic@verdict") == ("critic", "verdict")
