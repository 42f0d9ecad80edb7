"""A pool of engines behind the capture endpoint: two `masenvs serve --engine` subprocesses
on the tiny model, driven like vLLM servers, reached with the official openai client."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch
from tiny_runs import plan_path_run

from masenvs.adapters.backends.launch import launch_engine_server
from masenvs.adapters.backends.pool import EnginePool
from masenvs.adapters.backends.vllm import VLLMBackend
from masenvs.adapters.stack import Stack, start_stack
from masenvs.engine.loading import load_model, load_tokenizer
from masenvs.engine.protocol import BackendError, GenerateRequest, SamplingParams
from masenvs.traces import TraceStore

ENGINE = {"dtype": "float32", "quantize": "none", "max_batch_size": 8, "threads": 1}
CHAT = [{"role": "user", "content": "Which way to the goal?"}]


def start_engine(log_dir: Path, name: str) -> VLLMBackend:
    server = launch_engine_server("tiny", log_path=log_dir / f"{name}.log", **ENGINE)
    return VLLMBackend(server.url, tokenizer=load_tokenizer("tiny"), timeout=60.0, process=server)


def make_adapter(directory: Path, seed: int) -> Path:
    """A peft LoRA adapter for the tiny model whose B matrices are not zero."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    model = get_peft_model(load_model("tiny").model, config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EnginePool]:
    logs = tmp_path_factory.mktemp("engines")
    names = ["engine-0", "engine-1"]
    started: dict[int, VLLMBackend] = {}
    load_tokenizer("tiny")  # imports transformers once, before two threads would at once

    def start(i: int) -> None:
        started[i] = start_engine(logs, names[i])

    threads = [threading.Thread(target=start, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    pool = None
    try:
        assert len(started) == 2, f"an engine server did not start; see the logs in {logs}"
        pool = EnginePool(
            [started[0], started[1]],
            restart=[lambda n=n: start_engine(logs, f"{n}-restarted") for n in names],
            names=names,
            update_timeout=60.0,
        )
        yield pool
    finally:
        for backend in started.values():
            backend.shutdown()
        if pool is not None:
            pool.shutdown()  # also the engines it restarted


@pytest.fixture(scope="module")
def stack(pool: EnginePool, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = start_stack(backend=pool, traces=tmp_path_factory.mktemp("traces"))
    yield stack
    stack.server.stop()
    stack.store.close()


def client(stack: Stack, rollout: str | None = None) -> openai.OpenAI:
    url = stack.server.rollout_url(rollout) if rollout else stack.base_url
    return openai.OpenAI(base_url=url, api_key="-", max_retries=0, timeout=60)


def chat(stack: Stack, rollout: str | None, model: str = "tiny", seed: int = 0) -> dict:
    response = client(stack, rollout).chat.completions.create(
        model=model,
        messages=CHAT,
        max_tokens=6,
        seed=seed,
        logprobs=True,
        extra_body={"return_token_ids": True},
    )
    choice = response.choices[0]
    return {
        "ids": choice.model_extra["token_ids"],
        "logprobs": [t.logprob for t in choice.logprobs.content],
    }


def run_threads(calls: list) -> list:
    results: list = [None] * len(calls)

    def run(i: int) -> None:
        results[i] = calls[i]()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def engines_of(pool: EnginePool, rollout: str) -> set[str]:
    return {engine for affinity, engine in pool.history if affinity == rollout}


def test_a_rollout_stays_on_one_engine_and_rollouts_spread(pool, stack) -> None:
    pool.affinity = "rollout"
    pool.history.clear()
    rollouts = [f"aff-{k}" for k in range(4)]

    def rollout(name: str) -> None:
        for turn in range(3):
            chat(stack, name, seed=turn)

    run_threads([lambda r=r: rollout(r) for r in rollouts])
    homes = [engines_of(pool, r) for r in rollouts]
    assert all(len(home) == 1 for home in homes), homes  # every call on its rollout's engine
    assert set().union(*homes) == {"engine-0", "engine-1"}  # new rollouts spread over both
    assert pool.pinned("aff-0") in {"engine-0", "engine-1"}
    stack.endpoint.end_rollout("aff-0")
    assert pool.pinned("aff-0") is None  # the endpoint unpins an ended rollout


def test_least_loaded_spreads_one_rollouts_calls(pool, stack) -> None:
    pool.affinity = "least_loaded"
    try:
        pool.history.clear()
        run_threads([lambda k=k: chat(stack, "spread", seed=k) for k in range(6)])
        served = [engine for _, engine in pool.history]
        assert sorted(set(served)) == ["engine-0", "engine-1"]
        assert abs(served.count("engine-0") - served.count("engine-1")) <= 2
    finally:
        pool.affinity = "rollout"


def test_same_seed_gives_the_same_sample_on_either_engine(pool, stack) -> None:
    pool.affinity = "least_loaded"
    try:
        pool.history.clear()
        a, b = chat(stack, None, seed=7), chat(stack, None, seed=7)
        assert [e for _, e in pool.history] == ["engine-0", "engine-1"] or [
            e for _, e in pool.history
        ] == ["engine-1", "engine-0"]
        assert a["ids"] == b["ids"]
        assert a["logprobs"] == pytest.approx(b["logprobs"], abs=1e-5)
    finally:
        pool.affinity = "rollout"


def test_a_streamed_call_matches_the_whole_one(pool, stack) -> None:
    whole = chat(stack, "streamed", seed=11)
    events = client(stack, "streamed").chat.completions.create(
        model="tiny",
        messages=CHAT,
        max_tokens=6,
        seed=11,
        stream=True,
        extra_body={"return_token_ids": True},
    )
    ids = [i for event in events for c in event.choices for i in c.model_extra["token_ids"]]
    assert ids == whole["ids"]
    assert len(engines_of(pool, "streamed")) == 1  # both calls on the rollout's engine


def test_an_adapter_update_reaches_both_engines(pool, stack, tmp_path: Path) -> None:
    base = chat(stack, None, seed=3)
    pool.end_rollouts()  # the earlier tests' rollouts are over: the update need not wait
    first = make_adapter(tmp_path / "v1", seed=1)
    asyncio.run(pool.load_adapter("tool", str(first)))
    second = make_adapter(tmp_path / "v2", seed=2)
    asyncio.run(pool.load_adapter("tool", str(second)))  # replaced in place, on both
    params = SamplingParams(max_tokens=6, seed=3)

    async def on_each() -> list:
        out = []
        for engine in pool.engines:
            assert "tool" in engine.backend.model_names()
            request = GenerateRequest("tool", params, messages=CHAT)
            out.append((await engine.backend.generate(request)).completions[0])
            await engine.backend.close()
        return out

    one, two = asyncio.run(on_each())
    assert one.token_ids == two.token_ids
    assert one.logprobs == pytest.approx(two.logprobs, abs=1e-5)
    tuned = chat(stack, None, model="tool", seed=3)
    assert tuned["ids"] == one.token_ids  # through the endpoint: the same adapter
    assert tuned["logprobs"] != pytest.approx(base["logprobs"], abs=1e-3)  # not the base


def test_no_rollout_straddles_an_update_and_versions_are_recorded(pool, stack) -> None:
    pool.end_rollouts()
    chat(stack, "old")  # a running rollout, under the version it started with
    started = pool.version

    async def update() -> None:
        async with pool.updating(started + 1):
            pass

    updater = threading.Thread(target=lambda: asyncio.run(update()))
    updater.start()
    time.sleep(0.3)
    assert updater.is_alive()  # it waits for the running rollout
    late: list = []
    newcomer = threading.Thread(target=lambda: late.append(chat(stack, "new")))
    newcomer.start()
    time.sleep(0.3)
    assert not late  # a new rollout waits while the update is pending
    chat(stack, "old")  # the running rollout goes on under its version
    stack.endpoint.end_rollout("old")
    updater.join(30)
    newcomer.join(30)
    assert not updater.is_alive() and late
    versions = {}
    for record in stack.store.calls():
        if record.rollout_id in ("old", "new"):
            versions.setdefault(record.rollout_id, set()).add(record.policy_version)
    assert versions == {"old": {started}, "new": {started + 1}}


def test_allow_mixed_versions_lets_an_update_pass_a_running_rollout(pool, stack) -> None:
    pool.end_rollouts()
    chat(stack, "mixed")
    version = pool.version
    pool.allow_mixed_versions = True
    try:

        async def update() -> None:
            async with pool.updating(version + 1):
                pass

        asyncio.run(asyncio.wait_for(update(), 10))  # does not wait for "mixed" to end
        chat(stack, "mixed")
    finally:
        pool.allow_mixed_versions = False
    recorded = [r.policy_version for r in stack.store.calls("mixed")]
    assert recorded == [version, version + 1]  # each call records the version it ran under


def test_full_weights_reach_both_engines(pool, stack, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    before = chat(stack, None, seed=5)
    state = load_model("tiny").model.state_dict()
    torch.manual_seed(0)
    name = "model.layers.0.mlp.down_proj.weight"
    save_file(
        {name: state[name] + 0.5 * torch.randn_like(state[name])}, str(tmp_path / "w.safetensors")
    )
    pool.end_rollouts()
    asyncio.run(pool.update_weights(tmp_path))
    pool.affinity = "least_loaded"
    try:
        pool.history.clear()
        after = [chat(stack, None, seed=5) for _ in range(2)]
        assert {e for _, e in pool.history} == {"engine-0", "engine-1"}
        assert after[0]["ids"] == after[1]["ids"]
        assert after[0]["logprobs"] == pytest.approx(after[1]["logprobs"], abs=1e-5)
        assert after[0]["logprobs"] != pytest.approx(before["logprobs"], abs=1e-3)
    finally:
        pool.affinity = "rollout"


def test_a_killed_engine_is_restarted_and_calls_go_on(pool, stack) -> None:
    pool.affinity = "rollout"
    pool.end_rollouts()
    pool.history.clear()
    chat(stack, "victim")
    victim = next(e for e in pool.engines if e.name == pool.pinned("victim"))
    os.killpg(victim.backend.process.process.pid, signal.SIGKILL)
    victim.backend.process.process.wait()
    after = chat(stack, "victim", model="tool", seed=3)  # retried on the other engine
    assert victim.restarts == 1
    assert len(engines_of(pool, "victim")) == 2
    deadline = time.monotonic() + 120
    while victim.state != "up" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert victim.state == "up"
    assert "tool" in victim.backend.model_names()  # the adapter was loaded again
    pool.affinity = "least_loaded"
    try:
        pool.history.clear()
        again = [chat(stack, None, model="tool", seed=3) for _ in range(2)]
        assert {e for _, e in pool.history} == {"engine-0", "engine-1"}
        assert again[0]["ids"] == again[1]["ids"] == after["ids"]
    finally:
        pool.affinity = "rollout"


def test_an_engine_given_by_url_that_dies_stops_with_a_clear_error(tmp_path: Path) -> None:
    engine = start_engine(tmp_path, "by-url")
    server, engine.process = engine.process, None  # as if the user had started it
    pool = EnginePool([engine], names=["engine-0"])
    stack = start_stack(backend=pool)
    try:
        chat(stack, "r")
        server.stop()
        with pytest.raises(openai.APIStatusError) as failed:
            chat(stack, "r")
        assert failed.value.status_code == 503
        assert server.url in str(failed.value) and "given by URL" in str(failed.value)
        with pytest.raises(BackendError, match="given by URL"):
            asyncio.run(pool.load_adapter("tool", str(tmp_path)))  # updates stop too
    finally:
        stack.server.stop()
        server.stop()


# -- the trainer on a pool of engines ------------------------------------------------------------


def train_config(run_dir: Path, *overrides: str):
    from masenvs.trainer.config import load_config

    return load_config(
        None,
        [
            "model.name=tiny",
            "model.device=cpu",
            "lora.rank=4",
            "optim.warmup_steps=0",
            "optim.lr=1e-3",
            *plan_path_run(run_dir, "backend.quantize=none", *overrides),
        ],
    )


@pytest.mark.parametrize("finetune", ["lora", "full"])
def test_training_on_two_engines(tmp_path: Path, finetune: str) -> None:
    import json

    from rich.console import Console

    from masenvs.trainer.run.metrics import read_metrics
    from masenvs.trainer.run.train import train

    run = tmp_path / "run"
    cfg = train_config(run, "distributed.engines.count=2", f"policy.finetune={finetune}")
    train(cfg, console=Console(quiet=True))
    rows = [r for r in read_metrics(run / "metrics.jsonl") if "time/rollout_s" in r]
    assert len(rows) == 2
    # One pool per served model: with full fine-tuning each trained policy is one.
    reports = [json.loads(p.read_text()) for p in sorted(run.glob("engines*.json"))]
    assert len(reports) == (1 if finetune == "lora" else 2)
    for report in reports:
        served = [e["served"] for e in report["engines"].values()]
        assert len(served) == 2 and all(served), report  # both replicas sampled
        assert report["version"] == 2  # both updates went through the pool
    versions: dict[str, set[int]] = {}
    for record in TraceStore(run / "traces").calls():
        versions.setdefault(record.rollout_id, set()).add(record.policy_version)
    assert versions and all(len(v) == 1 for v in versions.values())  # no rollout mixes
    assert {v for vs in versions.values() for v in vs} == {0, 1}  # step 2 sampled version 1
    pushed = run / "sync" / ("full" if finetune == "full" else "")
    assert [p.name for p in pushed.glob("*/v*")]  # the weights went to the engines as files


def test_a_dead_engine_url_stops_the_run_at_start(tmp_path: Path) -> None:
    from rich.console import Console

    from masenvs.adapters.stack import StackError
    from masenvs.trainer.run.train import train

    cfg = train_config(tmp_path / "run", "distributed.engines.urls=[http://127.0.0.1:9]")
    with pytest.raises(StackError, match=r"distributed.engines.urls: Cannot reach .*127.0.0.1:9"):
        train(cfg, console=Console(quiet=True))
