"""The capture endpoint: an OpenAI-compatible HTTP server that records every call.

    endpoint = create_app(backend, store=TraceStore("runs/traces"),
                          policy_map=PolicyMap({"tool": "tool_lora"}))
    with EndpointServer(endpoint) as server:      # uvicorn on 127.0.0.1, a free port
        client = openai.OpenAI(base_url=server.rollout_url("r-17"), api_key="-")
        client.chat.completions.create(model="tool", messages=[...])

`/r/{rollout_id}/v1/...` attributes calls to a rollout; plain `/v1/...` serves a policy
(calls are still traced, with `rollout_id=None`). The request's `model` names the agent;
the policy map picks the adapter. Each call's record is written to the store before its
response (or its stream's final chunk) is sent.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hmac
import json
import logging
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterable
from typing import Any

import uvicorn
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route, Router
from starlette.types import Receive, Scope, Send

from masenvs.adapters.backends.base import (
    Backend,
    BackendError,
    Completion,
    GenerateRequest,
    Generation,
    StreamDelta,
)
from masenvs.adapters.openai_schema import (
    APIError,
    ChatRequest,
    CompletionRequest,
    TokenText,
    chat_logprobs,
    completion_logprobs,
    now,
    parse,
    usage,
)
from masenvs.adapters.policy_map import BASE, PolicyMap, UnknownModel
from masenvs.adapters.tool_parsers import TOOL_PARSERS, ParsedOutput, ToolParser, tool_parser_for
from masenvs.listeners import MAX_JSON_DEPTH, BodyError, parse_json
from masenvs.traces import CallRecord, ChoiceRecord, TraceStore

log = logging.getLogger("masenvs.endpoint")

MAX_BODY_BYTES = 32 << 20
MAX_BUFFERED_BYTES = 256 << 20  # bodies held while they arrive, all requests together
MAX_ENDED_ROLLOUTS = 1 << 16  # ended rollouts remembered to refuse their late calls
_ANY = ["GET", "POST", "PUT", "PATCH", "DELETE"]  # wrong methods get a JSON 405 from _guard


STEP_HEADER = "X-Masenvs-Step"
GATE_HEADER = "X-Masenvs-Gate"  # set by masenvs.mas.gate: the fields it dropped or overrode


def agent_and_step(model: str, header: str | None = None) -> tuple[str, str | None]:
    """`"critic@verdict"` -> ("critic", "verdict"): the agent picks the policy, the step names
    the decision (workflow groups key by it); without `@`, the X-Masenvs-Step header's."""
    agent, sep, step = model.partition("@")
    if not sep:
        step = (header or "").strip()
    return (agent, step or None) if agent else (model, None)


def _dumps(body: Any) -> bytes:
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()


class _JSON(JSONResponse):
    def render(self, content: Any) -> bytes:
        return _dumps(content)


def error_response(error: APIError) -> Response:
    return _JSON(error.body(), status_code=error.status)


@dataclasses.dataclass
class _Call:
    """What one request carries from parsing to its trace record."""

    id: str
    kind: str  # "chat" or "completion"
    rollout_id: str | None
    agent: str
    model: str
    call_index: int
    started_at: float
    request: GenerateRequest
    stream: bool
    step: str | None = None
    requested: str = ""  # the request's `model` as sent ("critic@verdict"), echoed back
    gate: dict[str, Any] | None = None  # what an auto-MAS gate changed in the request


