"""Scale-out against real vLLM: the trainer starts two vLLM servers behind an `EnginePool`
(`distributed.engines.count: 2`, backend vllm) and trains on them; the same two servers then
serve a pool built by hand and a second run that is given them by URL (`engines.urls`).

Starting a vLLM CPU server takes a minute or more, so the module starts two, once: the
trainer's run asks its pool to stop them at the end (the test records that it did) and the
servers are stopped for real when the module ends. The model is `test_vllm_real`'s tiny
Llama (head_dim 32, which vLLM's CPU attention supports); its toy env, config and
transformers + peft reference come from there too.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from test_vllm_real import (
    TOLERANCE,
    differs,
    make_adapter,
    reference,
    tiny_llama,
    toy_config,
)

from masenvs.adapters.backends.launch import VLLMLaunchError, find_vllm
from masenvs.adapters.backends.pool import EnginePool
from masenvs.adapters.backends.vllm import VLLMBackend
from masenvs.engine.protocol import GenerateRequest, Generation, SamplingParams
from masenvs.traces import TraceStore

pytestmark = pytest.mark.vllm

ENGINES = ("engine-0", "engine-1")
POLICIES = ("writer", "editor")  # the toy env's agents, one adapter each
HELLO = [{"role": "user", "content": "Say hello."}]


@dataclass
class Engines:
    """The two servers the trainer started, and what its run left behind."""

    model: Path
    run_dir: Path
    pool: EnginePool  # the trainer's pool (shut down by the trainer; its servers are kept)
    urls: list[str]
    loads: list[tuple[str, str, str]]  # every load_adapter: (url, adapter, version folder)
    stopped: list[str] = field(default_factory=list)  # servers the trainer asked to stop


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engines]:
    try:
        install = find_vllm()
    except VLLMLaunchError as exc:
        if os.environ.get("CI", "").lower() in ("true", "1"):
            pytest.fail(f"CI runs the vllm tests against a real vLLM and found none: {exc}")
        pytest.skip(f"no vLLM here ({exc})")
    from masenvs.trainer.inference import engines as engines_module
    from masenvs.trainer.run import train as train_module

    model = tiny_llama(tmp_path_factory.mktemp("tiny-vllm"), seed=0)
    run_dir = tmp_path_factory.mktemp("run-started")
    loads: list[tuple[str, str, str]] = []
    started: list[VLLMBackend] = []
    pools: list[EnginePool] = []
    stopped: list[str] = []
    load_adapter = VLLMBackend.load_adapter
    engine_pools = engines_module.engine_pools

    async def recorded_load(self: VLLMBackend, name: str, path: str) -> None:
        loads.append((self.url, name, Path(path).name))
        await load_adapter(self, name, path)

    def kept_pools(*args, **kwargs):
        pool = engine_pools(*args, **kwargs)
        pools.append(pool)
        for engine in pool.engines:
            backend = engine.backend
            started.append(backend)
            # Record the trainer's stop; the server itself stops when the module ends.
            backend.shutdown = lambda url=backend.url: stopped.append(url)  # type: ignore[method-assign]
        return pool

    python = install.prefix[0] if install.model_flag else None
    cfg = toy_config(run_dir, model, 2, vllm_python=python)
    cfg.distributed.engines.count = 2
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB each: two servers share the RAM
        patch.setattr(VLLMBackend, "load_adapter", recorded_load)  # for the whole module
        try:
            with pytest.MonkeyPatch.context() as trainer:
                trainer.setattr(engines_module, "engine_pools", kept_pools)
                result = train_module.train(cfg)
            assert result.steps == 2 and len(pools) == 1
            urls = [e.backend.url for e in pools[0].engines]
            yield Engines(model, run_dir, pools[0], urls, loads, stopped)
        finally:
            for backend in started:
                if backend.process is not None:
                    backend.process.stop()


def run(coro):
    return asyncio.run(coro)


def greedy(backend, model: str, affinity: str | None = None) -> Generation:
    params = SamplingParams(max_tokens=10, temperature=0)
    request = GenerateRequest(model, params, messages=HELLO, affinity=affinity)

    async def call() -> Generation:
        try:
            return await backend.generate(request)
        finally:
            await backend.close()

    return run(call())


def on_each(urls: list[str], model: str) -> list[Generation]:
    """The same greedy call, to each server directly (not through a pool)."""
    return [greedy(VLLMBackend(url, timeout=300), model) for url in urls]


def same_answer(a: Generation, b: Generation) -> bool:
    (x,), (y,) = a.completions, b.completions
    return x.token_ids == y.token_ids and x.logprobs == pytest.approx(y.logprobs, abs=1e-3)


def step_of(rollout_id: str) -> int:
    return int(re.match(r"s(\d+)", rollout_id).group(1))


def check_trained_on_both(engines: Engines, run_dir: Path, since: int) -> None:
    """What a 2-step LoRA run on the two servers must leave: a metrics row per step whose
    learner log-probs agree with the servers', each call under the weights of the step
    before, every weight sync (versions 0, 1, 2 of each adapter) loaded on both servers,
    calls served by both, and both now serving the last adapter exactly as peft does."""
    from masenvs.trainer.run.metrics import read_metrics

    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "learner/writer/loss" in r]
    assert len(rows) == 2 and not any(r["train/failed_tasks"] for r in rows)
    for row in rows:
        for agent in POLICIES:  # a server still on an older adapter would break this
            assert row[f"learner/{agent}/logprob_diff_mean"] < TOLERANCE, row

    versions: dict[str, set[int]] = {}
    for call in TraceStore(run_dir / "traces").calls():
        assert (call.backend, call.policy_version) == ("vllm", step_of(call.rollout_id) - 1)
        versions.setdefault(call.rollout_id, set()).add(call.policy_version)
    assert versions and all(len(v) == 1 for v in versions.values())  # no rollout mixes

    syncs = {(p, f"v{v:06d}") for p in POLICIES for v in range(3)}
    for url in engines.urls:
        assert {(name, v) for u, name, v in engines.loads[since:] if u == url} == syncs, url

    report = json.loads((run_dir / "engines.json").read_text())
    assert report["version"] == 2
    assert len(report["engines"]) == 2 and all(e["served"] for e in report["engines"].values())

    one, two = on_each(engines.urls, "writer")
    assert same_answer(one, two)
    (completion,) = one.completions
    adapter = run_dir / "sync" / "writer" / "v000002"
    ref = reference(engines.model, one.prompt_token_ids, completion.token_ids, adapter)
    assert completion.logprobs == pytest.approx(ref, abs=TOLERANCE)
    base = reference(engines.model, one.prompt_token_ids, completion.token_ids)
    assert differs(base, completion.logprobs) > 2 * TOLERANCE  # trained, not the base


def test_the_trainer_starts_two_vllm_servers_and_trains_on_both(engines: Engines) -> None:
    check_trained_on_both(engines, engines.run_dir, since=0)
    # Both servers were started by the trainer, with LoRA, each logging on its own.
    assert len(set(engines.urls)) == 2
    assert [e.name for e in engines.pool.engines] == list(ENGINES)
    for name in ENGINES:
        assert "'enable_lora': True" in (engines.run_dir / f"{name}.log").read_text()
    # Each rollout's calls went to one server; rollouts went to both.
    homes: dict[str, set[str]] = {}
    for rollout, engine in engines.pool.history:
        if rollout is not None:
            homes.setdefault(rollout, set()).add(engine)
    assert all(len(home) == 1 for home in homes.values()), homes
    assert set().union(*homes.values()) == set(ENGINES)
    assert sorted(engines.stopped) == sorted(engines.urls)  # the trainer stops what it started


def test_an_adapter_update_reaches_both_servers_and_calls_record_their_version(
    engines: Engines, tmp_path: Path
) -> None:
    first, second = (make_adapter(engines.model, tmp_path / f"a{s}", s) for s in (1, 2))
    backends = [VLLMBackend(url, timeout=300) for url in engines.urls]
    pool = EnginePool(backends, names=list(ENGINES), update_timeout=300)
    base = greedy(pool, "")

    async def update(version: int, adapter: Path) -> None:
        async with pool.updating(version):
            await pool.load_adapter("probe", str(adapter))

    try:
        run(update(1, first))
        one, two = on_each(engines.urls, "probe")
        assert same_answer(one, two)  # both servers serve the first adapter
        prompt, ids_a = one.prompt_token_ids, one.completions[0].token_ids
        lp_a = one.completions[0].logprobs
        assert lp_a == pytest.approx(reference(engines.model, prompt, ids_a, first), abs=TOLERANCE)
        assert not same_answer(one, base)
        during = greedy(pool, "probe", affinity="old")
        assert during.policy_version == 1 and same_answer(during, one)

        pool.end_rollouts()
        run(update(2, second))  # the same name: replaced in place on both
        one, two = on_each(engines.urls, "probe")
        assert same_answer(one, two)
        ids_b, lp_b = one.completions[0].token_ids, one.completions[0].logprobs
        assert lp_b == pytest.approx(reference(engines.model, prompt, ids_b, second), abs=TOLERANCE)
        assert differs(lp_b, reference(engines.model, prompt, ids_b, first)) > 5 * TOLERANCE

        # Four rollouts at once, three calls each: a rollout stays on one server, new
        # rollouts spread over both, and every call reports the version it ran under.
        pool.history.clear()

        async def rollout(name: str) -> list[Generation]:
            params = SamplingParams(max_tokens=6, temperature=1.0, seed=0)
            request = GenerateRequest("probe", params, messages=HELLO, affinity=name)
            return [await pool.generate(request) for _ in range(3)]

        async def rollouts() -> list[list[Generation]]:
            try:
                return await asyncio.gather(*(rollout(f"r{k}") for k in range(4)))
            finally:
                await pool.close()

        calls = [g for gens in run(rollouts()) for g in gens]
        assert [g.policy_version for g in calls] == [2] * 12
        homes = {f"r{k}": {e for a, e in pool.history if a == f"r{k}"} for k in range(4)}
        assert all(len(home) == 1 for home in homes.values()), homes
        assert set().union(*homes.values()) == set(ENGINES)
        assert {pool.pinned(r) for r in homes} == set(ENGINES)
    finally:
        for backend in backends:
            if "probe" in backend.model_names():
                run(backend.unload_adapter("probe"))
            run(backend.close())


def test_a_run_given_the_servers_by_url_trains_on_both_and_leaves_them_running(
    engines: Engines, tmp_path: Path
) -> None:
    from masenvs.trainer.run.train import train

    since = len(engines.loads)
    cfg = toy_config(tmp_path, engines.model, 2)
    cfg.distributed.engines.urls = list(engines.urls)
    assert train(cfg).steps == 2
    check_trained_on_both(engines, tmp_path, since)
    for url in engines.urls:  # servers given by URL are the user's: they keep running
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200
