"""What the capture endpoint adds per call over calling the backend in process.

The same request goes (a) straight to `backend.generate` in this process and (b) through
the endpoint over loopback HTTP (uvicorn in a background thread, as the rollout code runs
it), alternately, so drift hits both alike. Overhead = endpoint latency - in-process
latency, at p50 and p99 of each side (a difference of quantiles, not the quantile of a
difference). Two backends:

  instant  returns fixed tokens at once: the whole measured time is endpoint overhead
  tiny     the tiny embedded model with max_tokens small: the realistic case (noisier)

Clients: a keep-alive httpx client posting JSON (the endpoint's own cost) and the official
openai client (what frameworks pay, its own parsing included). Stores: none, flush (write
to the OS before answering, the default) and fsync (on disk before answering).

    python bench/endpoint.py                 # 300 calls per row
    python bench/endpoint.py --calls 1000 --backends instant
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import openai
from rich.console import Console
from rich.table import Table

from masenvs.adapters.backends.base import (
    Completion,
    GenerateRequest,
    Generation,
    SamplingParams,
    StreamDelta,
)
from masenvs.adapters.endpoint import EndpointServer, create_app
from masenvs.traces import CallRecord, ChoiceRecord, TraceStore

MESSAGES = [
    {"role": "system", "content": "You are the planner of a team solving a 4x4 sudoku."},
    {"role": "user", "content": "Board:\n1 . . 4\n. 4 1 .\n. 1 4 .\n4 . . 1\nYour move?"},
]
TARGET_P50_MS = 2.0


class InstantBackend:
    """Answers every request at once with the same 8 tokens: a zero-cost backend."""

    name = "instant"

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.chat_template = tokenizer.chat_template
        self._prompt = tokenizer.apply_chat_template(
            MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        self._ids = tokenizer("Put 2 in row 1, column 2.", add_special_tokens=False)["input_ids"][
            :8
        ]

    async def generate(self, request: GenerateRequest) -> Generation:
        completion = Completion(
            list(self._ids), self.tokenizer.decode(self._ids), [-0.5] * len(self._ids), "length"
        )
        return Generation(list(self._prompt), [completion] * request.params.n, request.model)

    async def stream(self, request: GenerateRequest) -> AsyncIterator[StreamDelta | Generation]:
        yield await self.generate(request)

    def model_names(self) -> list[str]:
        return ["instant"]

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)

    def tokenizer_id(self) -> str:
        return "instant"

    async def load_adapter(self, name: str, path: str) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        pass


def quantiles(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return statistics.median(ordered), p99


def measure(
    backend: Any, model: str, store: TraceStore | None, client_kind: str, calls: int
) -> tuple[list[float], list[float]]:
    """Alternate in-process and endpoint calls; return both latency lists in ms."""
    request = GenerateRequest(
        model="base", params=SamplingParams(max_tokens=4, temperature=0.0), messages=MESSAGES
    )
    body = {"model": model, "messages": MESSAGES, "max_tokens": 4, "temperature": 0}
    loop = asyncio.new_event_loop()
    inproc: list[float] = []
    endpoint: list[float] = []
    with EndpointServer(create_app(backend, store=store)) as server:
        http = httpx.Client(timeout=60)
        api = openai.OpenAI(base_url=server.base_url, api_key="-", max_retries=0)
        url = f"{server.base_url}/chat/completions"
        call: Callable[[], Any]
        if client_kind == "httpx":
            call = lambda: http.post(url, json=body).raise_for_status()  # noqa: E731
        else:
            call = lambda: api.chat.completions.create(**body)  # noqa: E731
        for _ in range(10):  # warm up connections, caches, the engine
            call()
            loop.run_until_complete(backend.generate(request))
        for _ in range(calls):
            start = time.perf_counter()
            loop.run_until_complete(backend.generate(request))
            inproc.append((time.perf_counter() - start) * 1e3)
            start = time.perf_counter()
            call()
            endpoint.append((time.perf_counter() - start) * 1e3)
        http.close()
        api.close()
    loop.close()
    return inproc, endpoint


def record_write_cost(samples: int = 500) -> list[tuple[str, float, float]]:
    """Time `TraceStore.append` of one realistic record, by durability."""
    record = CallRecord(
        id="chatcmpl-x",
        rollout_id="r",
        agent="planner",
        model="base",
        call_index=0,
        kind="chat",
        prompt_token_ids=list(range(300)),
        choices=[ChoiceRecord(0, "x" * 400, list(range(100)), [-0.5] * 100, "stop")],
        messages=MESSAGES,
    )
    rows = []
    for durability in ("flush", "fsync"):
        with tempfile.TemporaryDirectory() as tmp, TraceStore(tmp, durability=durability) as store:
            times = []
            for _ in range(samples):
                start = time.perf_counter()
                store.append(record)
                times.append((time.perf_counter() - start) * 1e3)
        rows.append((durability, *quantiles(times)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--backends", nargs="+", default=["instant", "tiny"])
    args = parser.parse_args()
    console = Console(width=120)

    from masenvs.adapters.models import load_tokenizer

    table = Table(title=f"Endpoint overhead per call ({args.calls} calls per row, max_tokens=4)")
    for column in ("backend", "client", "store", "in-process p50", "endpoint p50", "endpoint p99",
                   "overhead p50", "overhead p99"):  # fmt: skip
        table.add_column(column, justify="right" if "p" in column[-3:] else "left")
    for name in args.backends:
        if name == "instant":
            backend: Any = InstantBackend(load_tokenizer("tiny"))
            model = "instant"
        else:
            from masenvs.adapters.backends.embedded import EmbeddedBackend

            backend = EmbeddedBackend.from_spec(name)
            model = name
        for client_kind in ("httpx", "openai"):
            for durability in ("none", "flush", "fsync"):
                if client_kind == "openai" and durability != "flush":
                    continue  # one openai row per backend: its cost does not depend on the store
                with tempfile.TemporaryDirectory() as tmp:
                    store = None if durability == "none" else TraceStore(tmp, durability=durability)
                    inproc, endpoint = measure(backend, model, store, client_kind, args.calls)
                    if store is not None:
                        store.close()
                ip50, ip99 = quantiles(inproc)
                ep50, ep99 = quantiles(endpoint)
                over50 = ep50 - ip50
                mark = "green" if over50 <= TARGET_P50_MS else "red"
                table.add_row(
                    name,
                    client_kind,
                    durability,
                    f"{ip50:.2f} ms",
                    f"{ep50:.2f} ms",
                    f"{ep99:.2f} ms",
                    f"[{mark}]{over50:.2f} ms[/{mark}]",
                    f"{ep99 - ip99:.2f} ms",
                )
        shutdown = getattr(backend, "shutdown", None)
        if shutdown is not None:
            shutdown()
    console.print(table)
    console.print(f"target: overhead p50 <= {TARGET_P50_MS} ms (httpx client, flush store)")
    writes = Table(title="TraceStore.append of one record (300 prompt + 100 completion tokens)")
    for column in ("durability", "p50", "p99"):
        writes.add_column(column)
    for durability, p50, p99 in record_write_cost():
        writes.add_row(durability, f"{p50:.3f} ms", f"{p99:.3f} ms")
    console.print(writes)


if __name__ == "__main__":
    main()
