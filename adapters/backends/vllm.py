"""The vLLM backend: a `vllm serve` OpenAI server, spoken to over HTTP.

vLLM pins its own torch and transformers, so it lives in its own environment and masenvs
never imports it. Every request asks for `return_token_ids` (vLLM >= 0.10.2) and
`logprobs` with `return_tokens_as_token_ids`, so prompt ids, completion ids, per-token
logprobs and the ids of the top alternatives all come from vLLM itself. LoRA adapters are
chosen per request by `model` and loaded or replaced at run time with
`/v1/load_lora_adapter` (the server needs `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`, which
`launch_vllm` sets).

The trace fields match the embedded backend's: `text` is the local tokenizer's decoding of
the ids minus a final stop token; an EOS ends a choice with `stop_reason=<its id>`; at a
stop string the ids are cut to whole tokens before it (vLLM keeps the tokens that spelled
it), so ids and text never disagree.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import weakref
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from masenvs.adapters.backends.base import (
    BackendError,
    Completion,
    GenerateRequest,
    Generation,
    SamplingParams,
    StreamDelta,
)

BASE_NAMES = ("", "base")
VLLM_BIN_ENV = "MASENVS_VLLM_BIN"


class VLLMBackend:
    """The `Backend` protocol over a running vLLM OpenAI server.

    `tokenizer` (a transformers tokenizer, a model directory, or "tiny"/"smollm2-135m")
    decodes ids locally; by default it is loaded from the directory vLLM serves, which
    must then exist on this machine too.
    """

    name = "vllm"

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        served_model: str | None = None,
        *,
        tokenizer: Any = None,
        timeout: float = 600.0,
    ) -> None:
        self.url = base_url.rstrip("/").removesuffix("/v1")
        self.api_key = api_key
        self.timeout = timeout
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, httpx.AsyncClient] = (
            weakref.WeakKeyDictionary()
        )
        cards = self._list_models()
        bases = [c for c in cards if not c.get("parent")]
        if served_model is None:
            if not bases:
                raise BackendError(f"vLLM at {self.url} lists no base model.", 502, "vllm_error")
            served_model = bases[0]["id"]
        elif served_model not in {c["id"] for c in cards}:
            raise BackendError(
                f"vLLM at {self.url} does not serve {served_model!r}; it serves "
                f"{', '.join(c['id'] for c in cards)}.",
                404,
                "model_not_found",
            )
        self.served_model = served_model
        self._names = [c["id"] for c in cards]
        root = next((c.get("root") for c in cards if c["id"] == served_model), None)
        self.tokenizer = _load_tokenizer(tokenizer, root or served_model, self.url)
        self.chat_template = getattr(self.tokenizer, "chat_template", None)
        self._tokenizer_id = tokenizer_fingerprint(self.tokenizer)
        self._eos_ids = _eos_ids(self.tokenizer)

    # -- Backend protocol ------------------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> Generation:
        route, body = self._request_body(request, stream=False)
        data = await self._post_json(route, body)
        choices = sorted(data.get("choices") or [], key=lambda c: c["index"])
        if not choices:
            raise BackendError(f"vLLM returned no choices: {data}", 502, "vllm_error")
        prompt_ids = data.get("prompt_token_ids") or choices[0].get("prompt_token_ids")
        if prompt_ids is None:
            raise BackendError(
                "vLLM returned no prompt_token_ids; it must be version 0.10.2 or newer "
                "(for `return_token_ids`).",
                502,
                "vllm_too_old",
            )
        completions = []
        for choice in choices:
            ids = choice.get("token_ids")
            if ids is None:
                raise BackendError("vLLM returned no token_ids for a choice.", 502, "vllm_error")
            logprobs, top = _choice_logprobs(choice, route, request.params.top_logprobs)
            completions.append(
                self._completion(
                    _Choice(list(ids), logprobs, top),
                    choice.get("finish_reason") or "length",
                    choice.get("stop_reason"),
                    request.params,
                )
            )
        return Generation(list(prompt_ids), completions, request.model or self.served_model)

    def stream(self, request: GenerateRequest) -> AsyncIterator[StreamDelta | Generation]:
        """Deltas as vLLM streams tokens; tokens that a stop string may still cut are held."""
        return self._stream(request)

    def model_names(self) -> list[str]:
        return list(self._names)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)

    def tokenizer_id(self) -> str:
        return self._tokenizer_id

    async def load_adapter(self, name: str, path: str) -> None:
        """Load LoRA adapter `name` from a peft directory, or replace its weights in place."""
        if name in BASE_NAMES or name == self.served_model:
            raise BackendError(f"{name!r} names the base model; pick another adapter name.")
        body = {"lora_name": name, "lora_path": str(path), "load_inplace": name in self._names}
        try:
            await self._post_text("/v1/load_lora_adapter", body)
        except BackendError as exc:
            if "already been loaded" not in str(exc):
                raise
            # vLLM before `load_inplace`: replace by unloading and loading again.
            await self._post_text("/v1/unload_lora_adapter", {"lora_name": name})
            await self._post_text(
                "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)}
            )
        await self.refresh()

    async def unload_adapter(self, name: str) -> None:
        await self._post_text("/v1/unload_lora_adapter", {"lora_name": name})
        await self.refresh()

    async def refresh(self) -> None:
        """Re-read the model list (after adapters changed on the server)."""
        data = await self._get_json("/v1/models")
        self._names = [card["id"] for card in data.get("data", [])]

    async def close(self) -> None:
        clients = list(self._clients.items())
        self._clients.clear()
        loop = asyncio.get_running_loop()
        for client_loop, client in clients:
            if client_loop is loop:
                await client.aclose()

    # -- requests --------------------------------------------------------------------------

    def _request_body(self, request: GenerateRequest, stream: bool) -> tuple[str, dict[str, Any]]:
        params = request.params
        model = self.served_model if request.model in BASE_NAMES else request.model
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
        if params.seed is not None:
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

    async def _stream(self, request: GenerateRequest) -> AsyncIterator[StreamDelta | Generation]:
        route, body = self._request_body(request, stream=True)
        params = request.params
        choices: dict[int, _Choice] = {}
        finished: dict[int, tuple[str, Any]] = {}
        prompt_ids: list[int] | None = None
        client = self._client()
        try:
            async with client.stream(
                "POST", self.url + route, json=body, headers=self._headers
            ) as response:
                if response.status_code != 200:
                    raise _error(
                        response.status_code, (await response.aread()).decode(errors="replace")
                    )
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        break
                    chunk = json.loads(payload)
                    if "error" in chunk or chunk.get("object") == "error":
                        raise _error(_status_of(chunk), payload)
                    if chunk.get("prompt_token_ids") is not None:
                        prompt_ids = list(chunk["prompt_token_ids"])
                    for choice in chunk.get("choices") or []:
                        index = choice["index"]
                        state = choices.setdefault(index, _Choice([], [], []))
                        if choice.get("prompt_token_ids") is not None:
                            prompt_ids = list(choice["prompt_token_ids"])
                        ids = choice.get("token_ids") or []
                        logprobs, top = _choice_logprobs(choice, route, params.top_logprobs)
                        state.token_ids += ids
                        state.logprobs += logprobs[: len(ids)]
                        state.top += top[: len(ids)]
                        if choice.get("finish_reason"):
                            finished[index] = (choice["finish_reason"], choice.get("stop_reason"))
                        else:
                            delta = self._held_delta(index, state, params)
                            if delta is not None:
                                yield delta
        except httpx.HTTPError as exc:
            raise _unreachable(self.url, exc) from exc
        if prompt_ids is None:
            raise BackendError(
                "vLLM streamed no prompt_token_ids; it must be version 0.10.2 or newer.",
                502,
                "vllm_too_old",
            )
        completions = []
        for index in sorted(choices):
            state = choices[index]
            reason, stop_reason = finished.get(index, ("length", None))
            completion = self._completion(state, reason, stop_reason, params)
            completions.append(completion)
            sent = state.sent_tokens
            yield StreamDelta(
                index=index,
                token_ids=completion.token_ids[sent:],
                text=completion.text[len(state.sent_text) :],
                logprobs=completion.logprobs[sent:],
                finish_reason=completion.finish_reason,
                top_logprobs=completion.top_logprobs[sent:] if completion.top_logprobs else None,
            )
        yield Generation(prompt_ids, completions, request.model or self.served_model)

    def _held_delta(self, index: int, state: _Choice, params: SamplingParams) -> StreamDelta | None:
        """The tokens whose text no stop string can cut any more, if any are new."""
        hold = max((len(s) for s in params.stop), default=1) - 1
        full = self.decode(state.token_ids)
        safe = len(full) - hold
        upto, text = state.sent_tokens, state.sent_text
        for k in range(len(state.token_ids), state.sent_tokens, -1):
            candidate = full if k == len(state.token_ids) else self.decode(state.token_ids[:k])
            if (
                len(candidate) <= safe
                and not candidate.endswith("\ufffd")
                and candidate.startswith(state.sent_text)
            ):
                upto, text = k, candidate
                break
        # A final stop token's text is not part of the completion: never send it early.
        if upto and state.token_ids[upto - 1] in self._eos_ids | set(params.stop_token_ids):
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

    def _completion(
        self, choice: _Choice, finish_reason: str, stop_reason: Any, params: SamplingParams
    ) -> Completion:
        """vLLM's choice in the embedded backend's terms (see the module docstring)."""
        ids, logprobs, top = list(choice.token_ids), list(choice.logprobs), list(choice.top)
        if finish_reason == "stop" and isinstance(stop_reason, str):
            keep = _keep_before(self.decode, ids, stop_reason)
            del ids[keep:], logprobs[keep:], top[keep:]
            text = self.decode(ids)
        elif (
            finish_reason == "stop"
            and ids
            and (stop_reason is None or stop_reason == ids[-1])
            and (ids[-1] in self._eos_ids or ids[-1] in params.stop_token_ids)
        ):
            stop_reason = ids[-1]  # vLLM says None for EOS; the trace names the token
            text = self.decode(ids[:-1])
        else:
            text = self.decode(ids)
        return Completion(
            token_ids=ids,
            text=text,
            logprobs=logprobs,
            finish_reason=finish_reason,
            top_logprobs=top if params.top_logprobs else None,
            stop_reason=stop_reason,
        )

    # -- HTTP --------------------------------------------------------------------------------

    def _client(self) -> httpx.AsyncClient:
        # httpx connection pools belong to one event loop; keep one client per loop.
        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None:
            client = httpx.AsyncClient(
                timeout=httpx.Timeout(self.timeout, connect=10.0),
                limits=httpx.Limits(max_connections=256, max_keepalive_connections=64),
            )
            self._clients[loop] = client
        return client

    def _list_models(self) -> list[dict[str, Any]]:
        try:
            response = httpx.get(self.url + "/v1/models", headers=self._headers, timeout=10.0)
        except httpx.HTTPError as exc:
            raise _unreachable(self.url, exc) from exc
        if response.status_code != 200:
            raise _error(response.status_code, response.text)
        return response.json().get("data", [])

    async def _post_json(self, route: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            response = await self._client().post(self.url + route, json=body, headers=self._headers)
        except httpx.HTTPError as exc:
            raise _unreachable(self.url, exc) from exc
        if response.status_code != 200:
            raise _error(response.status_code, response.text)
        return response.json()

    async def _post_text(self, route: str, body: dict[str, Any]) -> str:
        try:
            response = await self._client().post(self.url + route, json=body, headers=self._headers)
        except httpx.HTTPError as exc:
            raise _unreachable(self.url, exc) from exc
        if (
            response.status_code == 404
            and "lora_adapter" in route
            and "does not exist" not in response.text
        ):
            raise BackendError(
                f"vLLM at {self.url} has no {route}: start it with "
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True (launch_vllm does) and --enable-lora.",
                501,
                "runtime_lora_disabled",
            )
        if response.status_code != 200:
            raise _error(response.status_code, response.text)
        return response.text

    async def _get_json(self, route: str) -> dict[str, Any]:
        try:
            response = await self._client().get(self.url + route, headers=self._headers)
        except httpx.HTTPError as exc:
            raise _unreachable(self.url, exc) from exc
        if response.status_code != 200:
            raise _error(response.status_code, response.text)
        return response.json()


@dataclass
class _Choice:
    """A choice as it accumulates: ids, chosen logprobs and top alternatives."""

    token_ids: list[int]
    logprobs: list[float]
    top: list[dict[int, float]]
    sent_tokens: int = 0
    sent_text: str = ""


def _token_id(token: str) -> int:
    # With return_tokens_as_token_ids, vLLM writes every token as "token_id:<id>".
    return int(token.rpartition(":")[2])


def _choice_logprobs(
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
                _token_id(alt["token"]): float(alt["logprob"])
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
        top.append({_token_id(token): float(lp) for token, lp in items})
    return chosen, top


def _keep_before(decode: Any, ids: list[int], stop: str) -> int:
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


def _error(status: int, text: str) -> BackendError:
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


def _status_of(body: dict[str, Any]) -> int:
    error = body.get("error", body)
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, int) and 400 <= code < 600 else 500


def _unreachable(url: str, exc: Exception) -> BackendError:
    return BackendError(
        f"Cannot reach vLLM at {url} ({type(exc).__name__}: {exc}); is `vllm serve` running "
        "there? `launch_vllm` starts one.",
        503,
        "backend_unavailable",
    )


def _load_tokenizer(tokenizer: Any, fallback: str, url: str) -> Any:
    if tokenizer is not None and not isinstance(tokenizer, (str, os.PathLike)):
        return tokenizer
    spec = str(tokenizer if tokenizer is not None else fallback)
    from masenvs.adapters.models import ModelLoadError, load_tokenizer

    try:
        return load_tokenizer(spec)
    except (ModelLoadError, OSError, ValueError) as exc:
        raise BackendError(
            f"Cannot load the tokenizer {spec!r} that vLLM at {url} serves ({exc}); pass "
            "VLLMBackend(..., tokenizer=<local model directory>).",
            500,
            "tokenizer_unavailable",
        ) from exc


def _eos_ids(tokenizer: Any) -> frozenset[int]:
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    return frozenset(ids)


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A hash of the vocabulary, merges and chat template; the same as the embedded
    backend's, so ids from either backend are known to be interchangeable."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    body = (
        backend.to_str()
        if backend is not None
        else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    )
    digest = hashlib.sha256(body.encode())
    digest.update((tokenizer.chat_template or "").encode())
    return f"sha256:{digest.hexdigest()[:16]}"


# -- launching -----------------------------------------------------------------------------


class VLLMLaunchError(RuntimeError):
    """`vllm serve` could not be started; the message names the cause and the fix."""


@dataclass
class VLLMProcess:
    """A `vllm serve` that masenvs started; `stop()` ends it."""

    process: subprocess.Popen
    url: str
    log_path: Path
    command: list[str] = field(default_factory=list)

    def stop(self, timeout: float = 30.0) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def __enter__(self) -> VLLMProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def vllm_command(vllm_bin: str | None = None, python: str | None = None) -> list[str]:
    """How to run vLLM's CLI: an explicit executable, a python, $MASENVS_VLLM_BIN or PATH."""
    if python is not None:
        return [python, "-m", "vllm.entrypoints.cli.main"]
    candidate = vllm_bin or os.environ.get(VLLM_BIN_ENV) or shutil.which("vllm")
    if not candidate:
        raise VLLMLaunchError(
            "vLLM was not found. It runs in its own environment: "
            "`python -m venv ~/vllm-env && ~/vllm-env/bin/pip install vllm`, then "
            f"`export {VLLM_BIN_ENV}=~/vllm-env/bin/vllm` (or pass vllm_bin=...)."
        )
    path = shutil.which(os.path.expanduser(candidate))
    if path is None:
        raise VLLMLaunchError(
            f"The vLLM executable {candidate!r} (from {VLLM_BIN_ENV} or vllm_bin) does not exist "
            "or is not executable; point it at <vllm env>/bin/vllm."
        )
    return [path]


