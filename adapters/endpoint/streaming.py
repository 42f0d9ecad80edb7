"""Server-sent events: a backend's stream of deltas as OpenAI chat and completion chunks.

A stream is opened before the 200 goes out, so a request the backend rejects is a plain
error response; each call's trace record is stored before its finish reasons are sent.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.responses import Response, StreamingResponse

from masenvs.adapters.endpoint.recording import Call, generation_usage
from masenvs.adapters.endpoint.tools import HeldText, parse_tools
from masenvs.adapters.endpoint.wire import dumps, from_backend
from masenvs.adapters.openai_schema import (
    APIError,
    ChatRequest,
    CompletionRequest,
    chat_logprobs,
    completion_logprobs,
)
from masenvs.adapters.tool_parsers import ParsedOutput, ToolParser
from masenvs.engine.protocol import (
    Backend,
    BackendError,
    Completion,
    GenerateRequest,
    Generation,
    StreamDelta,
)

log = logging.getLogger("masenvs.endpoint")

Events = AsyncIterator[StreamDelta | Generation]
# Stores a finished call's trace record (Endpoint._record).
Record = Callable[[Call, Generation, list[ParsedOutput]], Awaitable[None]]


def sse_response(chunks: AsyncIterator[dict[str, Any]]) -> Response:
    """`chunks` as an event stream ending in `[DONE]`; an error mid-stream is its last event."""

    async def body() -> AsyncIterator[bytes]:
        try:
            async for chunk in chunks:
                yield b"data: " + dumps(chunk) + b"\n\n"
        except (APIError, BackendError) as exc:
            error = exc if isinstance(exc, APIError) else from_backend(exc)
            yield b"data: " + dumps(error.body()) + b"\n\n"
        except Exception:
            log.exception("unexpected error while streaming")
            error = APIError(500, "The server had an error while streaming.", type="server_error")
            yield b"data: " + dumps(error.body()) + b"\n\n"
        yield b"data: [DONE]\n\n"

    return StreamingResponse(
        body(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def open_stream(backend: Backend, request: GenerateRequest) -> Events:
    """The backend's stream, started: a request it rejects (a prompt too long, an
    unknown adapter) fails here, before the 200 and the event stream begin."""
    stream = backend.stream(request)
    try:
        first = await anext(stream)
    except BaseException:
        await aclose(stream)
        raise
    return _continue(stream, first)


async def _continue(stream: Events, first: StreamDelta | Generation) -> Events:
    # Closing the backend's stream when the client goes away stops its generation.
    try:
        yield first
        async for event in stream:
            yield event
    finally:
        await aclose(stream)


async def chat_chunks(
    call: Call,
    body: ChatRequest,
    parser: ToolParser | None,
    events: Events,
    texts: Any,
    record: Record,
) -> AsyncIterator[dict[str, Any]]:
    """Chat chunks for `events`; `texts` writes logprob tokens, `record` stores the trace."""

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
    held = [HeldText(parser) for _ in range(n)]
    generation: Generation | None = None
    async for event in events:
        if isinstance(event, Generation):
            generation = event
            break
        text = held[event.index].push(event.text)
        if not text and not event.token_ids:
            continue
        yield chunk([_delta_choice(event, text, body, texts)])
    if generation is None:
        raise RuntimeError("the backend's stream ended without its final Generation")
    outputs = [parse_tools(c.text, parser) for c in generation.completions]
    await record(call, generation, outputs)
    # Finish reasons go out only now, after the record is stored.
    for i, (completion, output) in enumerate(zip(generation.completions, outputs, strict=True)):
        extra: dict[str, Any] = {}
        if body.return_token_ids and i == 0:
            # vLLM sends these in its first chunk; the backend reports them at the end.
            extra["prompt_token_ids"] = generation.prompt_token_ids
        finish = _finish_choice(i, completion, output, held[i].rest(output), body)
        yield chunk([finish], **extra)
    if body.include_usage:
        yield chunk([], usage=generation_usage(generation))


def _delta_choice(event: StreamDelta, text: str, body: ChatRequest, texts: Any) -> dict[str, Any]:
    """A streamed piece of one choice: its text (held back where it may open a tool call),
    log-probs and token ids as the request asked."""
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
            texts,
        )
    if body.return_token_ids:
        choice["token_ids"] = event.token_ids
    return choice


def _finish_choice(
    index: int, completion: Completion, output: ParsedOutput, rest: str, body: ChatRequest
) -> dict[str, Any]:
    """A choice's last chunk: the text held back, its tool calls and why it finished."""
    delta: dict[str, Any] = {}
    if rest:
        delta["content"] = rest
    if output.tool_calls:
        delta["tool_calls"] = [{"index": k, **call_} for k, call_ in enumerate(output.tool_calls)]
    finish: dict[str, Any] = {
        "index": index,
        "delta": delta,
        "logprobs": None,
        "finish_reason": "tool_calls" if output.tool_calls else completion.finish_reason,
        "stop_reason": completion.stop_reason,
    }
    if body.return_token_ids:
        finish["token_ids"] = []
    return finish


async def completion_chunks(
    call: Call,
    body: CompletionRequest,
    events: Events,
    texts: Any,
    record: Record,
) -> AsyncIterator[dict[str, Any]]:
    """Completion chunks for `events`, as `chat_chunks` (no tool calls)."""

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
                texts,
                offsets[event.index],
            )
        offsets[event.index] += len(event.text)
        if body.return_token_ids:
            choice["token_ids"] = event.token_ids
        yield chunk([choice])
    if generation is None:
        raise RuntimeError("the backend's stream ended without its final Generation")
    await record(call, generation, [ParsedOutput(c.text) for c in generation.completions])
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
        yield chunk([], usage=generation_usage(generation))


async def aclose(stream: Any) -> None:
    """Close an async generator if it can be; its errors while closing do not matter."""
    close = getattr(stream, "aclose", None)
    if close is not None:
        with contextlib.suppress(Exception):
            await close()
