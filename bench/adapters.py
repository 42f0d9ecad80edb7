"""What trace capture adds to one framework LLM call.

Every variant asks the same tiny embedded model the same question with greedy decoding and
the same token budget, so the generation work is identical; the rows differ only in the path
a call takes:

- `backend (in-process)`: `backend.generate` directly, no HTTP (the floor);
- `openai /v1, no store`: official client, plain endpoint with tracing off;
- `openai /r/id/v1, captured`: the same, through a rollout URL with a trace store;
- `ChatOpenAI ...`, `AutoGen ...`, `OpenAILike ...`: each framework's client, plain vs captured.

Calls run one at a time, interleaved round-robin over the variants so drifting machine load
hits them alike. Run: python bench/adapters.py [--calls 200] [--max-tokens 8]
Figures depend on the machine and its load; compare the rows of one run, not across runs.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable

import httpx
import openai
from rich.console import Console
from rich.table import Table

from masenvs.adapters.endpoint import EndpointServer, create_app
from masenvs.adapters.frameworks import Clients, ClientSettings, rollout_url
from masenvs.adapters.policy import Sampling
from masenvs.engine.engine import EmbeddedBackend
from masenvs.engine.protocol import GenerateRequest, SamplingParams
from masenvs.traces import TraceStore

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def variants(
    backend: EmbeddedBackend, plain_root: str, captured_root: str, max_tokens: int
) -> tuple[dict[str, Callable[[], Awaitable[object]]], list[Clients], list[httpx.AsyncClient]]:
    settings = ClientSettings(sampling=Sampling(temperature=0.0, max_tokens=max_tokens))
    plain_url, captured_url = f"{plain_root}/v1", rollout_url(captured_root, "bench")
    http = [httpx.AsyncClient(), httpx.AsyncClient()]
    raw_plain = openai.AsyncOpenAI(base_url=plain_url, api_key="-", http_client=http[0])
    raw_captured = openai.AsyncOpenAI(base_url=captured_url, api_key="-", http_client=http[1])
    request = GenerateRequest(
        model="base",
        params=SamplingParams(max_tokens=max_tokens, temperature=0.0),
        messages=QUESTION,
    )
    pools = {
        (framework, where): Clients(framework, url, ["agent"], settings)
        for framework in ("langgraph", "autogen", "llamaindex")
        for where, url in (("plain", plain_url), ("captured", captured_url))
    }

    def openai_call(client: openai.AsyncOpenAI) -> Callable[[], Awaitable[object]]:
        return lambda: client.chat.completions.create(
            model="agent", messages=QUESTION, max_tokens=max_tokens, temperature=0.0
        )

    def langchain_call(where: str) -> Callable[[], Awaitable[object]]:
        llm = pools[("langgraph", where)]["agent"]
        return lambda: llm.ainvoke(QUESTION)

    def autogen_call(where: str) -> Callable[[], Awaitable[object]]:
        from autogen_core.models import UserMessage

        client = pools[("autogen", where)]["agent"]
        messages = [UserMessage(content=QUESTION[0]["content"], source="user")]
        return lambda: client.create(messages)

    def llamaindex_call(where: str) -> Callable[[], Awaitable[object]]:
        from llama_index.core.llms import ChatMessage

        llm = pools[("llamaindex", where)]["agent"]
        messages = [ChatMessage(role="user", content=QUESTION[0]["content"])]
        return lambda: llm.achat(messages)

    table = {
        "backend (in-process)": lambda: backend.generate(request),
        "openai /v1, no store": openai_call(raw_plain),
        "openai /r/id/v1, captured": openai_call(raw_captured),
    }
    for label, make in (
        ("ChatOpenAI", langchain_call),
        ("AutoGen client", autogen_call),
        ("OpenAILike", llamaindex_call),
    ):
        table[f"{label} /v1, no store"] = make("plain")
        table[f"{label} /r/id/v1, captured"] = make("captured")
    return table, list(pools.values()), http


async def measure(backend: EmbeddedBackend, calls: int, max_tokens: int) -> dict[str, list[float]]:
    with tempfile.TemporaryDirectory() as traces:
        store = TraceStore(traces)
        with (
            EndpointServer(create_app(backend)) as plain,
            EndpointServer(create_app(backend, store=store)) as captured,
        ):
            table, pools, http = await variants(backend, plain.url, captured.url, max_tokens)
            try:
                for call in table.values():  # warm up connections, imports, caches
                    for _ in range(5):
                        await call()
                times: dict[str, list[float]] = {name: [] for name in table}
                for _ in range(calls):
                    for name, call in table.items():
                        start = time.perf_counter()
                        await call()
                        times[name].append(time.perf_counter() - start)
            finally:
                for pool in pools:
                    await pool.aclose()
                for client in http:
                    await client.aclose()
            recorded = sum(1 for _ in store.calls())
        expected = 4 * (calls + 5)  # the four captured variants
        if recorded != expected:
            raise RuntimeError(f"the store holds {recorded} calls, expected {expected}")
        store.close()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200, help="timed calls per variant")
    parser.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args()
    console = Console()
    backend = EmbeddedBackend.from_spec("tiny", max_batch_size=8, max_model_len=512)
    try:
        times = asyncio.run(measure(backend, args.calls, args.max_tokens))
    finally:
        backend.shutdown()
    floor = statistics.median(times["backend (in-process)"])
    table = Table(
        title=f"one call, {args.calls} calls per row, {args.max_tokens} tokens, tiny model"
    )
    for column in ("path", "p50 ms", "p99 ms", "p50 over in-process ms"):
        table.add_column(column, justify="left" if column == "path" else "right")
    for name, values in times.items():
        p50 = statistics.median(values)
        table.add_row(
            name,
            f"{p50 * 1e3:.2f}",
            f"{percentile(values, 0.99) * 1e3:.2f}",
            f"{(p50 - floor) * 1e3:+.2f}",
        )
    console.print(table)
    pairs = [
        ("openai", "openai /v1, no store", "openai /r/id/v1, captured"),
        ("ChatOpenAI", "ChatOpenAI /v1, no store", "ChatOpenAI /r/id/v1, captured"),
        ("AutoGen", "AutoGen client /v1, no store", "AutoGen client /r/id/v1, captured"),
        ("OpenAILike", "OpenAILike /v1, no store", "OpenAILike /r/id/v1, captured"),
    ]
    for label, plain, captured in pairs:
        extra = statistics.median(times[captured]) - statistics.median(times[plain])
        console.print(f"capture adds {extra * 1e3:+.2f} ms per {label} call (p50)")


if __name__ == "__main__":
    main()
