"""The OpenAI HTTP API as the endpoint speaks it: request validation, errors, response bodies.

Requests are validated with pydantic and turned into the backend's `GenerateRequest`;
fields the OpenAI API defines but the endpoint cannot honour are rejected with a 400 that
says so, harmless ones (`user`, zero penalties, ...) are accepted and ignored. vLLM's
extras `top_k`, `repetition_penalty`, `stop_token_ids`, `return_token_ids` and
`chat_template_kwargs` work too.
"""

from __future__ import annotations

import contextlib
import json
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from masenvs.engine.protocol import Completion, GenerateRequest, SamplingParams
from masenvs.sampling_args import DEFAULT as SAMPLING
from masenvs.sampling_args import SamplingArgs

MAX_STOPS = 64  # stop sequences in one request (OpenAI allows 4)
MAX_STOP_CHARS = 1024  # characters of one stop sequence


class APIError(Exception):
    """An error answered as OpenAI's `{"error": {...}}` body with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def validation_error(exc: ValidationError) -> APIError:
    """The first problem of a pydantic error as a 400 naming the offending field."""
    first = exc.errors()[0]
    loc = ""
    for part in first["loc"]:
        loc += f"[{part}]" if isinstance(part, int) else (f".{part}" if loc else str(part))
    message = first["msg"]
    if first["type"] == "missing":
        message = f"Missing required parameter: '{loc}'."
    elif first["type"] == "extra_forbidden":
        message = f"Unrecognized request argument supplied: '{loc}'."
    else:
        message = f"Invalid value for '{loc}': {message}."
    return APIError(400, message, param=loc or None, code="invalid_value")


MIN_TOKENS = SamplingArgs.bounds("max_tokens")["ge"]


def _or_default(value: Any, name: str) -> Any:
    """A request's knob, or SamplingArgs' default where the request leaves it unset."""
    return getattr(SAMPLING, name) if value is None else value


class _Request(BaseModel):
    # Unknown fields are tolerated: clients send provider-specific extras.
    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    n: int = Field(1, ge=1, le=128)
    # The sampling knobs' bounds are SamplingArgs' (masenvs/engine/sampling_args.py); unset,
    # each takes its default there (OpenAI's: temperature and top_p 1).
    temperature: float | None = Field(None, **SamplingArgs.bounds("temperature"))
    top_p: float | None = Field(None, **SamplingArgs.bounds("top_p"))
    top_k: int | None = Field(None, **SamplingArgs.bounds("top_k"))
    # vLLM's extra: scores of tokens already in the prompt or the answer are divided by it
    # (positive) or multiplied (negative) before sampling; log-probs stay the raw model's.
    repetition_penalty: float | None = Field(None, **SamplingArgs.bounds("repetition_penalty"))
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    return_token_ids: bool = False
    # vLLM's extra: logprob tokens written "token_id:<id>" (what VLLMBackend asks for).
    return_tokens_as_token_ids: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    best_of: int | None = None
    ignore_eos: bool = False  # vLLM's extra: sample past EOS (benchmarks)

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and any(not s for s in value):
            raise ValueError("stop sequences must be non-empty strings")
        # Every stop string is looked for after every token: bounded, so one request
        # cannot make each decoding step cost seconds.
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(
                f"at most {MAX_STOPS} stop sequences of at most {MAX_STOP_CHARS} characters"
            )
        return value

    def check_unsupported(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise APIError(
                    400,
                    f"'{name}' is not supported by this endpoint; its log-probabilities must "
                    "stay those of the raw model. Leave it unset or 0.",
                    param=name,
                    code="unsupported_parameter",
                )
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, "'best_of' is not supported; use 'n'.", param="best_of")
        if self.stream_options is not None and not self.stream:
            raise APIError(
                400,
                "'stream_options' is only allowed when 'stream' is true.",
                param="stream_options",
            )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))

    def sampling(self, max_tokens: int, top_logprobs: int) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=_or_default(self.temperature, "temperature"),
            top_p=_or_default(self.top_p, "top_p"),
            top_k=max(self.top_k or 0, 0),  # vLLM's -1 and 0 both turn top-k off
            repetition_penalty=_or_default(self.repetition_penalty, "repetition_penalty"),
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            seed=self.seed,
            n=self.n,
            top_logprobs=top_logprobs,
            ignore_eos=self.ignore_eos,
        )


ROLES = ("system", "developer", "user", "assistant", "tool", "function")


class ChatRequest(_Request):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def to_generate(self, model: str, default_max_tokens: int) -> GenerateRequest:
        self.check_unsupported()
        max_tokens = self.max_completion_tokens
        param = "max_completion_tokens"
        if max_tokens is None:
            max_tokens, param = self.max_tokens, "max_tokens"
        if max_tokens is None:
            max_tokens = default_max_tokens
        elif max_tokens < MIN_TOKENS:
            raise APIError(
                400,
                f"Invalid '{param}': integer below minimum value. Expected a value >= "
                f"{MIN_TOKENS}, "
                f"but got {max_tokens} instead.",
                param=param,
                code="integer_below_min_value",
            )
        if self.top_logprobs and not self.logprobs:
            raise APIError(
                400, "'top_logprobs' requires 'logprobs' to be true.", param="top_logprobs"
            )
        return GenerateRequest(
            model=model,
            params=self.sampling(max_tokens, self.top_logprobs or 0),
            messages=[_chat_message(m, i) for i, m in enumerate(self.messages)],
            tools=self.tools or None,
            chat_template_kwargs=dict(self.chat_template_kwargs or {}),
        )

    @property
    def parse_tool_calls(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for legacy completions
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None

    def to_generate(self, model: str) -> GenerateRequest:
        self.check_unsupported()
        if self.echo:
            raise APIError(400, "'echo' is not supported by this endpoint.", param="echo")
        if self.suffix:
            raise APIError(400, "'suffix' is not supported by this endpoint.", param="suffix")
        max_tokens = 16 if self.max_tokens is None else self.max_tokens
        if max_tokens < MIN_TOKENS:
            raise APIError(
                400,
                "Invalid 'max_tokens': integer below minimum value. Expected a value >= "
                f"{MIN_TOKENS}, "
                f"but got {max_tokens} instead.",
                param="max_tokens",
                code="integer_below_min_value",
            )
        return GenerateRequest(
            model=model,
            params=self.sampling(max_tokens, self.logprobs or 0),
            prompt=self.single_prompt(),
        )

    def single_prompt(self) -> str | list[int]:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise APIError(
                    400,
                    "Send one prompt per request (a list of several prompts is not supported).",
                    param="prompt",
                )
            prompt = prompt[0]
        if not prompt:
            raise APIError(400, "'prompt' must not be empty.", param="prompt")
        if isinstance(prompt, list) and any(t < 0 for t in prompt):
            raise APIError(400, "Token ids in 'prompt' must be >= 0.", param="prompt")
        return prompt


def _chat_message(message: dict[str, Any], index: int) -> dict[str, Any]:
    """A message as chat templates expect it: `content` is a string."""
    role = message.get("role")
    if role not in ROLES:
        raise APIError(
            400,
            f"Invalid value for 'messages[{index}].role': {role!r}; expected one of "
            f"{', '.join(ROLES)}.",
            param=f"messages[{index}].role",
        )
    content = message.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise APIError(
                    400,
                    f"Only text content is supported; messages[{index}] has a {kind!r} part.",
                    param=f"messages[{index}].content",
                )
            texts.append(str(part.get("text", "")))
        content = "".join(texts)
    elif content is None:
        content = ""  # assistant messages with tool_calls; templates concatenate content
    elif not isinstance(content, str):
        raise APIError(
            400,
            f"Invalid type for 'messages[{index}].content': expected a string or a list of "
            "text parts.",
            param=f"messages[{index}].content",
        )
    out = dict(message)
    out["content"] = content
    if "tool_calls" in out and out["tool_calls"]:
        # Templates (Qwen, Hermes) index `arguments` as a mapping; the API sends JSON text.
        out["tool_calls"] = [_template_tool_call(call) for call in out["tool_calls"]]
    return out


def _template_tool_call(call: Any) -> Any:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return call
    function = dict(call["function"])
    if isinstance(function.get("arguments"), str):
        with contextlib.suppress(json.JSONDecodeError):
            function["arguments"] = json.loads(function["arguments"])
    return {**call, "function": function}


def parse(model: type[ChatRequest] | type[CompletionRequest], body: Any) -> Any:
    if not isinstance(body, dict):
        raise APIError(400, "The request body must be a JSON object.")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from None


# -- responses ---------------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def now() -> int:
    return int(time.time())


class TokenText:
    """Per-token strings for logprobs, decoded once per token id and cached."""

    def __init__(self, decode: Any) -> None:
        self._decode = decode
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._decode([token_id])
            if len(self._cache) < 1 << 20:
                self._cache[token_id] = text
        return text


def chat_logprobs(
    token_ids: list[int],
    logprobs: list[float],
    top: list[dict[int, float]] | None,
    n_top: int,
    token_text: TokenText,
) -> dict[str, Any]:
    content = []
    for position, (token_id, logprob) in enumerate(zip(token_ids, logprobs, strict=True)):
        text = token_text(token_id)
        alternatives = []
        if n_top and top is not None and position < len(top):
            best = sorted(top[position].items(), key=lambda kv: kv[1], reverse=True)[:n_top]
            for alt_id, alt_logprob in best:
                alt_text = token_text(alt_id)
                alternatives.append(
                    {"token": alt_text, "logprob": alt_logprob, "bytes": list(alt_text.encode())}
                )
        content.append(
            {
                "token": text,
                "logprob": logprob,
                "bytes": list(text.encode()),
                "top_logprobs": alternatives,
            }
        )
    return {"content": content, "refusal": None}


def completion_logprobs(
    token_ids: list[int],
    logprobs: list[float],
    top: list[dict[int, float]] | None,
    n_top: int,
    token_text: TokenText,
    offset: int = 0,
) -> dict[str, Any]:
    """The legacy completions shape: parallel lists of tokens, logprobs and offsets."""
    tokens, offsets, tops = [], [], []
    for position, token_id in enumerate(token_ids):
        text = token_text(token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if n_top and top is not None and position < len(top):
            best = sorted(top[position].items(), key=lambda kv: kv[1], reverse=True)[:n_top]
            tops.append({token_text(alt_id): alt_lp for alt_id, alt_lp in best})
        else:
            tops.append(None)
    return {
        "tokens": tokens,
        "token_logprobs": list(logprobs),
        "top_logprobs": tops,
        "text_offset": offsets,
    }


FinishReason = Literal["stop", "length", "tool_calls"]


def finish_reason(completion: Completion, has_tool_calls: bool) -> str:
    return "tool_calls" if has_tool_calls else completion.finish_reason
