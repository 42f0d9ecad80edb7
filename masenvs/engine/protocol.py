"""What every backend (embedded engine, vLLM) offers the endpoint.

A backend owns the tokenizer and the chat template, so token ids always come from the
backend that generated them and are never re-tokenized.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from masenvs.sampling_args import DEFAULT as SAMPLING


class BackendError(Exception):
    """A request the backend cannot serve; `status` is the HTTP code the endpoint returns."""

    def __init__(self, message: str, status: int = 400, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.status = status
        self.code = code


@dataclass
class SamplingParams:
    """How to sample: `SamplingArgs`' knobs (their defaults and bounds are declared there;
    the backend checks them) and the request's own. Log-probabilities are always of the raw
    model distribution (T=1)."""

    max_tokens: int = SAMPLING.max_tokens
    temperature: float = SAMPLING.temperature
    top_p: float = SAMPLING.top_p
    top_k: int = SAMPLING.top_k  # 0 (or -1) turns top-k off
    # >1 makes tokens already in the prompt or the answer less likely (vLLM's and
    # transformers' rule); 1.0 is off. Sampling only: log-probs stay the raw model's.
    repetition_penalty: float = SAMPLING.repetition_penalty
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    n: int = 1
    top_logprobs: int = 0  # also return this many most likely tokens at each position
    ignore_eos: bool = False  # keep sampling past EOS (benchmarks; vLLM has the same flag)


@dataclass
class GenerateRequest:
    """One call: chat `messages` (rendered by the backend's chat template) or a raw `prompt`."""

    model: str  # adapter or model name the policy map resolved; "" or "base" = base model
    params: SamplingParams
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    prompt: str | list[int] | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # Calls with the same affinity (the endpoint puts the rollout id here) may be kept on
    # one engine by a pool of engines, so a rollout's prefix stays cached there.
    affinity: str | None = None


@dataclass
class Completion:
    """One sampled continuation; `text` is `tokenizer.decode(token_ids)` minus a final stop token."""

    token_ids: list[int]
    text: str
    logprobs: list[float]  # log-probability of each sampled token under the raw model
    finish_reason: str  # "stop" or "length"
    top_logprobs: list[dict[int, float]] | None = None  # per position: token id -> logprob
    # What ended a "stop" choice: a stop token id (kept as the last of `token_ids`, with its
    # logprob, so a trainer learns to stop, but not in `text`) or a stop string (in neither).
    stop_reason: int | str | None = None


@dataclass
class Generation:
    prompt_token_ids: list[int]
    completions: list[Completion]
    model: str
    # The weights' version that sampled it, when the backend knows (a pool of engines does);
    # None: the endpoint records its own `policy_version`.
    policy_version: int | None = None


@dataclass
class StreamDelta:
    """A piece of one choice during streaming; the final event of a choice has finish_reason."""

    index: int
    token_ids: list[int]
    text: str
    logprobs: list[float]
    finish_reason: str | None = None
    top_logprobs: list[dict[int, float]] | None = None


@runtime_checkable
class Backend(Protocol):
    """The interface the endpoint calls; implementations must be safe to call concurrently."""

    async def generate(self, request: GenerateRequest) -> Generation: ...

    def stream(self, request: GenerateRequest) -> AsyncIterator[StreamDelta | Generation]:
        """Yield deltas as tokens are produced, then the full `Generation` last."""
        ...

    def model_names(self) -> list[str]:
        """Names a request's `model` may resolve to: the base model and each adapter."""
        ...

    def decode(self, token_ids: list[int]) -> str: ...

    def tokenizer_id(self) -> str:
        """Identifies the tokenizer (checked by the trainer to reuse token ids safely)."""
        ...

    async def load_adapter(self, name: str, path: str) -> None:
        """Load or replace a LoRA adapter from a peft directory."""
        ...

    async def close(self) -> None: ...


def honours_seed(backend: Any) -> bool:
    """Whether `backend` samples a request's `seed` as asked; a backend that does not (vLLM's
    CPU build, see docs/vllm.md) says so with `honours_seed = False` and drops the seed."""
    return bool(getattr(backend, "honours_seed", True))
