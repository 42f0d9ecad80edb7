"""What one call carries from parsing to its trace record, and the record itself."""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

from masenvs.adapters.openai_schema import usage
from masenvs.adapters.tool_parsers import ParsedOutput
from masenvs.engine.protocol import Completion, GenerateRequest, Generation
from masenvs.traces import CallRecord, ChoiceRecord


@dataclasses.dataclass
class Call:
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


def call_record(
    call: Call,
    generation: Generation,
    outputs: list[ParsedOutput],
    *,
    backend: str,
    tokenizer_id: str,
    policy_version: int,
    rollout_metadata: dict[str, Any],
) -> CallRecord:
    """The trace record of a finished call (stamped with the time it finished)."""
    request = call.request
    return CallRecord(
        id=call.id,
        rollout_id=call.rollout_id,
        agent=call.agent,
        model=call.model,
        call_index=call.call_index,
        kind=call.kind,  # type: ignore[arg-type]
        prompt_token_ids=generation.prompt_token_ids,
        choices=[
            choice_record(i, completion, output)
            for i, (completion, output) in enumerate(
                zip(generation.completions, outputs, strict=True)
            )
        ],
        messages=request.messages,
        tools=request.tools,
        prompt=request.prompt,
        params=call_params(request),
        stream=call.stream,
        backend=backend,
        tokenizer_id=tokenizer_id,
        policy_version=policy_version
        if generation.policy_version is None
        else generation.policy_version,
        started_at=call.started_at,
        finished_at=time.time(),
        metadata=call_metadata(rollout_metadata, call.gate),
        step=call.step,
    )


def choice_record(index: int, completion: Completion, output: ParsedOutput) -> ChoiceRecord:
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


def gate_changes(header: str | None) -> dict[str, Any] | None:
    """The gate's header as a dict (anything else is ignored: it is only a note)."""
    if not header or len(header) > 8192:
        return None
    try:
        changes = json.loads(header)
    except (ValueError, RecursionError):
        return None
    return changes if isinstance(changes, dict) else None


def call_metadata(rollout: dict[str, Any], gate: dict[str, Any] | None) -> dict[str, Any]:
    return {**rollout, "gate": gate} if gate else rollout


def call_params(request: GenerateRequest) -> dict[str, Any]:
    """What the trace keeps of how a call was made: sampling and chat template variables."""
    params = dataclasses.asdict(request.params)
    if request.chat_template_kwargs:
        params["chat_template_kwargs"] = dict(request.chat_template_kwargs)
    return params


def generation_usage(generation: Generation) -> dict[str, int]:
    """The OpenAI `usage` of a generation: prompt and completion token counts."""
    completion_tokens = sum(len(c.token_ids) for c in generation.completions)
    return usage(len(generation.prompt_token_ids), completion_tokens)
