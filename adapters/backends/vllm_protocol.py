"""vLLM's OpenAI dialect: the request bodies masenvs sends and how its answers read back.

Every request asks for `return_token_ids` and `logprobs` with `return_tokens_as_token_ids`,
so each logprob token arrives as "token_id:<id>"; errors come as `{"error": {...}}` (or an
older flat shape) and become `BackendError`s with an OpenAI status and code.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from masenvs.engine.protocol import (
    BackendError,
    Completion,
    GenerateRequest,
    SamplingParams,
    StreamDelta,
)


def request_body(
    request: GenerateRequest, model: str, stream: bool, *, send_seed: bool
) -> tuple[str, dict[str, Any]]:
    """The route and JSON body for `request`, to the served name `model`."""
    params = request.params
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "n": params.n,
        "stop": params.stop,
        "stop_token_ids": params.stop_token_ids,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        "skip_special_tokens": False,
        "stream": stream,
    }
    if params.top_k > 0:
        body["top_k"] = params.top_k
    if params.repetition_penalty != 1.0:
        body["repetition_penalty"] = params.repetition_penalty
    if params.seed is not None and send_seed:
        body["seed"] = params.seed
    if stream:
        body["stream_options"] = {"include_usage": True}
    if (request.messages is None) == (request.prompt is None):
        raise BackendError("Give either chat messages or a prompt, not both or neither.")
    if request.messages is not None:
        body["messages"] = request.messages
        body["logprobs"] = True
        body["top_logprobs"] = params.top_logprobs
        if request.tools:
            body["tools"] = request.tools
            # The endpoint parses tool calls itself; "auto" would need vLLM's parser.
            body["tool_choice"] = "none"
        if request.chat_template_kwargs:
            body["chat_template_kwargs"] = request.chat_template_kwargs
        return "/v1/chat/completions", body
    body["prompt"] = request.prompt
    body["logprobs"] = params.top_logprobs  # chosen-token logprobs always come along
    return "/v1/completions", body


@dataclass
class ChoiceState:
    """A choice as it accumulates: ids, chosen logprobs and top alternatives."""

    token_ids: list[int]
    logprobs: list[float]
    top: list[dict[int, float]]
    sent_tokens: int = 0
    sent_text: str = ""


def token_id(token: str) -> int:
    # With return_tokens_as_token_ids, vLLM writes every token as "token_id:<id>".
    return int(token.rpartition(":")[2])


def choice_logprobs(
    choice: dict[str, Any], route: str, n_top: int
) -> tuple[list[float], list[dict[int, float]]]:
    logprobs = choice.get("logprobs")
    if not logprobs:
        return [], []
    if route.endswith("/chat/completions"):
        content = logprobs.get("content") or []
        chosen = [float(t["logprob"]) for t in content]
        top = [
            {
                token_id(alt["token"]): float(alt["logprob"])
                for alt in (t.get("top_logprobs") or [])[:n_top]
            }
            for t in content
        ]
        return chosen, top
    chosen = [float(x) for x in logprobs.get("token_logprobs") or []]
    top = []
    for position in logprobs.get("top_logprobs") or [None] * len(chosen):
        # The legacy shape also lists the sampled token; keep the n most likely.
        items = sorted((position or {}).items(), key=lambda kv: kv[1], reverse=True)[:n_top]
        top.append({token_id(token): float(lp) for token, lp in items})
    return chosen, top


def keep_before(decode: Any, ids: list[int], stop: str) -> int:
    """How many leading tokens spell text that ends before the stop string."""
    text = decode(ids)
    cut = text.find(stop)
    if cut < 0:
        return len(ids)
    keep = len(ids)
    while keep > 0:
        prefix = decode(ids[:keep])
        if len(prefix) <= cut and text.startswith(prefix) and not prefix.endswith("\ufffd"):
            break
        keep -= 1
    return keep


def held_delta(
    decode: Callable[[list[int]], str],
    eos_ids: frozenset[int],
    index: int,
    state: ChoiceState,
    params: SamplingParams,
) -> StreamDelta | None:
    """A streamed choice's tokens whose text no stop string can cut any more, if any are new
    (`state` then counts them as sent)."""
    hold = max((len(s) for s in params.stop), default=1) - 1
    full = decode(state.token_ids)
    safe = len(full) - hold
    upto, text = state.sent_tokens, state.sent_text
    for k in range(len(state.token_ids), state.sent_tokens, -1):
        candidate = full if k == len(state.token_ids) else decode(state.token_ids[:k])
        if (
            len(candidate) <= safe
            and not candidate.endswith("\ufffd")
            and candidate.startswith(state.sent_text)
        ):
            upto, text = k, candidate
            break
    # A final stop token's text is not part of the completion: never send it early.
    if upto and state.token_ids[upto - 1] in eos_ids | set(params.stop_token_ids):
        return None
    if upto == state.sent_tokens:
        return None
    delta = StreamDelta(
        index=index,
        token_ids=state.token_ids[state.sent_tokens : upto],
        text=text[len(state.sent_text) :],
        logprobs=state.logprobs[state.sent_tokens : upto],
        top_logprobs=state.top[state.sent_tokens : upto] if params.top_logprobs else None,
    )
    state.sent_tokens, state.sent_text = upto, text
    return delta


def read_completion(
    decode: Callable[[list[int]], str],
    eos_ids: frozenset[int],
    choice: ChoiceState,
    finish_reason: str,
    stop_reason: Any,
    params: SamplingParams,
) -> Completion:
    """vLLM's choice in the embedded backend's terms: ids cut to whole tokens before a stop
    string, a final EOS named as the stop reason and left out of the text."""
    ids, logprobs, top = list(choice.token_ids), list(choice.logprobs), list(choice.top)
    if finish_reason == "stop" and isinstance(stop_reason, str):
        keep = keep_before(decode, ids, stop_reason)
        del ids[keep:], logprobs[keep:], top[keep:]
        text = decode(ids)
    elif (
        finish_reason == "stop"
        and ids
        and (stop_reason is None or stop_reason == ids[-1])
        and (ids[-1] in eos_ids or ids[-1] in params.stop_token_ids)
    ):
        stop_reason = ids[-1]  # vLLM says None for EOS; the trace names the token
        text = decode(ids[:-1])
    else:
        text = decode(ids)
    return Completion(
        token_ids=ids,
        text=text,
        logprobs=logprobs,
        finish_reason=finish_reason,
        top_logprobs=top if params.top_logprobs else None,
        stop_reason=stop_reason,
    )


def device_of(info: dict[str, Any]) -> str | None:
    """The device a vLLM `/server_info` names (`vllm_config.device_config`), if any."""
    config = info.get("vllm_config")
    device = config.get("device_config") if isinstance(config, dict) else None
    if isinstance(device, dict):
        device = device.get("device_type") or device.get("device")
    return str(device).lower() if isinstance(device, str) and device else None


def error_from(status: int, text: str) -> BackendError:
    """vLLM's error body (`{"error": {...}}` or the older flat shape) as a BackendError."""
    try:
        body = json.loads(text)
        error = body.get("error", body) if isinstance(body, dict) else {}
        message = error.get("message") or text if isinstance(error, dict) else str(error)
    except (json.JSONDecodeError, AttributeError):
        message = text
    message = str(message).strip() or f"HTTP {status}"
    if status == 404:
        return BackendError(message, 404, "model_not_found")
    if status in (400, 422):
        code = "context_length_exceeded" if "context length" in message else "invalid_request"
        return BackendError(message, 400, code)
    if status == 401:
        return BackendError(f"vLLM rejected the API key: {message}", 502, "vllm_auth")
    return BackendError(f"vLLM failed ({status}): {message}", 502, "vllm_error")


def status_of(body: dict[str, Any]) -> int:
    error = body.get("error", body)
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, int) and 400 <= code < 600 else 500


def unreachable(url: str, exc: Exception) -> BackendError:
    return BackendError(
        f"Cannot reach vLLM at {url} ({type(exc).__name__}: {exc}); is `vllm serve` running "
        "there? `launch_vllm` starts one.",
        503,
        "backend_unavailable",
    )
