"""The engine pool's overhead per call: p50 of one call straight to a backend vs through an
`EnginePool` of two replicas of it.

    .venv/bin/python bench/scale_router.py            # zero-cost backend: the pool's own cost
    .venv/bin/python bench/scale_router.py --engines  # also: a tiny engine server over HTTP

`router_overhead()` returns the figures (microseconds) for bench/scale.py to print.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import AsyncIterator
from typing import Any

from masenvs.adapters.backends.pool import EnginePool
from masenvs.engine.protocol import (
    Completion,
    GenerateRequest,
    Generation,
    SamplingParams,
    StreamDelta,
)


class ZeroCostBackend:
    """Answers at once with one token: what is left to time is the caller's own work."""

    name = "zero-cost"

    async def generate(self, request: GenerateRequest) -> Generation:
        return Generation([1, 2, 3], [Completion([4], "x", [-0.1], "length")], request.model)

    async def stream(self, request: GenerateRequest) -> AsyncIterator[StreamDelta | Generation]:
        yield await self.generate(request)

    def model_names(self) -> list[str]:
        return ["zero"]

    def decode(self, token_ids: list[int]) -> str:
        return "x" * len(token_ids)

    def tokenizer_id(self) -> str:
        return "zero"

    async def load_adapter(self, name: str, path: str) -> None:
        return None

    async def close(self) -> None:
        return None


async def _p50_us(backend: Any, calls: int, rollouts: int) -> float:
    request = GenerateRequest("", SamplingParams(max_tokens=1, seed=0), prompt="hi")
    times = []
    for k in range(calls):
        request.affinity = f"r{k % rollouts}"
        started = time.perf_counter()
        await backend.generate(request)
        times.append(time.perf_counter() - started)
    return statistics.median(times[calls // 10 :]) * 1e6  # the first tenth warms up


def router_overhead(calls: int = 20000, rollouts: int = 64) -> dict[str, float]:
    """p50 microseconds per call: direct, through a 2-replica pool, and the difference."""
    one = ZeroCostBackend()
    pool = EnginePool([ZeroCostBackend(), ZeroCostBackend()])
    direct = asyncio.run(_p50_us(one, calls, rollouts))
    pooled = asyncio.run(_p50_us(pool, calls, rollouts))
    return {"direct_p50_us": direct, "pool_p50_us": pooled, "overhead_p50_us": pooled - direct}


def engine_overhead(calls: int = 300) -> dict[str, float]:
    """The same over HTTP to one `masenvs serve --engine` (tiny model, max_tokens 1): calls
    straight to it and through a pool holding it alternate, so load drifts cancel out."""
    from masenvs.adapters.backends.launch import launch_engine_server
    from masenvs.adapters.backends.vllm import VLLMBackend

    server = launch_engine_server("tiny", dtype="float32", quantize="none", threads=1)
    try:
        direct_backend = VLLMBackend(server.url, tokenizer="tiny")
        pool = EnginePool([VLLMBackend(server.url, tokenizer=direct_backend.tokenizer)])

        async def measure() -> tuple[float, float]:
            request = GenerateRequest("", SamplingParams(max_tokens=1, seed=0), prompt="hi")
            times: dict[str, list[float]] = {"direct": [], "pool": []}
            for k in range(calls):
                for label, backend in (("direct", direct_backend), ("pool", pool)):
                    request.affinity = f"r{k % 16}"
                    started = time.perf_counter()
                    await backend.generate(request)
                    times[label].append(time.perf_counter() - started)
            await direct_backend.close()
            await pool.close()
            skip = calls // 10
            return tuple(statistics.median(times[x][skip:]) * 1e6 for x in ("direct", "pool"))

        direct, pooled = asyncio.run(measure())
    finally:
        server.stop()
    return {"direct_p50_us": direct, "pool_p50_us": pooled, "overhead_p50_us": pooled - direct}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", action="store_true", help="also time an engine server")
    args = parser.parse_args()
    out = {"zero_cost": router_overhead()}
    if args.engines:
        out["tiny_engine_http"] = engine_overhead()
    print(json.dumps({k: {n: round(v, 1) for n, v in d.items()} for k, d in out.items()}))


if __name__ == "__main__":
    main()
