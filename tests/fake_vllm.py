"""A stand-in for `vllm serve` that speaks vLLM's OpenAI protocol, for tests without a GPU.

Tokens come from the tiny embedded model; everything on the wire follows vLLM (>= 0.10.2):
`return_token_ids` (chat: `prompt_token_ids` at the top level and `token_ids` per choice;
completions: both per choice; streaming: prompt ids in the first chunk, token-id deltas),
`return_tokens_as_token_ids` ("token_id:<id>" strings), chat and legacy logprob shapes,
`stop_reason`, EOS kept in `token_ids` but not in the text, stop strings cutting the text
but not the ids, `skip_special_tokens`, `/v1/models` with LoRA `parent`/`root`,
`/v1/load_lora_adapter` (with `load_inplace`) and `/v1/unload_lora_adapter`, vLLM's error
bodies, and a CLI shaped like `vllm serve MODEL --host --port --enable-lora ...`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route, Router

from masenvs.engine.args import EngineArgs
from masenvs.engine.engine import EmbeddedBackend
from masenvs.engine.protocol import (
    BackendError,
    Completion,
    GenerateRequest,
    Generation,
    SamplingParams,
)


def _error(status: int, message: str, kind: str = "BadRequestError") -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": None, "code": status}},
        status_code=status,
    )


class FakeVLLM:
    """An ASGI app serving `backend` under the name `served_model` the way vLLM does."""

    def __init__(
        self,
        backend: EmbeddedBackend,
        served_model: str,
        root: str | None = None,
        *,
        runtime_lora: bool = True,
        api_key: str | None = None,
        load_inplace: bool = True,  # False: a vLLM from before the `load_inplace` field
        device: str | None = "cuda",  # what /server_info (development mode) says; None: no route
    ) -> None:
        self.backend = backend
        self.tokenizer = backend.tokenizer
        self.served_model = served_model
        self.root = root or served_model
        self.api_key = api_key
        self.load_inplace = load_inplace
        self.lora_paths: dict[str, str] = {}
        self.requests: list[dict[str, Any]] = []  # bodies received, for tests to inspect
        routes = [
            Route("/health", self.health),
            Route("/v1/models", self.models),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
        ]
        if device is not None:  # vLLM serves it with VLLM_SERVER_DEV_MODE=1
            self.device = device
            routes.append(Route("/server_info", self.server_info))
        if runtime_lora:
            routes += [
                Route("/v1/load_lora_adapter", self.load_lora, methods=["POST"]),
                Route("/v1/unload_lora_adapter", self.unload_lora, methods=["POST"]),
            ]
        self.router = Router(routes)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and self.api_key and scope["path"].startswith("/v1"):
            headers = dict(scope["headers"])
            if headers.get(b"authorization", b"").decode() != f"Bearer {self.api_key}":
                await JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)
                return
        await self.router(scope, receive, send)

    async def health(self, request: Request) -> Response:
        return Response(status_code=200)

    async def server_info(self, request: Request) -> Response:
        # The part of vLLM's answer masenvs reads (the real one holds the whole config).
        return JSONResponse({"vllm_config": {"device_config": {"device": self.device}}})

    async def models(self, request: Request) -> Response:
        created = int(time.time())
        cards = [
            {
                "id": self.served_model,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": self.root,
                "parent": None,
                "max_model_len": self.backend.max_model_len,
            }
        ]
        for name, path in self.lora_paths.items():
            cards.append(
                {
                    "id": name,
                    "object": "model",
                    "created": created,
                    "owned_by": "vllm",
                    "root": path,
                    "parent": self.served_model,
                }
            )
        return JSONResponse({"object": "list", "data": cards})

    async def load_lora(self, request: Request) -> Response:
        body = await request.json()
        name, path = body["lora_name"], body["lora_path"]
        inplace = bool(body.get("load_inplace")) and self.load_inplace
        if name in self.lora_paths and not inplace:
            return _error(
                400,
                f"The lora adapter '{name}' has already been loaded. If you want to load the "
                "adapter in place, set 'load_inplace' to True.",
                "InvalidUserInput",
            )
        try:
            await self.backend.load_adapter(name, path)
        except BackendError as exc:
            return _error(400, str(exc))
        self.lora_paths[name] = path
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora(self, request: Request) -> Response:
        name = (await request.json())["lora_name"]
        if name not in self.lora_paths:
            return _error(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
        self.backend.remove_adapter(name)
        del self.lora_paths[name]
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    # -- generation ------------------------------------------------------------------------

    def _model(self, body: dict[str, Any]) -> str | None:
        model = body.get("model") or self.served_model
        if model == self.served_model:
            return "base"
        return model if model in self.lora_paths else None

    def _params(self, body: dict[str, Any], top: int) -> tuple[SamplingParams, list[str]]:
        top_k = body.get("top_k")
        stop = body.get("stop") or []
        return SamplingParams(
            max_tokens=body.get("max_tokens") or body.get("max_completion_tokens") or 16,
            temperature=1.0 if body.get("temperature") is None else body["temperature"],
            top_p=1.0 if body.get("top_p") is None else body["top_p"],
            top_k=0 if top_k in (None, -1) else top_k,
            stop=[],  # applied below the way vLLM does: the ids are not cut
            stop_token_ids=list(body.get("stop_token_ids") or []),
            seed=body.get("seed"),
            n=body.get("n") or 1,
            top_logprobs=top,
        ), ([stop] if isinstance(stop, str) else list(stop))

    async def _generate(
        self, body: dict[str, Any], request: GenerateRequest, stops: list[str]
    ) -> Generation | Response:
        try:
            generation = await self.backend.generate(request)
        except BackendError as exc:
            if exc.code == "context_length_exceeded":
                return _error(
                    400,
                    f"This model's maximum context length is {self.backend.max_model_len} "
                    "tokens. However, your request has too many input tokens. Please reduce "
                    "the length of the input messages.",
                )
            return _error(exc.status, str(exc))
        skip = body.get("skip_special_tokens", True)
        stop_ids = set(request.params.stop_token_ids)
        for completion in generation.completions:
            self._vllm_semantics(completion, stops, stop_ids, skip)
        return generation

    def _vllm_semantics(
        self, completion: Completion, stops: list[str], stop_ids: set[int], skip: bool
    ) -> None:
        """Turn the embedded engine's choice into what vLLM reports for it."""
        ids = completion.token_ids
        for k in range(1, len(ids) + 1) if stops else ():
            text = self.tokenizer.decode(ids[:k], skip_special_tokens=skip)
            hits = [(text.find(s), s) for s in stops if s in text]
            if hits:
                cut, stop = min(hits)
                del ids[k:], completion.logprobs[k:]
                if completion.top_logprobs:
                    del completion.top_logprobs[k:]
                completion.text = text[:cut]
                completion.finish_reason, completion.stop_reason = "stop", stop
                return
        visible = ids
        if isinstance(completion.stop_reason, int):
            visible = ids[:-1]
            if completion.stop_reason not in stop_ids:
                completion.stop_reason = None  # vLLM: None when the EOS token ended it
        completion.text = self.tokenizer.decode(visible, skip_special_tokens=skip)

    def _token(self, token_id: int, as_ids: bool) -> str:
        return f"token_id:{token_id}" if as_ids else self.tokenizer.decode([token_id])

    def _chat_logprobs(self, c: Completion, start: int, end: int, top: int, as_ids: bool):
        content = []
        for k in range(start, end):
            token = self._token(c.token_ids[k], as_ids)
            alternatives = sorted(
                (c.top_logprobs or [{}] * len(c.token_ids))[k].items(), key=lambda kv: -kv[1]
            )[:top]
            content.append(
                {
                    "token": token,
                    "logprob": c.logprobs[k],
                    "bytes": list(token.encode()),
                    "top_logprobs": [
                        {
                            "token": self._token(t, as_ids),
                            "logprob": lp,
                            "bytes": list(self._token(t, as_ids).encode()),
                        }
                        for t, lp in alternatives
                    ],
                }
            )
        return {"content": content}

    def _legacy_logprobs(self, c: Completion, start: int, end: int, top: int, as_ids: bool):
        tops = []
        for k in range(start, end):
            entry = {self._token(c.token_ids[k], as_ids): c.logprobs[k]}
            if c.top_logprobs:
                best = sorted(c.top_logprobs[k].items(), key=lambda kv: -kv[1])[:top]
                entry.update({self._token(t, as_ids): lp for t, lp in best})
            tops.append(entry)
        return {
            "text_offset": list(range(start, end)),
            "token_logprobs": c.logprobs[start:end],
            "tokens": [self._token(t, as_ids) for t in c.token_ids[start:end]],
            "top_logprobs": tops,
        }

    async def chat(self, request: Request) -> Response:
        body = await request.json()
        self.requests.append(body)
        model = self._model(body)
        if model is None:
            return _error(404, f"The model `{body.get('model')}` does not exist.", "NotFoundError")
        if body.get("tools") and body.get("tool_choice", "auto") == "auto":
            return _error(
                400,
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
            )
        top = body.get("top_logprobs") or 0
        params, stops = self._params(body, top)
        generate = GenerateRequest(
            model=model,
            params=params,
            messages=body["messages"],
            tools=body.get("tools"),
            chat_template_kwargs=body.get("chat_template_kwargs") or {},
        )
        generation = await self._generate(body, generate, stops)
        if isinstance(generation, Response):
            return generation
        if body.get("stream"):
            return self._stream_chat(body, generation, top)
        as_ids = bool(body.get("return_tokens_as_token_ids"))
        choices = []
        for i, c in enumerate(generation.completions):
            choice: dict[str, Any] = {
                "index": i,
                "message": {"role": "assistant", "content": c.text, "reasoning": None},
                "logprobs": self._chat_logprobs(c, 0, len(c.token_ids), top, as_ids)
                if body.get("logprobs")
                else None,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
                "token_ids": c.token_ids if body.get("return_token_ids") else None,
            }
            choices.append(choice)
        return JSONResponse(
            {
                "id": f"chatcmpl-{uuid.uuid4().hex}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": body.get("model") or self.served_model,
                "choices": choices,
                "usage": _usage(generation),
                "prompt_logprobs": None,
                "prompt_token_ids": generation.prompt_token_ids
                if body.get("return_token_ids")
                else None,
            }
        )

    async def completions(self, request: Request) -> Response:
        body = await request.json()
        self.requests.append(body)
        model = self._model(body)
        if model is None:
            return _error(404, f"The model `{body.get('model')}` does not exist.", "NotFoundError")
        top = body.get("logprobs")
        params, stops = self._params(body, top or 0)
        generate = GenerateRequest(model=model, params=params, prompt=body["prompt"])
        generation = await self._generate(body, generate, stops)
        if isinstance(generation, Response):
            return generation
        if body.get("stream"):
            return self._stream_completion(body, generation, top)
        as_ids = bool(body.get("return_tokens_as_token_ids"))
        ids = bool(body.get("return_token_ids"))
        choices = [
            {
                "index": i,
                "text": c.text,
                "logprobs": self._legacy_logprobs(c, 0, len(c.token_ids), top, as_ids)
                if top is not None
                else None,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
                "token_ids": c.token_ids if ids else None,
                "prompt_logprobs": None,
                "prompt_token_ids": generation.prompt_token_ids if ids else None,
            }
            for i, c in enumerate(generation.completions)
        ]
        return JSONResponse(
            {
                "id": f"cmpl-{uuid.uuid4().hex}",
                "object": "text_completion",
                "created": int(time.time()),
                "model": body.get("model") or self.served_model,
                "choices": choices,
                "usage": _usage(generation),
            }
        )

    # -- streaming: one chunk per token, the way vLLM's DELTA output arrives ------------------

    def _pieces(self, c: Completion) -> list[str]:
        """Text deltas per token that add up to the completion's text."""
        pieces, sent = [], 0
        for k in range(1, len(c.token_ids) + 1):
            upto = min(len(self.tokenizer.decode(c.token_ids[:k])), len(c.text))
            if self.tokenizer.decode(c.token_ids[:k]).endswith("\ufffd"):
                upto = sent  # vLLM holds back an incomplete character
            if k == len(c.token_ids):
                upto = len(c.text)
            pieces.append(c.text[sent:upto])
            sent = max(sent, upto)
        return pieces

    def _stream_chat(self, body: dict[str, Any], generation: Generation, top: int) -> Response:
        as_ids, with_ids = (
            bool(body.get("return_tokens_as_token_ids")),
            bool(body.get("return_token_ids")),
        )
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        model = body.get("model") or self.served_model

        def chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
            data = {
                "id": cid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": choices,
                **extra,
            }
            return b"data: " + json.dumps(data).encode() + b"\n\n"

        async def events():
            first = [
                {
                    "index": i,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
                for i in range(len(generation.completions))
            ]
            yield chunk(first, prompt_token_ids=generation.prompt_token_ids if with_ids else None)
            for i, c in enumerate(generation.completions):
                for k, piece in enumerate(self._pieces(c)):
                    last = k == len(c.token_ids) - 1
                    yield chunk(
                        [
                            {
                                "index": i,
                                "delta": {"content": piece},
                                "logprobs": self._chat_logprobs(c, k, k + 1, top, as_ids)
                                if body.get("logprobs")
                                else None,
                                "finish_reason": c.finish_reason if last else None,
                                "stop_reason": c.stop_reason if last else None,
                                "token_ids": [c.token_ids[k]] if with_ids else None,
                            }
                        ]
                    )
                    await asyncio.sleep(0)
            if (body.get("stream_options") or {}).get("include_usage"):
                yield chunk([], usage=_usage(generation))
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    def _stream_completion(
        self, body: dict[str, Any], generation: Generation, top: int | None
    ) -> Response:
        as_ids, with_ids = (
            bool(body.get("return_tokens_as_token_ids")),
            bool(body.get("return_token_ids")),
        )
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        model = body.get("model") or self.served_model

        async def events():
            for i, c in enumerate(generation.completions):
                for k, piece in enumerate(self._pieces(c)):
                    last = k == len(c.token_ids) - 1
                    choice = {
                        "index": i,
                        "text": piece,
                        "logprobs": self._legacy_logprobs(c, k, k + 1, top, as_ids)
                        if top is not None
                        else None,
                        "finish_reason": c.finish_reason if last else None,
                        "stop_reason": c.stop_reason if last else None,
                        "token_ids": [c.token_ids[k]] if with_ids else None,
                        "prompt_token_ids": generation.prompt_token_ids
                        if with_ids and k == 0
                        else None,
                    }
                    data = {
                        "id": cid,
                        "object": "text_completion",
                        "created": created,
                        "model": model,
                        "choices": [choice],
                    }
                    yield b"data: " + json.dumps(data).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")


def _usage(generation: Generation) -> dict[str, int]:
    prompt = len(generation.prompt_token_ids)
    completion = sum(len(c.token_ids) for c in generation.completions)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def main(argv: list[str]) -> int:
    """`fake_vllm.py serve MODEL --host H --port P [--enable-lora ...]`, like `vllm serve`."""
    import uvicorn

    from masenvs.engine.loading import load_model

    parser = argparse.ArgumentParser(prog="vllm")
    parser.add_argument("command", choices=["serve"])
    parser.add_argument("model")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--enable-lora", action="store_true")
    parser.add_argument("--max-loras", type=int, default=1)
    parser.add_argument("--max-lora-rank", type=int, default=16)
    parser.add_argument("--lora-modules", nargs="*", default=[])
    parser.add_argument("--served-model-name")
    parser.add_argument("--api-key")
    args, _ = parser.parse_known_args(argv)  # vLLM flags it has no use for
    backend = EmbeddedBackend(load_model(args.model), EngineArgs(max_model_len=512))
    app = FakeVLLM(
        backend,
        args.served_model_name or args.model,
        args.model,
        runtime_lora=os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower()
        in ("1", "true"),
        api_key=args.api_key,
    )
    for module in args.lora_modules:
        name, _, path = module.partition("=")
        asyncio.run(backend.load_adapter(name, path))
        app.lora_paths[name] = path
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
