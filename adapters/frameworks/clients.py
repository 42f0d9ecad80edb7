"""Framework LLM clients pointed at the capture endpoint, one model name per agent.

Each framework keeps its own OpenAI-compatible client, used as it ships; masenvs only sets
its base URL (the rollout's `/r/{rollout_id}/v1`, so every call lands in that rollout's
trace) and its model name (the agent, which the endpoint's policy map routes to an adapter):

    llm = chat_openai(url, "solver")            # langchain_openai.ChatOpenAI (LangGraph)
    client = autogen_client(url, "coder")       # autogen_ext OpenAIChatCompletionClient
    llm = openai_like(url, "planner")           # llama_index OpenAILike

`Clients` hands a program all of its agents' clients for one run and closes them after.
"""

from __future__ import annotations

import contextlib
import functools
import ssl
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

from masenvs.adapters.policy import Sampling, server_root

Framework = Literal["langgraph", "autogen", "llamaindex"]
FRAMEWORKS: tuple[str, ...] = ("langgraph", "autogen", "llamaindex")

# AutoGen needs to be told what an unknown model name can do; the endpoint renders tools
# with the model's chat template, so function calling is on.
AUTOGEN_MODEL_INFO: dict[str, Any] = {
    "vision": False,
    "function_calling": True,
    "json_output": False,
    "family": "unknown",
    "structured_output": False,
    "multiple_system_messages": True,
}


class RunEnded(RuntimeError):
    """A call made by a run after it ended (timed out): refused, never sent."""


class UnknownAgent(KeyError):
    """A client asked for an agent the workflow does not declare."""

    def __str__(self) -> str:
        return str(self.args[0])


@dataclass
class ClientSettings:
    """What every framework client sends: sampling settings, API key and HTTP timeout."""

    sampling: Sampling = field(default_factory=Sampling)
    agents: dict[str, Sampling] = field(default_factory=dict)  # per-agent, over `sampling`
    api_key: str = "masenvs"
    timeout: float = 600.0
    context_window: int = 8192  # what LlamaIndex is told (it budgets its memory with it)

    def sampling_of(self, agent: str) -> Sampling:
        return self.agents.get(agent, self.sampling)


def rollout_url(server_url: str, rollout_id: str) -> str:
    """The OpenAI base URL whose calls the endpoint records under `rollout_id`; the server
    is given by its root (`http://host:port`) or its base URL (`http://host:port/v1`)."""
    if not rollout_id or "/" in rollout_id:
        raise ValueError(f"rollout id {rollout_id!r} must be a non-empty string without '/'")
    return f"{server_root(server_url)}/r/{rollout_id}/v1"


async def check_server(server_url: str, api_key: str = "masenvs") -> str:
    """The server's root, once it answers on a rollout URL as a masenvs endpoint does; one
    sentence naming the cause and the fix otherwise. Takes the root or the `/v1` URL."""
    root = server_root(server_url)
    try:
        async with httpx.AsyncClient(timeout=10.0) as http:
            response = await http.get(
                f"{root}/r/check/v1/models", headers={"Authorization": f"Bearer {api_key}"}
            )
    except httpx.HTTPError as exc:
        raise ConnectionError(
            f"cannot reach the masenvs server at {root} ({type(exc).__name__}: {exc}); start "
            "it (`masenvs serve`) or fix the URL"
        ) from exc
    if response.status_code == 401:
        raise PermissionError(
            f"the server at {root} refused the API key; pass the key it was started with "
            "($MASENVS_API_KEY or --api-key-file, ClientSettings(api_key=...))"
        )
    if response.status_code != 200:
        raise ValueError(
            f"{root} answered {response.status_code} on a rollout URL (/r/<id>/v1/models): "
            "workflow runs need a masenvs endpoint (`masenvs serve`, or the trainer's own) "
            "to record their calls; check the URL"
        )
    return root


