"""A request and its sequences as the engine thread sees them, from arrival to result.

A `Request` arrives from asyncio code (see `engine`); the scheduler gives each of its n
choices a `Sequence` (a KV-cache row and a random stream), and `send` hands deltas and
the final `Generation` back to the request's event loop.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from masenvs.engine.lora import LoraAdapter
from masenvs.engine.protocol import GenerateRequest
from masenvs.engine.sampling import RowSampling


@dataclass(eq=False)
class Request:
    """A request while the engine serves it: its prompt ids, stop rules and reply queue."""

    request: GenerateRequest
    prompt_ids: list[int]
    adapter: LoraAdapter | None
    model_name: str
    stops: list[str]
    stop_token_ids: frozenset[int]
    max_tokens: int
    streaming: bool
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    sequences: list[Sequence] = field(default_factory=list)
    cancelled: bool = False


@dataclass(eq=False)
class Sequence:
    """One choice of a request while it decodes."""

    request: Request
    index: int
    sampling: RowSampling
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text: str = ""  # decode of token_ids, kept current only when stop strings need it
    cached: int = 0  # cache positions holding this sequence's prompt and fed tokens
    sent_tokens: int = 0  # streamed so far
    sent_text: str = ""

    @property
    def length(self) -> int:
        """Tokens in the KV cache once the last sampled token has been fed."""
        return len(self.request.prompt_ids) + len(self.token_ids)


@dataclass
class EngineStats:
    """Counters since start: how much work ran and how well it batched."""

    requests: int = 0
    decode_steps: int = 0
    generated_tokens: int = 0
    prompt_tokens: int = 0
    prefilled_tokens: int = 0  # prompt tokens actually run (identical prompts run once)
    prefix_hit_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    peak_batch: int = 0  # most sequences decoded in one step


def send(job: Request, item: Any) -> None:
    """Hand `item` (a delta, the result or an error) to the request's event loop."""
    try:
        job.loop.call_soon_threadsafe(job.queue.put_nowait, item)
    except RuntimeError:  # the caller's event loop is gone
        job.cancelled = True
