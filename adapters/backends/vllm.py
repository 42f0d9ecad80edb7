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

`launch_vllm` (backends/launch.py) finds vLLM (a CUDA install or the CPU build that
scripts/vllm_cpu_env.sh makes) and starts it; `VLLMBackend.update_weights` puts new full
weights into a running server through the worker extension in `vllm_ext/`. Every request
has a timeout.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import weakref
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx

from masenvs.adapters.backends import launch as launcher
from masenvs.adapters.backends.vllm_protocol import (
    ChoiceState,
    choice_logprobs,
    device_of,
    error_from,
    held_delta,
    read_completion,
    request_body,
    status_of,
    unreachable,
)
from masenvs.engine.protocol import (
    BackendError,
    GenerateRequest,
    Generation,
    StreamDelta,
)

log = logging.getLogger(__name__)

BASE_NAMES = ("", "base")
UPDATE_METHOD = "masenvs_load_weights"  # the worker extension's method (vllm_ext/)


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
        process: launcher.VLLMProcess | None = None,
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
        device = device_of(info)
        if device is not None:
            return device != "cpu", f"its /server_info names device {device!r}"
        return False, "its device is unknown (no /server_info)"

    @classmethod
    def launch(
        cls, model: str, *, request_timeout: float = 600.0, **launch_options: Any
    ) -> VLLMBackend:
        """Start vLLM on `model` (`launch_vllm`'s options) and connect; `shutdown()` stops it."""
        server = launcher.launch_vllm(model, **launch_options)
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
            logprobs, top = choice_logprobs(choice, route, request.params.top_logprobs)
            completions.append(
                read_completion(
                    self.decode,
                    self._eos_ids,
                    ChoiceState(list(ids), logprobs, top),
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
        model = self.served_model if request.model in BASE_NAMES else request.model
        seed = request.params.seed
        if seed is not None and not self.honours_seed and not self._seed_dropped:
            self._seed_dropped = True
            log.warning(
                "vLLM at %s gets no per-request seeds (%s): seeded calls are sampled "
                "unseeded. vLLM's CPU build fails on them (docs/vllm.md); a GPU server "
                "takes them with VLLMBackend(honours_seed=True).",
                self.url,
                self.seed_note,
            )
        return request_body(request, model, stream, send_seed=self.honours_seed)

    async def _stream(self, request: GenerateRequest) -> AsyncIterator[StreamDelta | Generation]:
        route, body = self._request_body(request, stream=True)
        params = request.params
        choices: dict[int, ChoiceState] = {}
        finished: dict[int, tuple[str, Any]] = {}
        prompt_ids: list[int] | None = None
        client = self._client()
        try:
            async with client.stream(
                "POST", self.url + route, json=body, headers=self._headers
            ) as response:
                if response.status_code != 200:
                    raise error_from(
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
                        raise error_from(status_of(chunk), payload)
                    if chunk.get("prompt_token_ids") is not None:
                        prompt_ids = list(chunk["prompt_token_ids"])
                    for choice in chunk.get("choices") or []:
                        index = choice["index"]
                        state = choices.setdefault(index, ChoiceState([], [], []))
                        if choice.get("prompt_token_ids") is not None:
                            prompt_ids = list(choice["prompt_token_ids"])
                        ids = choice.get("token_ids") or []
                        logprobs, top = choice_logprobs(choice, route, params.top_logprobs)
                        state.token_ids += ids
                        state.logprobs += logprobs[: len(ids)]
                        state.top += top[: len(ids)]
                        if choice.get("finish_reason"):
                            finished[index] = (choice["finish_reason"], choice.get("stop_reason"))
                        else:
                            delta = held_delta(self.decode, self._eos_ids, index, state, params)
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
            completion = read_completion(
                self.decode, self._eos_ids, state, reason, stop_reason, params
            )
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
        return unreachable(self.url, exc)

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
            raise error_from(response.status_code, response.text)
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
            raise error_from(response.status_code, response.text)
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
                f"--worker-extension-cls {launcher.EXTENSION_CLASS} and "
                f"{launcher.EXTENSION_DIR} on its PYTHONPATH (launch_vllm(weight_updates=True) "
                "does).",
                501,
                "weight_updates_disabled",
            )
        if response.status_code != 200:
            raise error_from(response.status_code, f"{route}: {response.text}")
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
            raise error_from(response.status_code, response.text)
        return response.text

    async def _get_json(self, route: str) -> dict[str, Any]:
        try:
            response = await self._client().get(self.url + route, headers=self._headers)
        except httpx.HTTPError as exc:
            raise self._failed(exc) from exc
        if response.status_code != 200:
            raise error_from(response.status_code, response.text)
        return response.json()


def _load_tokenizer(tokenizer: Any, fallback: str, url: str) -> Any:
    if tokenizer is not None and not isinstance(tokenizer, (str, os.PathLike)):
        return tokenizer
    spec = str(tokenizer if tokenizer is not None else fallback)
    from masenvs.engine.loading import ModelLoadError, load_tokenizer

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