@functools.cache
def _ssl_context() -> ssl.SSLContext:
    # httpx's default trust (certifi), built once: loading it costs ~50 ms per client.
    import certifi

    return ssl.create_default_context(cafile=certifi.where())


def _extra_body(sampling: Sampling) -> dict[str, Any]:
    extra: dict[str, Any] = {"top_k": sampling.top_k} if sampling.top_k else {}
    if sampling.repetition_penalty != 1.0:
        extra["repetition_penalty"] = sampling.repetition_penalty
    return extra


def chat_openai(
    base_url: str,
    agent: str,
    settings: ClientSettings | None = None,
    *,
    http_client: httpx.Client | None = None,
    http_async_client: httpx.AsyncClient | None = None,
    **kwargs: Any,
) -> Any:
    """A `langchain_openai.ChatOpenAI` (what LangGraph nodes call) named `agent`."""
    from langchain_openai import ChatOpenAI

    s = settings or ClientSettings()
    sampling = s.sampling_of(agent)
    options: dict[str, Any] = dict(
        model=agent,
        base_url=base_url,
        api_key=s.api_key,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        max_tokens=sampling.max_tokens,
        seed=sampling.seed,
        timeout=s.timeout,
        max_retries=0,  # a failed call is the episode's failure, not something to hide
        use_responses_api=False,  # the endpoint speaks chat completions
        http_client=http_client,
        http_async_client=http_async_client,
    )
    if _extra_body(sampling):
        options["extra_body"] = _extra_body(sampling)
    options.update(kwargs)
    return ChatOpenAI(**options)


def autogen_client(
    base_url: str,
    agent: str,
    settings: ClientSettings | None = None,
    *,
    http_client: httpx.AsyncClient | None = None,
    **kwargs: Any,
) -> Any:
    """An AutoGen `OpenAIChatCompletionClient` named `agent` (with `model_info` set)."""
    from autogen_ext.models.openai import OpenAIChatCompletionClient

    s = settings or ClientSettings()
    sampling = s.sampling_of(agent)
    options: dict[str, Any] = dict(
        model=agent,
        base_url=base_url,
        api_key=s.api_key,
        model_info=dict(AUTOGEN_MODEL_INFO),
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        max_tokens=sampling.max_tokens,
        timeout=s.timeout,
        max_retries=0,
    )
    if sampling.seed is not None:
        options["seed"] = sampling.seed
    if _extra_body(sampling):
        options["extra_body"] = _extra_body(sampling)
    if http_client is not None:
        options["http_client"] = http_client  # passed on to openai.AsyncOpenAI
    options.update(kwargs)
    return OpenAIChatCompletionClient(**options)


def openai_like(
    base_url: str,
    agent: str,
    settings: ClientSettings | None = None,
    *,
    http_client: httpx.Client | None = None,
    async_http_client: httpx.AsyncClient | None = None,
    **kwargs: Any,
) -> Any:
    """A LlamaIndex `OpenAILike` chat model named `agent`, with function calling on."""
    from llama_index.llms.openai_like import OpenAILike

    s = settings or ClientSettings()
    sampling = s.sampling_of(agent)
    additional: dict[str, Any] = {"top_p": sampling.top_p}
    if sampling.seed is not None:
        additional["seed"] = sampling.seed
    if _extra_body(sampling):
        additional["extra_body"] = _extra_body(sampling)
    options: dict[str, Any] = dict(
        model=agent,
        api_base=base_url,
        api_key=s.api_key,
        is_chat_model=True,
        is_function_calling_model=True,
        context_window=s.context_window,
        temperature=sampling.temperature,
        max_tokens=sampling.max_tokens,
        timeout=s.timeout,
        max_retries=0,
        additional_kwargs=additional,
        http_client=http_client,
        async_http_client=async_http_client,
    )
    options.update(kwargs)
    return OpenAILike(**options)


