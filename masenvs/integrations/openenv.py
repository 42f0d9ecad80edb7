"""Any masenvs env as an OpenEnv environment server (`masenvs openenv-serve ENV`, in
openenv_serve.py).

openenv-core's own server (`HTTPEnvServer`) speaks the protocol: the official client
(`GenericEnvClient(base_url=...)`) opens a WebSocket session at `/ws` and sends `reset`, `step`
and `state`. Each session is one `TextEpisode` of its own: an action is `{"message": text}`, the
text of the role whose turn it is; an observation carries that role's next prompt, the reward
of the action (the env's own, with its process / agent / team parts) and `done`.
`state()` is `TextEpisode.public_state()`: counts and flags, never task data or hidden tests.

Around it, the masenvs listener rules (masenvs/listeners.py): loopback by default, a key
beyond it (`Authorization: Bearer KEY`, or the URL's password, which is what the official
client sends for `http://user:KEY@host:port`), request bodies and WebSocket messages bounded
in bytes and in what they parse into, sessions capped and closed after an idle timeout.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import hmac
import json
import os
from dataclasses import dataclass
from typing import Any

from openenv.core.env_server import Environment, create_fastapi_app
from openenv.core.env_server.types import (
    Action,
    ConcurrencyConfig,
    EnvironmentMetadata,
    Observation,
    State,
)
from pydantic import Field
from starlette.websockets import WebSocketDisconnect

from masenvs.env import MAX_TEXT
from masenvs.integrations.episode import EpisodeOver, Player, StepResult, TextEpisode, Turn
from masenvs.listeners import head_timeout_protocol, key_matches
from masenvs.request_bodies import BodyError, JsonLimits, check_json_size

MAX_MESSAGE_BYTES = 1 << 20  # one request or WebSocket message: a MiB of action text and framing


# --- the protocol's types ------------------------------------------------------------------------


class MasenvsAction(Action):
    """The move of the role whose turn it is: any text (what the env cannot parse is an
    invalid move with the env's penalty)."""

    message: str = Field(max_length=MAX_TEXT, description="The acting role's answer.")


class MasenvsObservation(Observation):
    """What the policy sees next; `reward` and `done` are the env's own."""

    role: str | None = Field(None, description="Whose turn it is now; None once the episode ends.")
    prompt: str = Field("", description="That role's observation as one text (the env's own).")
    messages: list[dict[str, str]] = Field(
        default_factory=list, description="The same observation as chat messages."
    )
    reward_parts: dict[str, float] = Field(
        default_factory=dict, description="The reward by level: process, agent, team."
    )
    success: bool = Field(False, description="Whether the task is solved.")
    played: list[tuple[str, str]] = Field(
        default_factory=list,
        description="(role, action) of every move the step made: the policy's, then the fixed "
        "player's for the other roles.",
    )


class MasenvsState(State):
    """`TextEpisode.public_state()`: counts and flags, nothing a policy could cheat with."""

    env: str = ""
    round: int = 0
    acting: str | None = None
    done: bool = True
    success: bool = False
    returns: dict[str, float] = Field(default_factory=dict)


class SessionError(ValueError):
    """A reset the session refuses (a bad seed or option); the message says which."""


@dataclass
class Served:
    """What every session of a server plays: the env, its options, the trained role."""

    env: str
    options: dict[str, Any]
    role: str | None = None
    others: Player | None = None

    def episode(self) -> TextEpisode:
        return TextEpisode(self.env, self.options, role=self.role, others=self.others)


class MasenvsEnvironment(Environment[MasenvsAction, MasenvsObservation, MasenvsState]):
    """One OpenEnv session: a `TextEpisode`, built on the first reset (so `/schema` and the
    stateless HTTP routes cost nothing)."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, served: Served) -> None:
        super().__init__()
        self.served = served
        self.episode: TextEpisode | None = None

    def reset(
        self,
        seed: int | None = None,
        episode_id: str | None = None,
        **unknown: Any,
    ) -> MasenvsObservation:
        # No `task`: a task sent by a client (a huge grid, a puzzle to solve) would cost the
        # server what no seed does. Seeds name the env's own tasks.
        if unknown:
            raise SessionError(
                f"unknown reset option(s) {', '.join(map(repr, sorted(unknown)))}: reset takes "
                "seed and episode_id"
            )
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise SessionError(f"seed must be a non-negative integer, got {seed!r}")
        if episode_id is not None and (not isinstance(episode_id, str) or len(episode_id) > 255):
            raise SessionError("episode_id must be a string of at most 255 characters")
        if self.episode is None:
            self.episode = self.served.episode()
        with self._stop_on_failure():
            turn = self.episode.reset(seed=seed)
        if episode_id:
            self.episode.id = episode_id
        return _observation(turn)

    def step(
        self, action: MasenvsAction, timeout_s: float | None = None, **kwargs: Any
    ) -> MasenvsObservation:
        if self.episode is None:
            raise EpisodeOver(f"{self.served.env}: no episode yet; call reset() first")
        with self._stop_on_failure():
            result = self.episode.step(action.message)
        return _observation(result.next, result)

    @contextlib.contextmanager
    def _stop_on_failure(self) -> Any:
        """A failure mid-step (the others' URL down) leaves the env at another role's turn:
        end the episode there, so no later action is played as that role's."""
        assert self.episode is not None
        try:
            yield
        except EpisodeOver:
            raise
        except Exception as exc:
            self.episode.done = True
            raise RuntimeError(
                f"{self.served.env}: the episode stopped ({type(exc).__name__}: {exc}); "
                "call reset() to start another"
            ) from exc

    @property
    def state(self) -> MasenvsState:
        if self.episode is None:
            return MasenvsState(env=self.served.env)
        return MasenvsState(**self.episode.public_state())

    def get_metadata(self) -> EnvironmentMetadata:
        role = f"role {self.served.role!r}" if self.served.role else "every role in turn"
        return EnvironmentMetadata(
            name=f"masenvs/{self.served.env}",
            description=f"masenvs env {self.served.env!r} as a text game; the policy plays {role}.",
        )

    def close(self) -> None:
        self.episode = None


def _observation(turn: Turn | None, result: StepResult | None = None) -> MasenvsObservation:
    return MasenvsObservation(
        role=turn.role if turn else None,
        prompt=turn.text if turn else "",
        messages=turn.messages if turn else [],
        reward=result.reward if result else None,
        done=result.done if result else False,
        reward_parts=result.reward_parts if result else {},
        success=result.success if result else False,
        played=result.played if result else [],
    )


# --- the server ----------------------------------------------------------------------------------


def create_server(
    env: str,
    options: dict[str, Any] | None = None,
    *,
    role: str | None = None,
    others: Player | str | None = None,
    api_key: str | None = None,
    max_sessions: int = 256,
    idle_timeout: float = 600.0,
    max_message_bytes: int = MAX_MESSAGE_BYTES,
) -> Guard:
    """The ASGI app serving `env` to OpenEnv clients; `others` plays the roles other than
    `role` (a Player, or the URL of an OpenAI-compatible server). A bad env, option or role
    fails here, in one line (KeyError or ValueError)."""
    from masenvs.integrations.episode import openai_player

    if isinstance(others, str):
        others = openai_player(others, api_key=os.environ.get("OPENAI_API_KEY"))
    served = Served(env, dict(options or {}), role, others)
    served.episode()  # fails now, not in every session, on a bad env, option or role
    app = create_fastapi_app(
        functools.partial(MasenvsEnvironment, served),
        MasenvsAction,
        MasenvsObservation,
        concurrency_config=ConcurrencyConfig(
            max_concurrent_envs=max_sessions, session_timeout=idle_timeout
        ),
    )
    # MCP routes serve tools this env does not have, and HTTP /mcp opens sessions no
    # connection holds: only the WebSocket session protocol stays.
    app.router.routes = [r for r in app.router.routes if getattr(r, "path", "") != "/mcp"]
    app.add_exception_handler(EpisodeOver, _episode_over)
    app.add_exception_handler(SessionError, _bad_request)
    limits = JsonLimits(max_bytes=max_message_bytes)  # 10k objects and arrays, 100k values
    return Guard(app, api_key, limits, idle_timeout, max_sessions)


async def _episode_over(request: Any, exc: Exception) -> Any:
    from fastapi.responses import JSONResponse

    detail = (
        f"{exc}. OpenEnv's HTTP /reset and /step are stateless (a fresh env per request): "
        "play episodes over the WebSocket session at /ws, e.g. with GenericEnvClient"
    )
    return JSONResponse({"detail": detail}, status_code=409)


async def _bad_request(request: Any, exc: Exception) -> Any:
    from fastapi.responses import JSONResponse

    return JSONResponse({"detail": str(exc)}, status_code=400)


class Guard:
    """ASGI wrapper: the key, bounded bodies and messages, idle WebSocket sessions closed."""

    def __init__(
        self,
        app: Any,
        api_key: str | None,
        limits: JsonLimits,
        idle_timeout: float,
        max_sessions: int,
    ) -> None:
        self.app, self.api_key, self.limits = app, api_key, limits
        self.idle_timeout, self.max_sessions = idle_timeout, max_sessions

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            return await self.app(scope, receive, send)
        if self.api_key and not authorized(scope, self.api_key):
            if scope["type"] == "websocket":
                await receive()  # websocket.connect; a close now refuses the handshake (403)
                return await send({"type": "websocket.close", "code": 1008})
            return await _respond(
                send,
                401,
                "this server needs its API key: send "
                "'Authorization: Bearer KEY' or connect to http://user:KEY@host",
            )
        if scope["type"] == "http":
            return await self._http(scope, receive, send)
        # openenv-core closes the socket of a client that already left: not an error.
        with contextlib.suppress(WebSocketDisconnect):
            await self.app(scope, self._messages(receive, send), send)

    async def _http(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """Read the whole body, refusing it once it is over the limit, then replay it."""
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length", b"0").strip()
        if declared.isdigit() and int(declared) > self.limits.max_bytes:
            return await _respond(
                send, 413, f"request too large: at most {self.limits.max_bytes} bytes"
            )
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.limits.max_bytes:
                return await _respond(
                    send, 413, f"request too large: at most {self.limits.max_bytes} bytes"
                )
        if body:
            try:
                check_json_size(body, self.limits)
            except BodyError as exc:
                return await _respond(send, exc.status, str(exc))
        sent = False

        async def replay() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _messages(self, receive: Any, send: Any) -> Any:
        """The session's `receive`: a message over the limits gets an error reply and is
        dropped (the session goes on); a session silent for `idle_timeout` is disconnected."""

        async def guarded() -> dict[str, Any]:
            while True:
                try:
                    message = await asyncio.wait_for(receive(), self.idle_timeout)
                except TimeoutError:
                    return {"type": "websocket.disconnect", "code": 1001}
                if message["type"] != "websocket.receive":
                    return message
                raw = message.get("text")
                data = raw.encode() if raw is not None else message.get("bytes") or b""
                try:
                    check_json_size(data, self.limits)
                except BodyError as exc:
                    error = {"message": str(exc), "code": "VALIDATION_ERROR"}
                    await send(
                        {
                            "type": "websocket.send",
                            "text": json.dumps({"type": "error", "data": error}),
                        }
                    )
                    continue
                return message

        return guarded


def authorized(scope: dict[str, Any], api_key: str) -> bool:
    """`Authorization: Bearer KEY`, or Basic auth whose password is the key (what a client
    sends for a URL `http://user:KEY@host`, the official OpenEnv client included)."""
    header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
    if key_matches(header, api_key):
        return True
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "basic":
        return False
    try:
        password = base64.b64decode(value.strip(), validate=True).decode().partition(":")[2]
    except (ValueError, UnicodeDecodeError):
        return False
    return hmac.compare_digest(password.encode(), api_key.encode())


async def _respond(send: Any, status: int, detail: str) -> None:
    body = json.dumps({"detail": detail}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def uvicorn_config(app: Guard, log_level: str = "warning") -> Any:
    """uvicorn settings that keep the server's memory bounded: a message over the limit gets
    an error reply, a frame 64 KiB past it closes the connection (1009) unbuffered; at most
    twice as many connections as sessions; a connection that sends no request is closed."""
    import uvicorn

    return uvicorn.Config(
        app,
        log_level=log_level,
        ws_max_size=app.limits.max_bytes + (64 << 10),
        limit_concurrency=2 * app.max_sessions + 16,
        http=head_timeout_protocol(),  # a connection that sends no request is closed
    )