def model_dir(model: str) -> str:
    """What vLLM loads for a masenvs model name: its converted directory; else `model` as is."""
    if model in ("tiny", "smollm2-135m"):
        from masenvs.adapters.models import cache_dir, load_tokenizer

        load_tokenizer(model)  # builds (converts) the cached model directory once
        return str(cache_dir() / model)
    return model


def launch_vllm(
    model_path: str,
    *,
    port: int = 0,
    host: str = "127.0.0.1",
    lora_modules: Mapping[str, str] | None = None,
    max_loras: int = 4,
    max_lora_rank: int = 64,
    served_model_name: str | None = None,
    vllm_bin: str | None = None,
    python: str | None = None,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    timeout: float = 900.0,
    log_path: str | os.PathLike[str] | None = None,
) -> VLLMProcess:
    """Start `vllm serve` with LoRA enabled and wait until `/health` answers.

    The executable comes from `vllm_bin`, `python` (a python of vLLM's environment),
    `$MASENVS_VLLM_BIN` or PATH. The server's output goes to `log_path` (a temp file by
    default); if it exits before it is healthy, the error shows the end of that log.
    """
    command = vllm_command(vllm_bin, python)
    if port == 0:
        port = _free_port(host)
    args = [
        *command,
        "serve",
        model_dir(model_path),
        "--host",
        host,
        "--port",
        str(port),
        "--enable-lora",
        "--max-loras",
        str(max_loras),
        "--max-lora-rank",
        str(max_lora_rank),
    ]
    if served_model_name:
        args += ["--served-model-name", served_model_name]
    if lora_modules:
        args += ["--lora-modules", *(f"{name}={path}" for name, path in lora_modules.items())]
    args += list(extra_args)
    log_file = (
        Path(log_path) if log_path else Path(tempfile.mkstemp(prefix="vllm-", suffix=".log")[1])
    )
    child_env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", **(env or {})}
    with open(log_file, "ab") as log:
        process = subprocess.Popen(
            args,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=child_env,
            start_new_session=True,  # so stop() ends vLLM's worker processes too
        )
    handle = VLLMProcess(process, f"http://{host}:{port}", log_file, args)
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise VLLMLaunchError(
                f"`vllm serve` exited with status {process.returncode} before it was ready. "
                f"The end of its log ({log_file}):\n{handle.log_tail()}"
            )
        try:
            if httpx.get(f"{handle.url}/health", timeout=2.0).status_code == 200:
                return handle
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            handle.stop()
            raise VLLMLaunchError(
                f"`vllm serve` was not healthy after {timeout:.0f} s; the end of its log "
                f"({log_file}):\n{handle.log_tail()}"
            )
        time.sleep(0.5)


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