class Clients(Mapping[str, Any]):
    """`clients["solver"]`: the framework's client for agent `solver`, built on first use.

    All clients of one run share one HTTP connection pool, closed by `aclose()`. With
    `agents` given, any other name is an error (a typo would silently train nothing).
    """

    def __init__(
        self,
        framework: Framework,
        base_url: str,
        agents: Iterable[str] | None = None,
        settings: ClientSettings | None = None,
    ) -> None:
        if framework not in FRAMEWORKS:
            raise ValueError(f"unknown framework {framework!r}; use one of {', '.join(FRAMEWORKS)}")
        self.framework = framework
        self.base_url = base_url
        self.agents = list(agents) if agents is not None else None
        self.settings = settings or ClientSettings()
        self._built: dict[str, Any] = {}
        self._extra: list[Any] = []
        self._revoked: str | None = None
        timeout = httpx.Timeout(self.settings.timeout, connect=10.0)
        # Our own pools: frameworks that make their own cache one per base URL, which would
        # leak one pool per rollout.
        self._http = httpx.AsyncClient(
            timeout=timeout, verify=_ssl_context(), event_hooks={"request": [self._arefuse]}
        )
        self._http_sync: httpx.Client | None = None
        self._sync_timeout = timeout

    def __getitem__(self, agent: str) -> Any:
        if agent not in self._built:
            self._check(agent)
            self._built[agent] = self._make(agent)
        return self._built[agent]

    def __iter__(self) -> Iterator[str]:
        return iter(self.agents if self.agents is not None else list(self._built))

    def __len__(self) -> int:
        return len(self.agents) if self.agents is not None else len(self._built)

    def __contains__(self, agent: object) -> bool:
        return agent in (self.agents if self.agents is not None else self._built)

    def client(self, agent: str, **kwargs: Any) -> Any:
        """A new client for `agent` with framework-specific options (e.g. `max_tokens=64`)."""
        self._check(agent)
        made = self._make(agent, **kwargs)
        self._extra.append(made)
        return made

    def _make(self, agent: str, **kwargs: Any) -> Any:
        if self.framework == "langgraph":
            made = chat_openai(
                self.base_url,
                agent,
                self.settings,
                http_client=self._sync_client(),
                http_async_client=self._http,
                **kwargs,
            )
        elif self.framework == "autogen":
            made = autogen_client(
                self.base_url, agent, self.settings, http_client=self._http, **kwargs
            )
        else:
            made = openai_like(
                self.base_url,
                agent,
                self.settings,
                http_client=self._sync_client(),
                async_http_client=self._http,
                **kwargs,
            )
        return made

    def _check(self, agent: str) -> None:
        # "critic@verdict": the agent is the part before '@' (the step names the decision).
        if self.agents is not None and agent.partition("@")[0] not in self.agents:
            raise UnknownAgent(
                f"agent {agent!r} is not one of this workflow's agents "
                f"({', '.join(self.agents)}); add it to `agents` in the workflow config, or "
                "set unknown_agents (base or map)"
            )

    def _sync_client(self) -> httpx.Client:
        # Sync framework calls (a plain `def` LangGraph node) need a sync pool of their own.
        if self._http_sync is None:
            self._http_sync = httpx.Client(
                timeout=self._sync_timeout,
                verify=_ssl_context(),
                event_hooks={"request": [self._refuse]},
            )
        return self._http_sync

    def revoke(self, reason: str) -> None:
        """Refuse every later request of these clients (a run past its deadline); safe to
        call from any thread."""
        self._revoked = reason

    def _refuse(self, request: httpx.Request) -> None:
        if self._revoked is not None:
            raise RunEnded(f"call to {request.url.path} refused: {self._revoked}")

    async def _arefuse(self, request: httpx.Request) -> None:
        self._refuse(request)

    async def aclose(self) -> None:
        """Close every client built here and the shared connection pools."""
        for made in [*self._built.values(), *self._extra]:
            close = getattr(made, "close", None)
            if self.framework == "autogen" and close is not None:
                with contextlib.suppress(Exception):  # already closed by the user's program
                    await close()
        await self._http.aclose()
        if self._http_sync is not None:
            self._http_sync.close()
