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

`--single-stream` measures decoding speed instead: one client's tokens/s through a real
`masenvs serve` process (the official openai client, non-streaming and streaming) side by
side with the same engine called in process, both started with serve's defaults, each in
its own process, alternately. `--isa avx2` runs both as on a CPU without AVX-512 (see
bench/engine.py).

    python bench/endpoint.py --single-stream --isa avx2
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import openai
from rich.console import Console
from rich.table import Table

from masenvs.adapters.endpoint import EndpointServer, create_app
from masenvs.cache import DEFAULT_MODEL
from masenvs.engine.protocol import (
    Completion,
    GenerateRequest,
    Generation,
    SamplingParams,
    StreamDelta,
)
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


STORY = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]


def _in_process(model: str, pipe: Any) -> None:
    """The engine as `masenvs serve` starts it, called in process: replies to each
    max_tokens with (tokens, seconds) of one request."""
    try:
        import torch

        from masenvs.adapters.stack import make_backend
        from masenvs.engine import kernels as cpu_kernels

        backend = make_backend(model, dtype="auto", quantize="auto")  # serve's defaults
        loop = asyncio.new_event_loop()

        def run(max_tokens: int) -> tuple[int, float]:
            params = SamplingParams(max_tokens=max_tokens, temperature=1.0, ignore_eos=True)
            request = GenerateRequest(model="base", params=params, messages=STORY)
            start = time.perf_counter()
            generation = loop.run_until_complete(backend.generate(request))
            return len(generation.completions[0].token_ids), time.perf_counter() - start

        run(8)  # warm-up
        native = backend.forward.native
        pipe.send(
            (
                cpu_kernels.kernel_set() if native else "torch",
                torch.backends.cpu.get_cpu_capability(),
                str(backend.forward.dtype).removeprefix("torch."),
            )
        )
        while (max_tokens := pipe.recv()) is not None:
            pipe.send(run(max_tokens))
        backend.shutdown()
    except BaseException as exc:  # shown by the parent
        pipe.send(RuntimeError(repr(exc)))


def _start_serve(model: str) -> tuple[subprocess.Popen, str, str]:
    """`masenvs serve --port 0` in a child process; its /v1 URL once it listens, and its
    banner's engine line (dtype and kernel set)."""
    command = [sys.executable, "-m", "masenvs.cli", "serve", "--model", model, "--port", "0"]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None
    url = None
    for line in server.stdout:
        found = re.search(r"at (http://\S+/v1)", line)
        url = found.group(1) if found else url
        if url is not None and line.strip().startswith("engine:"):
            return server, url, line.strip().removeprefix("engine: ")
    raise RuntimeError(f"masenvs serve exited ({server.wait()}) before it listened")


def single_stream(args: argparse.Namespace) -> None:
    """One client's decoding tokens/s: in process vs through `masenvs serve`."""
    from engine import ISA_ENVIRONMENT, cpu_model  # bench/engine.py

    os.environ.update(ISA_ENVIRONMENT[args.isa])  # for both child processes
    console = Console(width=120)
    context = multiprocessing.get_context("spawn")
    pipe, child = context.Pipe()
    worker = context.Process(target=_in_process, args=(args.model, child))
    worker.start()
    ready = pipe.recv()
    if isinstance(ready, BaseException):
        raise ready
    kernels, capability, dtype = ready
    server, base_url, serve_engine = _start_serve(args.model)
    api = openai.OpenAI(base_url=base_url, api_key="-", max_retries=0, timeout=600)
    body = {
        "model": "base",
        "messages": STORY,
        "max_tokens": args.max_tokens,
        "temperature": 1.0,
        "extra_body": {"ignore_eos": True},
    }

    def plain() -> tuple[int, float]:
        start = time.perf_counter()
        response = api.chat.completions.create(**body)
        return response.usage.completion_tokens, time.perf_counter() - start

    def streamed() -> tuple[int, float]:
        start = time.perf_counter()
        tokens = 0
        stream = api.chat.completions.create(
            **body, stream=True, stream_options={"include_usage": True}
        )
        for chunk in stream:
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return tokens, time.perf_counter() - start

    def in_process() -> tuple[int, float]:
        pipe.send(args.max_tokens)
        return pipe.recv()

    sides = {"in process": in_process, "serve, openai client": plain, "serve, streaming": streamed}
    rates: dict[str, list[float]] = {name: [] for name in sides}
    try:
        for call in (plain, streamed):
            call()  # warm-up
        for _ in range(args.repeats):  # interleaved: load from elsewhere hits all alike
            for name, call in sides.items():
                tokens, seconds = call()
                assert tokens == args.max_tokens, (name, tokens)
                rates[name].append(tokens / seconds)
    finally:
        pipe.send(None)
        worker.join()
        server.terminate()
        server.wait()
    table = Table(
        title=f"{args.model}, one client, {args.max_tokens} tokens per request (prefill "
        f"included), median of {args.repeats}; {cpu_model()}, {os.cpu_count()} CPUs, isa "
        f"{args.isa}: in process: kernels {kernels}, torch {capability}, engine {dtype}; "
        f"serve: {serve_engine}"
    )
    for column in ("path", "tokens/s (median)", "min", "max", "vs in process"):
        table.add_column(column, justify="right")
    base = statistics.median(rates["in process"])
    for name, values in rates.items():
        median = statistics.median(values)
        table.add_row(
            name,
            f"{median:.1f}",
            f"{min(values):.1f}",
            f"{max(values):.1f}",
            f"{median / base:.2f}x",
        )
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--backends", nargs="+", default=["instant", "tiny"])
    parser.add_argument("--single-stream", action="store_true", help="tokens/s of one client")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="--single-stream's model")
    parser.add_argument("--max-tokens", type=int, default=128, help="--single-stream")
    parser.add_argument("--repeats", type=int, default=5, help="--single-stream")
    parser.add_argument("--isa", choices=["native", "avx2"], default="native", help="see engine.py")
    args = parser.parse_args()
    if args.single_stream:
        single_stream(args)
        return
    console = Console(width=120)

    from masenvs.engine.loading import load_tokenizer

    table = Table(title=f"Endpoint overhead per call ({args.calls} calls per row, max_tokens=4)")
    for column in ("backend", "client", "store", "in-process p50", "endpoint p50", "endpoint p99",
                   "overhead p50", "overhead p99"):  # fmt: skip
        table.add_column(column, justify="right" if "p" in column[-3:] else "left")
    for name in args.backends:
        if name == "instant":
            backend: Any = InstantBackend(load_tokenizer("tiny"))
            model = "instant"
        else:
            from masenvs.engine.engine import EmbeddedBackend

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
