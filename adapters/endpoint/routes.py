"""The capture endpoint's ASGI app: routes, API keys and the OpenAI handlers.

`Endpoint` routes `/v1/...` and `/r/{rollout_id}/v1/...` (models, chat, completions), checks
each request's method and key, names the agent and step from `model`, resolves its policy,
asks the backend, and answers (or streams, `streaming.py`) once the call's trace record is
stored (`recording.py`). The package docstring (`masenvs.adapters.endpoint`) shows its use.
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
import uuid
from collections.abc import Iterable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route, Router
from starlette.types import Receive, Scope, Send

from masenvs.adapters.endpoint.recording import Call, call_record, gate_changes, generation_usage
from masenvs.adapters.endpoint.streaming import (
    chat_chunks,
    completion_chunks,
    open_stream,
    sse_response,
)
from masenvs.adapters.endpoint.tools import choose_tool_parser, parse_tools
from masenvs.adapters.endpoint.vllm_routes import engine_routes
from masenvs.adapters.endpoint.wire import JSON, error_response, from_backend, json_body, read_body
from masenvs.adapters.openai_schema import (
    APIError,
    ChatRequest,
    CompletionRequest,
    TokenText,
    chat_logprobs,
    completion_logprobs,
    now,
    parse,
)
from masenvs.adapters.policy_map import BASE, PolicyMap, UnknownModel
from masenvs.adapters.tool_parsers import ParsedOutput
from masenvs.engine.protocol import Backend, BackendError, Generation
from masenvs.sampling_args import DEFAULT as SAMPLING
from masenvs.traces import TraceStore

log = logging.getLogger("masenvs.endpoint")

MAX_ENDED_ROLLOUTS = 1 << 16  # ended rollouts remembered to refuse their late calls
_ANY = ["GET", "POST", "PUT", "PATCH", "DELETE"]  # wrong methods get a JSON 405 from guard


STEP_HEADER = "X-Masenvs-Step"
GATE_HEADER = "X-Masenvs-Gate"  # set by masenvs.mas.gate: the fields it dropped or overrode


def agent_and_step(model: str, header: str | None = None) -> tuple[str, str | None]:
    """`"critic@verdict"` -> ("critic", "verdict"): the agent picks the policy, the step names
    the decision (workflow groups key by it); without `@`, the X-Masenvs-Step header's."""
    agent, sep, step = model.partition("@")
    if not sep:
        step = (header or "").strip()
    return (agent, step or None) if agent else (model, None)


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
        default_max_tokens: int = SAMPLING.max_tokens,
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
        self._tool_parser = choose_tool_parser(backend, tool_parser)
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
                Route(f"{prefix}/models", self.guard(self._models, "GET"), methods=_ANY),
                Route(f"{prefix}/chat/completions", self.guard(self._chat, "POST"), methods=_ANY),
                Route(f"{prefix}/completions", self.guard(self._completions, "POST"), methods=_ANY),
            ]
        routes.append(Route("/health", self._health))
        if engine:  # an engine server: vLLM's adapter and weight routes (VLLMBackend drives it)
            routes += engine_routes(self.backend, self.guard)
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

    def guard(self, handler: Any, method: str) -> Any:
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
                return error_response(from_backend(error))
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
        return JSON({"object": "list", "data": data})

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
        call = Call(
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
            gate=gate_changes(request.headers.get(GATE_HEADER)),
        )
        parser = self._tool_parser if body.parse_tool_calls else None
        if body.parse_tool_calls and self._tools_unseen:
            self._warn_tools_dropped(call.agent)
        if body.stream:
            events = await open_stream(self.backend, call.request)
            chunks = chat_chunks(call, body, parser, events, self._texts(body), self._record)
            return sse_response(chunks)
        generation = await self.backend.generate(call.request)
        outputs = [parse_tools(c.text, parser) for c in generation.completions]
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
            "usage": generation_usage(generation),
        }
        if body.return_token_ids:
            response["prompt_token_ids"] = generation.prompt_token_ids
        return JSON(response)

    async def _completions(self, request: Request) -> Response:
        started_at = time.time()
        body = parse(CompletionRequest, await self._json_body(request))
        agent, step = agent_and_step(body.model, request.headers.get(STEP_HEADER))
        model = self._resolve(agent)
        generate = body.to_generate(self._backend_model(model))
        rollout_id = request.path_params.get("rollout_id")
        generate.affinity = rollout_id
        call = Call(
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
            events = await open_stream(self.backend, call.request)
            chunks = completion_chunks(call, body, events, self._texts(body), self._record)
            return sse_response(chunks)
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
        return JSON(
            {
                "id": call.id,
                "object": "text_completion",
                "created": int(call.started_at),
                "model": call.requested,
                "choices": choices,
                "usage": generation_usage(generation),
            }
        )

    # -- traces ----------------------------------------------------------------------------

    async def _record(
        self, call: Call, generation: Generation, outputs: list[ParsedOutput]
    ) -> None:
        self.calls_done += 1
        self.tokens_done += sum(len(c.token_ids) for c in generation.completions)
        if self.store is None:
            return
        record = call_record(
            call,
            generation,
            outputs,
            backend=self.backend_name,
            tokenizer_id=self._tokenizer_id,
            policy_version=self.policy_version,
            rollout_metadata=self._metadata.get(call.rollout_id or "", {}),
        )
        await self.store.append_async(record)


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


def _backend_name(backend: Backend) -> str:
    name = getattr(backend, "name", None)
    return name if isinstance(name, str) else type(backend).__name__
