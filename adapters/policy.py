"""`ChatPolicy`: env observations in, endpoint calls out, one model name per agent."""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx

from masenvs.sampling_args import SamplingArgs

if TYPE_CHECKING:  # openai takes ~1 s to import: loaded on first use (fast --help)
    from openai import AsyncOpenAI

_ROLLOUT_PATH = re.compile(r"/r/[^/]+/v1$")


def server_root(url: str) -> str:
    """The root of a masenvs server from its root or its OpenAI base URL (`.../v1`, what
    `masenvs serve` prints); a rollout's own URL (`.../r/<id>/v1`) is refused."""
    root = url.strip().rstrip("/")
    if not root.startswith(("http://", "https://")):
        raise ValueError(f"server URL {url!r} must start with http:// or https://")
    if _ROLLOUT_PATH.search(root):
        raise ValueError(
            f"{url!r} is one rollout's URL; give the server's root (http://host:port) or its "
            "/v1 URL, and masenvs makes a rollout URL for every run"
        )
    return root.removesuffix("/v1")


@dataclass(frozen=True)
class Sampling(SamplingArgs):
    """Sampling settings sent with every call: `SamplingArgs` (the endpoint's `top_k` and
    `repetition_penalty` are vLLM's extra fields) and a seed."""

    seed: int | None = None


@dataclass
class Reply:
    """One sampled answer of an agent, with the ids the endpoint recorded."""

    text: str
    completion_tokens: int
    finish_reason: str
    call_id: str | None = None
    token_ids: list[int] = field(default_factory=list)
    prompt_token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    sampling: SamplingArgs | None = None  # what the request asked for


class ChatPolicy:
    """Asks the endpoint for each agent's action; the request's `model` is the agent's name.

    Every rollout gets its own base URL (`/r/{rollout_id}/v1`) so the endpoint attributes
    each call to its rollout, exactly as it does for framework agents. `base_url` is the
    server's OpenAI base URL (`http://host:port/v1`) or its root. `agent_sampling` gives
    some agents their own settings; the others use `sampling`.
    """

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str = "masenvs",
        sampling: Sampling | None = None,
        agent_sampling: dict[str, Sampling] | None = None,
        models: dict[str, str] | None = None,
        max_concurrency: int = 64,
        timeout: float = 600.0,
    ) -> None:
        self.root_url = server_root(base_url)
        self.base_url = f"{self.root_url}/v1"
        self.api_key = api_key
        self.sampling = sampling or Sampling()
        self.agent_sampling = agent_sampling or {}  # per-agent settings over `sampling`
        self.models = models or {}
        self.timeout = timeout  # seconds one call may take
        self._http = httpx.AsyncClient(
            timeout=timeout, limits=httpx.Limits(max_connections=max_concurrency)
        )
        self._limit = asyncio.Semaphore(max_concurrency)

    def client(self, rollout_id: str) -> AsyncOpenAI:
        """An `openai` client whose calls land in `rollout_id`'s trace."""
        from openai import AsyncOpenAI

        return AsyncOpenAI(
            base_url=f"{self.root_url}/r/{rollout_id}/v1",
            api_key=self.api_key,
            http_client=self._http,
            max_retries=0,
        )

    async def act(
        self,
        rollout_id: str,
        agent: str,
        messages: list[dict[str, Any]],
        n: int = 1,
        sampling: Sampling | None = None,
        seed: int | None = None,
    ) -> list[Reply]:
        """`n` answers of `agent` to `messages` (one request; the backend shares the prefill).
        `seed`, where given, replaces the sampling settings' seed for this call."""
        s = sampling or self.agent_sampling.get(agent, self.sampling)
        extra: dict[str, Any] = {"return_token_ids": True}
        if s.top_k:
            extra["top_k"] = s.top_k
        if s.repetition_penalty != 1.0:
            extra["repetition_penalty"] = s.repetition_penalty
        from openai import APITimeoutError

        async with self._limit:
            try:
                response = await self.client(rollout_id).chat.completions.create(
                    model=self.models.get(agent, agent),
                    messages=messages,
                    n=n,
                    temperature=s.temperature,
                    top_p=s.top_p,
                    max_tokens=s.max_tokens,
                    seed=s.seed if seed is None else seed,
                    logprobs=True,
                    extra_body=extra,
                )
            except APITimeoutError as exc:
                raise TimeoutError(
                    f"{agent!r}'s call ({n} answer(s) of up to {s.max_tokens} tokens) took over "
                    f"{self.timeout:g} s; in `masenvs train` raise backend.request_timeout "
                    "(--set backend.request_timeout=SECONDS), or lower rollout.max_tokens"
                ) from exc
        prompt_ids = list(getattr(response, "prompt_token_ids", None) or [])
        replies = []
        for choice in sorted(response.choices, key=lambda c: c.index):
            logprobs = (
                [t.logprob for t in (choice.logprobs.content or [])] if choice.logprobs else []
            )
            replies.append(
                Reply(
                    text=choice.message.content or "",
                    completion_tokens=len(getattr(choice, "token_ids", None) or logprobs),
                    finish_reason=choice.finish_reason or "stop",
                    call_id=response.id,
                    token_ids=list(getattr(choice, "token_ids", None) or []),
                    prompt_token_ids=prompt_ids,
                    logprobs=logprobs,
                    sampling=SamplingArgs.of(s),
                )
            )
        return replies

    async def act_all(
        self, rollout_id: str, infos: dict[str, dict[str, Any]], n: int = 1
    ) -> dict[str, list[Reply]]:
        """Every live agent's answers to its current prompt, requested concurrently."""
        agents = list(infos)
        results = await asyncio.gather(
            *(self.act(rollout_id, a, infos[a]["messages"], n=n) for a in agents)
        )
        return dict(zip(agents, results))

    async def aclose(self) -> None:
        await self._http.aclose()