class Endpoint:
    """The ASGI app (call it like one) plus what the trainer changes while it runs.

    `policy_version` is stamped on every record (the trainer bumps it after each weight
    sync); `set_rollout_metadata` attaches a dict to every record of one rollout.
    """

    def __init__(
        self,
        backend: Backend,
        *,
        store: TraceStore | None = None,
        policy_map: PolicyMap | None = None,
        api_key: str | None = None,
        served_model_names: Iterable[str] = (),
        default_max_tokens: int = 512,
        tool_parser: str | None = "auto",
        backend_name: str | None = None,
        engine: bool = False,
    ) -> None:
        self.backend = backend
        self.store = store
        self.policy_map = policy_map or PolicyMap()
        self.api_key = api_key
        self.served_model_names = list(served_model_names)
        self.default_max_tokens = default_max_tokens
        self.policy_version = 0
        self.calls_done = 0  # answered calls, and their completion tokens: progress figures
        self.tokens_done = 0
        self.backend_name = backend_name or _backend_name(backend)
        self._tokenizer_id = backend.tokenizer_id()
        self._tool_parser = _choose_tool_parser(backend, tool_parser)
        self._tools_unseen = tool_parser == "auto" and self._tool_parser is None
        self._warned_tools: set[str] = set()  # agents told their tools go nowhere
        self._token_text = TokenText(backend.decode)
        self._id_text = lambda token_id: f"token_id:{token_id}"
        self._metadata: dict[str, dict[str, Any]] = {}
        self._counters: dict[tuple[str | None, str, str | None], int] = {}
        self._counter_lock = threading.Lock()
        self._ended: dict[str, None] = {}  # insertion-ordered, oldest dropped first
        routes = []
        for prefix in ("/v1", "/r/{rollout_id}/v1"):
            routes += [
                Route(f"{prefix}/models", self._guard(self._models, "GET"), methods=_ANY),
                Route(f"{prefix}/chat/completions", self._guard(self._chat, "POST"), methods=_ANY),
                Route(
                    f"{prefix}/completions", self._guard(self._completions, "POST"), methods=_ANY
                ),
            ]
        routes.append(Route("/health", self._health))
        if engine:  # an engine server: vLLM's adapter and weight routes (VLLMBackend drives it)
            from masenvs.adapters.engine_server import engine_routes

            routes += engine_routes(self)
        self._router = Router(routes, default=self._not_found)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._router(scope, receive, send)

    # -- what the trainer and the rollout code call ----------------------------------------

    def set_rollout_metadata(self, rollout_id: str, metadata: dict[str, Any]) -> None:
        """Attach `metadata` (task id, seed, ...) to every later record of `rollout_id`."""
        self._metadata[rollout_id] = dict(metadata)

    def end_rollout(self, rollout_id: str, *, refuse_late_calls: bool = False) -> None:
        """Forget a finished rollout's call counters and metadata. With `refuse_late_calls`,
        later calls under its id get a 409 error and no record (a timed-out workflow run
        whose thread is still going must not add calls to the trace)."""
        self._metadata.pop(rollout_id, None)
        forget = getattr(self.backend, "end_rollout", None)  # a pool of engines unpins it
        if forget is not None:
            forget(rollout_id)
        with self._counter_lock:
            for key in [k for k in self._counters if k[0] == rollout_id]:
                del self._counters[key]
            if refuse_late_calls:
                self._ended[rollout_id] = None
                if len(self._ended) > MAX_ENDED_ROLLOUTS:
                    del self._ended[next(iter(self._ended))]

    def model_ids(self) -> list[str]:
        names = list(dict.fromkeys([*self.backend.model_names(), *self.served_model_names]))
        return names + [agent for agent in self.policy_map.routes if agent not in names]

    # -- plumbing --------------------------------------------------------------------------

    def _guard(self, handler: Any, method: str) -> Any:
        """Wrap a route: method and API key checks, and every failure as an OpenAI error."""

        async def endpoint(request: Request) -> Response:
            try:
                if request.method != method:
                    raise APIError(
                        405, f"Method {request.method} is not allowed here; use {method}."
                    )
                self._check_key(request)
                return await handler(request)
            except APIError as error:
                return error_response(error)
            except BackendError as error:
                return error_response(_from_backend(error))
            except Exception:
                log.exception("unexpected error serving %s %s", request.method, request.url.path)
                return error_response(
                    APIError(
                        500,
                        "The server had an error while processing your request; it is logged.",
                        type="server_error",
                    )
                )

        return endpoint

    def _check_key(self, request: Request) -> None:
        if not self.api_key:
            return
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            given.strip().encode(), self.api_key.encode()
        ):
            raise APIError(
                401,
                "Incorrect API key provided."
                if header
                else "You didn't provide an API key: send 'Authorization: Bearer <key>'.",
                code="invalid_api_key",
            )

    async def _not_found(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        response = error_response(
            APIError(404, f"Unknown route {path}; see /v1/models.", code="unknown_url")
        )
        await response(scope, receive, send)

    async def _health(self, request: Request) -> Response:
        return Response(status_code=200)

    async def _json_body(self, request: Request) -> Any:
        return json_body(await read_body(request))

    def _resolve(self, agent: str) -> str:
        try:
            return self.policy_map.resolve(agent, self._available())
        except UnknownModel as exc:
            raise APIError(404, str(exc), param="model", code="model_not_found") from None

    def _next_index(self, rollout_id: str | None, agent: str, step: str | None) -> int:
        # Requests the endpoint rejects get no index; one the backend rejects keeps its own.
        with self._counter_lock:
            if rollout_id in self._ended:
                raise APIError(
                    409,
                    f"Rollout {rollout_id!r} has ended (its run finished or timed out); "
                    "calls made after the end are refused and not recorded.",
                    code="rollout_ended",
                )
            index = self._counters.get((rollout_id, agent, step), 0)
            self._counters[(rollout_id, agent, step)] = index + 1
        return index

    def _warn_tools_dropped(self, agent: str) -> None:
        # Once per agent: a framework sends its tools with every call.
        if agent in self._warned_tools:
            return
        self._warned_tools.add(agent)
        model = self.backend.model_names()[0]
        log.warning(
            "agent %r sends tools, but the chat template of model %r has no tool-call syntax "
            "masenvs can parse: the model cannot call them and every answer comes back as "
            "plain text, so the program never sees a tool call. Serve a model whose template "
            "renders tools (Qwen2.5/Qwen3, Hermes, Mistral), or drop the tools.",
            agent,
            model,
        )

    def _texts(self, body: Any) -> Any:
        """How logprob tokens are written: their text, or "token_id:<id>" (vLLM's extra)."""
        return self._id_text if body.return_tokens_as_token_ids else self._token_text

    def _available(self) -> set[str]:
        return {*self.backend.model_names(), *self.served_model_names, BASE}

    def _backend_model(self, model: str) -> str:
        # Aliases of the base model reach the backend as "base".
        return BASE if model in self.served_model_names else model

    # -- routes ----------------------------------------------------------------------------

    async def _models(self, request: Request) -> Response:
        created = now()
        data = []
        for name in self.model_ids():
            card: dict[str, Any] = {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "masenvs",
            }
            if name in self.policy_map.routes:
                card["parent"] = self.policy_map.routes[name]
            data.append(card)
        return _JSON({"object": "list", "data": data})

    async def _chat(self, request: Request) -> Response:
        started_at = time.time()
        body = parse(ChatRequest, await self._json_body(request))
        agent, step = agent_and_step(body.model, request.headers.get(STEP_HEADER))
        model = self._resolve(agent)
        generate = body.to_generate(self._backend_model(model), self.default_max_tokens)
        # Framework programs cannot send per-agent template variables: the policy map does.
        generate.chat_template_kwargs = self.policy_map.template_kwargs(
            agent, generate.chat_template_kwargs
        )
        rollout_id = request.path_params.get("rollout_id")
        generate.affinity = rollout_id
        call = _Call(
            id=f"chatcmpl-{uuid.uuid4().hex}",
            kind="chat",
            rollout_id=rollout_id,
            agent=agent,
            model=model,
            call_index=self._next_index(rollout_id, agent, step),
            started_at=started_at,
            request=generate,
            stream=body.stream,
            step=step,
            requested=body.model,
            gate=_gate_changes(request.headers.get(GATE_HEADER)),
        )
        parser = self._tool_parser if body.parse_tool_calls else None
        if body.parse_tool_calls and self._tools_unseen:
            self._warn_tools_dropped(call.agent)
        if body.stream:
            events = await self._open_stream(call.request)
            return self._stream(self._chat_chunks(call, body, parser, events))
        generation = await self.backend.generate(call.request)
        outputs = [_parse_tools(c.text, parser) for c in generation.completions]
        await self._record(call, generation, outputs)
        choices = []
        for i, (completion, output) in enumerate(zip(generation.completions, outputs, strict=True)):
            message: dict[str, Any] = {"role": "assistant", "content": output.content}
            if output.tool_calls:
                message["tool_calls"] = output.tool_calls
            choice: dict[str, Any] = {
                "index": i,
                "message": message,
                "logprobs": None,
                "finish_reason": "tool_calls" if output.tool_calls else completion.finish_reason,
                "stop_reason": completion.stop_reason,  # vLLM's extra: what ended a "stop"
            }
            if body.logprobs:
                choice["logprobs"] = chat_logprobs(
                    completion.token_ids,
                    completion.logprobs,
                    completion.top_logprobs,
                    body.top_logprobs or 0,
                    self._texts(body),
                )
            if body.return_token_ids:
                choice["token_ids"] = completion.token_ids
            choices.append(choice)
        response: dict[str, Any] = {
            "id": call.id,
            "object": "chat.completion",
            "created": int(call.started_at),
            "model": call.requested,
            "choices": choices,
            "usage": _usage(generation),
        }
        if body.return_token_ids:
            response["prompt_token_ids"] = generation.prompt_token_ids
        return _JSON(response)

    async def _completions(self, request: Request) -> Response:
        started_at = time.time()
        body = parse(CompletionRequest, await self._json_body(request))
        agent, step = agent_and_step(body.model, request.headers.get(STEP_HEADER))
        model = self._resolve(agent)
        generate = body.to_generate(self._backend_model(model))
        rollout_id = request.path_params.get("rollout_id")
        generate.affinity = rollout_id
        call = _Call(
            id=f"cmpl-{uuid.uuid4().hex}",
            kind="completion",
            rollout_id=rollout_id,
            agent=agent,
            model=model,
            call_index=self._next_index(rollout_id, agent, step),
            started_at=started_at,
            request=generate,
            stream=body.stream,
            step=step,
            requested=body.model,
        )
        if body.stream:
            events = await self._open_stream(call.request)
            return self._stream(self._completion_chunks(call, body, events))
        generation = await self.backend.generate(call.request)
        await self._record(call, generation, [ParsedOutput(c.text) for c in generation.completions])
        choices = []
        for i, completion in enumerate(generation.completions):
            choice: dict[str, Any] = {
                "index": i,
                "text": completion.text,
                "logprobs": None,
                "finish_reason": completion.finish_reason,
                "stop_reason": completion.stop_reason,
            }
            if body.logprobs is not None:
                choice["logprobs"] = completion_logprobs(
                    completion.token_ids,
                    completion.logprobs,
                    completion.top_logprobs,
                    body.logprobs,
                    self._texts(body),
                )
            if body.return_token_ids:
                # vLLM puts both id lists on each completions choice.
                choice["prompt_token_ids"] = generation.prompt_token_ids
                choice["token_ids"] = completion.token_ids
            choices.append(choice)
        return _JSON(
            {
                "id": call.id,
                "object": "text_completion",
                "created": int(call.started_at),
                "model": call.requested,
                "choices": choices,
                "usage": _usage(generation),
            }
        )

    # -- streaming -------------------------------------------------------------------------

    def _stream(self, chunks: AsyncIterator[dict[str, Any]]) -> Response:
        async def body() -> AsyncIterator[bytes]:
            try:
                async for chunk in chunks:
                    yield b"data: " + _dumps(chunk) + b"\n\n"
            except (APIError, BackendError) as exc:
                error = exc if isinstance(exc, APIError) else _from_backend(exc)
                yield b"data: " + _dumps(error.body()) + b"\n\n"
            except Exception:
                log.exception("unexpected error while streaming")
                error = APIError(
                    500, "The server had an error while streaming.", type="server_error"
                )
                yield b"data: " + _dumps(error.body()) + b"\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(
            body(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def _open_stream(
        self, request: GenerateRequest
    ) -> AsyncIterator[StreamDelta | Generation]:
        """The backend's stream, started: a request it rejects (a prompt too long, an
        unknown adapter) fails here, before the 200 and the event stream begin."""
        stream = self.backend.stream(request)
        try:
            first = await anext(stream)
        except BaseException:
            await _aclose(stream)
            raise
        return self._continue(stream, first)

    async def _continue(
        self, stream: AsyncIterator[StreamDelta | Generation], first: StreamDelta | Generation
    ) -> AsyncIterator[StreamDelta | Generation]:
        # Closing the backend's stream when the client goes away stops its generation.
        try:
            yield first
            async for event in stream:
                yield event
        finally:
            await _aclose(stream)

    async def _chat_chunks(
        self,
        call: _Call,
        body: ChatRequest,
        parser: ToolParser | None,
        events: AsyncIterator[StreamDelta | Generation],
    ) -> AsyncIterator[dict[str, Any]]:
        def chunk(choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
            out = {
                "id": call.id,
                "object": "chat.completion.chunk",
                "created": int(call.started_at),
                "model": call.requested,
                "choices": choices,
                **extra,
            }
            if body.include_usage and "usage" not in out:
                out["usage"] = None
            return out

        n = call.request.params.n
        first = [
            {
                "index": i,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            for i in range(n)
        ]
        if body.return_token_ids:
            for choice in first:
                choice["token_ids"] = []
        yield chunk(first)
        held = [_HeldText(parser) for _ in range(n)]
        generation: Generation | None = None
        async for event in events:
            if isinstance(event, Generation):
                generation = event
                break
            text = held[event.index].push(event.text)
            if not text and not event.token_ids:
                continue
            choice: dict[str, Any] = {
                "index": event.index,
                "delta": {"content": text} if text else {},
                "logprobs": None,
                "finish_reason": None,
            }
            if body.logprobs:
                choice["logprobs"] = chat_logprobs(
                    event.token_ids,
                    event.logprobs,
                    event.top_logprobs,
                    body.top_logprobs or 0,
                    self._texts(body),
                )
            if body.return_token_ids:
                choice["token_ids"] = event.token_ids
            yield chunk([choice])
        if generation is None:
            raise RuntimeError("the backend's stream ended without its final Generation")
        outputs = [_parse_tools(c.text, parser) for c in generation.completions]
        await self._record(call, generation, outputs)
        # Finish reasons go out only now, after the record is stored.
        for i, (completion, output) in enumerate(zip(generation.completions, outputs, strict=True)):
            delta: dict[str, Any] = {}
            rest = held[i].rest(output)
            if rest:
                delta["content"] = rest
            if output.tool_calls:
                delta["tool_calls"] = [
                    {"index": k, **call_} for k, call_ in enumerate(output.tool_calls)
                ]
            extra: dict[str, Any] = {}
            if body.return_token_ids and i == 0:
                # vLLM sends these in its first chunk; the backend reports them at the end.
                extra["prompt_token_ids"] = generation.prompt_token_ids
            finish: dict[str, Any] = {
                "index": i,
                "delta": delta,
                "logprobs": None,
                "finish_reason": "tool_calls" if output.tool_calls else completion.finish_reason,
                "stop_reason": completion.stop_reason,
            }
            if body.return_token_ids:
                finish["token_ids"] = []
            yield chunk([finish], **extra)
        if body.include_usage:
            yield chunk([], usage=_usage(generation))

    async def _completion_chunks(
        self,
        call: _Call,
        body: CompletionRequest,
        events: AsyncIterator[StreamDelta | Generation],
    ) -> AsyncIterator[dict[str, Any]]:
        def chunk(choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
            out = {
                "id": call.id,
                "object": "text_completion",
                "created": int(call.started_at),
                "model": call.requested,
                "choices": choices,
                **extra,
            }
            if body.include_usage and "usage" not in out:
                out["usage"] = None
            return out

        offsets = [0] * call.request.params.n
        generation: Generation | None = None
        async for event in events:
            if isinstance(event, Generation):
                generation = event
                break
            if not event.text and not event.token_ids:
                continue
            choice: dict[str, Any] = {
                "index": event.index,
                "text": event.text,
                "logprobs": None,
                "finish_reason": None,
            }
            if body.logprobs is not None:
                choice["logprobs"] = completion_logprobs(
                    event.token_ids,
                    event.logprobs,
                    event.top_logprobs,
                    body.logprobs,
                    self._texts(body),
                    offsets[event.index],
                )
            offsets[event.index] += len(event.text)
            if body.return_token_ids:
                choice["token_ids"] = event.token_ids
            yield chunk([choice])
        if generation is None:
            raise RuntimeError("the backend's stream ended without its final Generation")
        await self._record(call, generation, [ParsedOutput(c.text) for c in generation.completions])
        for i, completion in enumerate(generation.completions):
            choice = {
                "index": i,
                "text": "",
                "logprobs": None,
                "finish_reason": completion.finish_reason,
                "stop_reason": completion.stop_reason,
            }
            if body.return_token_ids:
                choice["prompt_token_ids"] = generation.prompt_token_ids
                choice["token_ids"] = []
            yield chunk([choice])
        if body.include_usage:
            yield chunk([], usage=_usage(generation))

    # -- traces ----------------------------------------------------------------------------

    async def _record(
        self, call: _Call, generation: Generation, outputs: list[ParsedOutput]
    ) -> None:
        self.calls_done += 1
        self.tokens_done += sum(len(c.token_ids) for c in generation.completions)
        if self.store is None:
            return
        request = call.request
        record = CallRecord(
            id=call.id,
            rollout_id=call.rollout_id,
            agent=call.agent,
            model=call.model,
            call_index=call.call_index,
            kind=call.kind,  # type: ignore[arg-type]
            prompt_token_ids=generation.prompt_token_ids,
            choices=[
                _choice_record(i, completion, output)
                for i, (completion, output) in enumerate(
                    zip(generation.completions, outputs, strict=True)
                )
            ],
            messages=request.messages,
            tools=request.tools,
            prompt=request.prompt,
            params=_params(request),
            stream=call.stream,
            backend=self.backend_name,
            tokenizer_id=self._tokenizer_id,
            policy_version=self.policy_version
            if generation.policy_version is None
            else generation.policy_version,
            started_at=call.started_at,
            finished_at=time.time(),
            metadata=_call_metadata(self._metadata.get(call.rollout_id or "", {}), call.gate),
            step=call.step,
        )
        await self.store.append_async(record)


async def read_body(request: Request, limit: int = MAX_BODY_BYTES) -> bytes:
    """The request's body, refused (413) as soon as it passes `limit` bytes: the length a
    client announces is checked first, and a chunked body is counted while it streams."""
    length = request.headers.get("content-length")
    if length is not None and not length.strip().isdigit():
        raise APIError(400, "Content-Length must be a non-negative number of bytes.")
    if length is not None and int(length) > limit:
        raise APIError(413, f"The request body is larger than {limit} bytes.")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"The request body is larger than {limit} bytes.")
            # Many clients uploading at once (slowly, each under the cap) share one budget.
            if not _bodies.take(len(chunk)):
                raise APIError(
                    503,
                    "The server is receiving too many request bodies at once; retry shortly.",
                    type="server_error",
                )
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        _bodies.give(sum(len(c) for c in chunks))


class _Bodies:
    """Bytes of request bodies being received right now, over every endpoint in the process."""

    def __init__(self) -> None:
        self.held = 0
        self._lock = threading.Lock()  # endpoints in other threads share the budget

    def take(self, n: int) -> bool:
        with self._lock:
            if self.held + n > MAX_BUFFERED_BYTES:
                return False
            self.held += n
            return True

    def give(self, n: int) -> None:
        with self._lock:
            self.held -= n


_bodies = _Bodies()


def json_body(raw: bytes) -> Any:
    """`raw` parsed as JSON, or a 400 APIError: not JSON, or nested deeper than any request."""
    try:
        return parse_json(raw)
    except BodyError as exc:
        raise APIError(
            400,
            f"We could not parse the JSON body of your request ({exc}). The body must be "
            f"JSON, nested at most {MAX_JSON_DEPTH} levels, with 'Content-Type: application/json'.",
        ) from None


def create_app(
    backend: Backend,
    store: TraceStore | None = None,
    policy_map: PolicyMap | dict[str, str] | None = None,
    api_key: str | None = None,
    served_model_names: Iterable[str] = (),
    **options: Any,
) -> Endpoint:
    """The endpoint ASGI app; `policy_map` may be a plain {agent: adapter} dict."""
    if isinstance(policy_map, dict):
        policy_map = PolicyMap(policy_map)
    return Endpoint(
        backend,
        store=store,
        policy_map=policy_map,
        api_key=api_key,
        served_model_names=served_model_names,
        **options,
    )


class _HeldText:
    """Streams a choice's text, holding back whatever may be the start of a tool call."""

    def __init__(self, parser: ToolParser | None) -> None:
        self.parser = parser
        self.text = ""
        self.sent = 0
        self.in_call = False

    def push(self, piece: str) -> str:
        self.text += piece
        if self.parser is None:
            self.sent = len(self.text)
            return piece
        if self.in_call:
            return ""
        marker = self.parser.start
        found = self.text.find(marker, self.sent)
        if found >= 0:
            self.in_call = True
            out, self.sent = self.text[self.sent : found], found
            return out
        # Keep back a tail that could grow into the marker.
        keep = 0
        for k in range(min(len(marker) - 1, len(self.text) - self.sent), 0, -1):
            if marker.startswith(self.text[-k:]):
                keep = k
                break
        end = len(self.text) - keep
        out, self.sent = self.text[self.sent : end], end
        return out

    def rest(self, output: ParsedOutput) -> str:
        """Text not yet sent that belongs to the content: none when the rest is tool calls
        (everything before the call marker has been sent)."""
        return "" if output.tool_calls else self.text[self.sent :]


async def _aclose(stream: Any) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        with contextlib.suppress(Exception):
            await aclose()


def _parse_tools(text: str, parser: ToolParser | None) -> ParsedOutput:
    return parser.parse(text) if parser is not None else ParsedOutput(content=text)


def _choice_record(index: int, completion: Completion, output: ParsedOutput) -> ChoiceRecord:
    return ChoiceRecord(
        index=index,
        text=completion.text,
        token_ids=completion.token_ids,
        logprobs=completion.logprobs,
        finish_reason="tool_calls" if output.tool_calls else completion.finish_reason,
        top_logprobs=completion.top_logprobs,
        tool_calls=output.tool_calls or None,
        stop_reason=completion.stop_reason,
    )


def _gate_changes(header: str | None) -> dict[str, Any] | None:
    """The gate's header as a dict (anything else is ignored: it is only a note)."""
    if not header or len(header) > 8192:
        return None
    try:
        changes = json.loads(header)
    except (ValueError, RecursionError):
        return None
    return changes if isinstance(changes, dict) else None


def _call_metadata(rollout: dict[str, Any], gate: dict[str, Any] | None) -> dict[str, Any]:
    return {**rollout, "gate": gate} if gate else rollout


def _params(request: GenerateRequest) -> dict[str, Any]:
    """What the trace keeps of how a call was made: sampling and chat template variables."""
    params = dataclasses.asdict(request.params)
    if request.chat_template_kwargs:
        params["chat_template_kwargs"] = dict(request.chat_template_kwargs)
    return params


def _usage(generation: Generation) -> dict[str, int]:
    completion_tokens = sum(len(c.token_ids) for c in generation.completions)
    return usage(len(generation.prompt_token_ids), completion_tokens)


def _from_backend(error: BackendError) -> APIError:
    status = error.status if 400 <= error.status < 600 else 500
    return APIError(
        status,
        str(error),
        type="invalid_request_error" if status < 500 else "server_error",
        code=error.code,
    )


def _backend_name(backend: Backend) -> str:
    name = getattr(backend, "name", None)
    return name if isinstance(name, str) else type(backend).__name__


def _choose_tool_parser(backend: Backend, choice: str | None) -> ToolParser | None:
    if choice is None or choice == "none":
        return None
    if choice != "auto":
        if choice not in TOOL_PARSERS:
            raise ValueError(f"unknown tool parser {choice!r}; known: {', '.join(TOOL_PARSERS)}")
        return TOOL_PARSERS[choice]
    template = getattr(backend, "chat_template", None)
    if template is None:
        tokenizer = getattr(backend, "tokenizer", None)
        template = getattr(tokenizer, "chat_template", None)
    return tool_parser_for(template if isinstance(template, str) else None)


class EndpointServer:
    """Runs an ASGI app with uvicorn in a background thread (loopback, free port by default)."""

    def __init__(
        self,
        app: Any,
        host: str = "127.0.0.1",
        port: int = 0,
        log_level: str = "warning",
    ) -> None:
        self.app = app
        self.host = host
        self.port = port
        self.log_level = log_level
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    def start(self, timeout: float = 30.0) -> str:
        """Start serving and return the root URL, e.g. `http://127.0.0.1:41234`."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        # IPPROTO_TCP explicitly: asyncio turns Nagle off (TCP_NODELAY) only for sockets
        # whose proto says TCP; without it each JSON response waits ~40 ms for a delayed ACK.
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        sock.listen(2048)
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            self.app,
            log_level=self.log_level,
            access_log=False,
            lifespan="off",
            timeout_keep_alive=30,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run,
            kwargs={"sockets": [sock]},
            name="masenvs-endpoint",
            daemon=True,
        )
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the endpoint did not start on {self.host}:{self.port}")
            time.sleep(0.01)
        return self.url

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def base_url(self) -> str:
        """The plain OpenAI base URL (`.../v1`)."""
        return f"{self.url}/v1"

    def rollout_url(self, rollout_id: str) -> str:
        """The OpenAI base URL whose calls are recorded under `rollout_id`."""
        return f"{self.url}/r/{rollout_id}/v1"

    def stop(self, timeout: float = 10.0) -> None:
        if self._server is not None and self._thread is not None:
            self._server.should_exit = True
            self._thread.join(timeout)
        self._server = self._thread = None

    def __enter__(self) -> EndpointServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
