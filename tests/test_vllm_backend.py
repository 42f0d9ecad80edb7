"""The vLLM backend against a stand-in server that speaks vLLM's protocol (no GPU here).

The stand-in (`fake_vllm.FakeVLLM`) fronts the tiny embedded engine, so every answer the
vLLM backend gives can be checked against the engine's own answer to the same request.
`scripts/check_vllm_gpu.sh` runs the same kind of checks against a real `vllm serve`.
"""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from fake_vllm import FakeVLLM

from masenvs.adapters.backends.launch import (
    VLLMLaunchError,
    check_cpu_model,
    find_vllm,
    launch_server,
    launch_vllm,
    model_dir,
)
from masenvs.adapters.backends.vllm import VLLMBackend
from masenvs.adapters.backends.vllm_protocol import ChoiceState as _Choice
from masenvs.adapters.backends.vllm_protocol import read_completion
from masenvs.adapters.endpoint import EndpointServer, create_app
from masenvs.engine.engine import EmbeddedBackend
from masenvs.engine.loading import load_model
from masenvs.engine.protocol import Backend, BackendError, GenerateRequest, SamplingParams
from masenvs.traces import TraceStore

HELLO = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def engine() -> Iterator[EmbeddedBackend]:
    backend = EmbeddedBackend.from_spec("tiny", max_model_len=512, dtype="float32")
    yield backend
    backend.shutdown()


@pytest.fixture(scope="module")
def fake(engine: EmbeddedBackend) -> Iterator[tuple[FakeVLLM, EndpointServer]]:
    path = model_dir("tiny")  # vLLM names the model by the directory it loaded
    app = FakeVLLM(engine, served_model=path, root=path)
    with EndpointServer(app) as server:
        yield app, server


@pytest.fixture(scope="module")
def vllm(fake) -> VLLMBackend:
    return VLLMBackend(fake[1].url)


def run(coro):
    return asyncio.run(coro)


def chat(model: str = "", messages=HELLO, **params) -> GenerateRequest:
    return GenerateRequest(model=model, params=SamplingParams(**params), messages=messages)


def assert_same(ours, theirs) -> None:
    assert ours.prompt_token_ids == theirs.prompt_token_ids
    for a, b in zip(ours.completions, theirs.completions, strict=True):
        assert (a.token_ids, a.text, a.finish_reason, a.stop_reason) == (
            b.token_ids,
            b.text,
            b.finish_reason,
            b.stop_reason,
        )
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
        # The engine's float results vary in the last bits with batch composition.
        assert (a.top_logprobs is None) == (b.top_logprobs is None)
        for top_a, top_b in zip(a.top_logprobs or [], b.top_logprobs or [], strict=True):
            assert top_a.keys() == top_b.keys()
            assert list(top_a.values()) == pytest.approx(list(top_b.values()), abs=1e-4)


def test_is_a_backend_with_the_engines_tokenizer(vllm: VLLMBackend, engine) -> None:
    assert isinstance(vllm, Backend)
    assert vllm.served_model == model_dir("tiny")
    assert vllm.tokenizer_id() == engine.tokenizer_id()  # ids are interchangeable
    assert vllm.model_names() == [model_dir("tiny")]


def test_chat_returns_vllms_ids_logprobs_and_top_alternatives(vllm, engine, fake) -> None:
    request = chat(max_tokens=12, seed=3, top_logprobs=3, n=2)
    ours, theirs = run(vllm.generate(request)), run(engine.generate(request))
    assert_same(ours, theirs)
    sent = fake[0].requests[-1]
    assert sent["return_token_ids"] and sent["logprobs"] and sent["return_tokens_as_token_ids"]
    assert sent["model"] == model_dir("tiny") and sent["top_logprobs"] == 3


def test_completions_with_text_and_token_prompts(vllm, engine) -> None:
    for prompt in ("Once upon a time", [1, 2, 3, 4, 5]):
        request = GenerateRequest(
            model="base",
            params=SamplingParams(max_tokens=8, seed=1, top_logprobs=2),
            prompt=prompt,
        )
        assert_same(run(vllm.generate(request)), run(engine.generate(request)))


def test_stream_adds_up_to_the_same_generation(vllm, engine) -> None:
    request = chat(max_tokens=16, seed=5, n=2)

    async def collect():
        return [event async for event in vllm.stream(request)]

    events = run(collect())
    final = events[-1]
    assert_same(final, run(engine.generate(request)))
    for index, completion in enumerate(final.completions):
        deltas = [e for e in events[:-1] if e.index == index]
        assert [t for d in deltas for t in d.token_ids] == completion.token_ids
        assert "".join(d.text for d in deltas) == completion.text
        assert [x for d in deltas for x in d.logprobs] == pytest.approx(completion.logprobs)
        assert [d.finish_reason for d in deltas][-1] == completion.finish_reason


def greedy_tokens(engine, max_tokens: int = 12) -> list[int]:
    return run(engine.generate(chat(max_tokens=max_tokens, temperature=0))).completions[0].token_ids


def test_a_stop_string_cuts_ids_and_text_like_the_engine(vllm, engine) -> None:
    ids = greedy_tokens(engine)
    text = engine.decode(ids)
    start = len(engine.decode(ids[:4]))
    stop = text[start + 1 : start + 3]
    assert stop and stop in text
    request = chat(max_tokens=12, temperature=0, stop=[stop])
    ours = run(vllm.generate(request))
    assert_same(ours, run(engine.generate(request)))
    (completion,) = ours.completions
    assert completion.stop_reason == stop and stop not in completion.text
    assert len(completion.token_ids) < len(ids)  # vLLM sent more ids; they were cut

    async def streamed():
        return [e async for e in vllm.stream(request)]

    events = run(streamed())
    assert "".join(e.text for e in events[:-1]) == completion.text
    assert [t for e in events[:-1] for t in e.token_ids] == completion.token_ids


def test_a_stop_token_stays_in_the_ids_but_not_the_text(vllm, engine) -> None:
    ids = greedy_tokens(engine)
    stop_id = ids[3]
    request = chat(max_tokens=12, temperature=0, stop_token_ids=[stop_id])
    ours = run(vllm.generate(request))
    assert_same(ours, run(engine.generate(request)))
    (completion,) = ours.completions
    assert completion.token_ids[-1] == stop_id == completion.stop_reason
    assert completion.text == engine.decode(completion.token_ids[:-1])


def test_eos_is_named_by_its_id_like_the_engine(vllm) -> None:
    eos = vllm.tokenizer.eos_token_id
    choice = _Choice([28, 29, eos], [-1.0, -2.0, -0.5], [{}, {}, {}])
    completion = read_completion(
        vllm.decode, frozenset([eos]), choice, "stop", None, SamplingParams()
    )
    assert completion.stop_reason == eos and completion.token_ids == [28, 29, eos]
    assert completion.text == vllm.decode([28, 29])


def make_adapter(directory: Path, seed: int) -> Path:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    model = get_peft_model(load_model("tiny").model, config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("vllm-adapters")
    return [make_adapter(root / f"a{seed}", seed) for seed in (1, 2)]


@pytest.mark.parametrize("inplace", [True, False], ids=["load_inplace", "old-vllm"])
def test_adapters_load_at_run_time_and_are_replaced(engine, adapter_dirs, inplace: bool) -> None:
    path = model_dir("tiny")
    app = FakeVLLM(engine, served_model=path, root=path, load_inplace=inplace)
    name = f"agent_{inplace}"
    with EndpointServer(app) as server:
        backend = VLLMBackend(server.url)
        base = run(backend.generate(chat(max_tokens=8, temperature=0))).completions[0].token_ids
        run(backend.load_adapter(name, str(adapter_dirs[0])))
        assert name in backend.model_names()
        first = run(backend.generate(chat(name, max_tokens=8, temperature=0)))
        assert first.completions[0].token_ids != base
        assert_same(first, run(engine.generate(chat(name, max_tokens=8, temperature=0))))
        run(backend.load_adapter(name, str(adapter_dirs[1])))  # new weights, same name
        second = run(backend.generate(chat(name, max_tokens=8, temperature=0)))
        assert second.completions[0].token_ids != first.completions[0].token_ids
        assert_same(second, run(engine.generate(chat(name, max_tokens=8, temperature=0))))
        run(backend.unload_adapter(name))
        assert name not in backend.model_names()
        with pytest.raises(BackendError) as caught:
            run(backend.generate(chat(name, max_tokens=2)))
        assert caught.value.status == 404


def test_errors_come_back_as_backend_errors(vllm, engine) -> None:
    with pytest.raises(BackendError) as caught:
        run(vllm.generate(chat("nope", max_tokens=2)))
    assert (caught.value.status, caught.value.code) == (404, "model_not_found")
    long = [{"role": "user", "content": "word " * 2000}]
    with pytest.raises(BackendError) as caught:
        run(vllm.generate(chat(messages=long, max_tokens=2)))
    assert (caught.value.status, caught.value.code) == (400, "context_length_exceeded")
    with pytest.raises(BackendError, match="Cannot reach vLLM"):
        VLLMBackend("http://127.0.0.1:9")
    path = model_dir("tiny")
    with EndpointServer(FakeVLLM(engine, path, runtime_lora=False, api_key="k")) as server:
        with pytest.raises(BackendError, match="API key"):
            VLLMBackend(server.url)
        backend = VLLMBackend(server.url, api_key="k")
        assert run(backend.generate(chat(max_tokens=2))).completions
        with pytest.raises(BackendError, match="VLLM_ALLOW_RUNTIME_LORA_UPDATING"):
            run(backend.load_adapter("x", "/nowhere"))


def test_the_endpoint_traces_vllm_calls_like_embedded_ones(vllm, fake, tmp_path) -> None:
    store = TraceStore(tmp_path)
    with EndpointServer(create_app(vllm, store=store)) as server:
        api = openai.OpenAI(base_url=server.rollout_url("r1"), api_key="-", max_retries=0)
        answer = api.chat.completions.create(
            model="planner", messages=HELLO, max_tokens=10, logprobs=True, seed=2
        )
        chunks = list(
            api.chat.completions.create(model="planner", messages=HELLO, max_tokens=10, stream=True)
        )
    first, second = store.calls()
    assert first.backend == "vllm" and first.tokenizer_id == vllm.tokenizer_id()
    assert answer.choices[0].message.content == first.choices[0].text
    assert [t.logprob for t in answer.choices[0].logprobs.content] == first.choices[0].logprobs
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == second.choices[0].text
    for record in (first, second):
        choice = record.choices[0]
        visible = choice.token_ids[:-1] if isinstance(choice.stop_reason, int) else choice.token_ids
        assert vllm.decode(visible) == choice.text
        assert (record.agent, record.model, record.rollout_id) == ("planner", "base", "r1")


@pytest.mark.parametrize("device", ["cuda", "cpu", None])
def test_seeds_reach_only_a_server_known_to_run_on_a_gpu(engine, device, caplog) -> None:
    """vLLM's CPU build dies on seeded requests whose prefill is chunked (docs/vllm.md):
    seeds go to a server whose /server_info says CUDA; others get none, logged once."""
    path = model_dir("tiny")
    app = FakeVLLM(engine, served_model=path, root=path, device=device)
    with EndpointServer(app) as server, caplog.at_level("WARNING"):
        backend = VLLMBackend(server.url)
        assert backend.honours_seed is (device == "cuda")
        for seed in (3, 4):
            run(backend.generate(chat(max_tokens=4, seed=seed)))
            assert app.requests[-1].get("seed") == (seed if device == "cuda" else None)
        run(backend.generate(chat(max_tokens=4)))  # unseeded: nothing to say
        told = [r for r in caplog.records if "per-request seeds" in r.getMessage()]
        assert len(told) == (0 if device == "cuda" else 1)
        if told:
            assert "docs/vllm.md" in told[0].getMessage()
        # Who knows better says so: a server masenvs started, or the caller.
        assert VLLMBackend(server.url, honours_seed=True).honours_seed is True


def test_masenvs_serve_fronts_a_running_vllm(fake, tmp_path) -> None:
    command = [
        sys.executable, "-m", "masenvs.adapters.serve", "--backend", "vllm",
        "--vllm-url", fake[1].url, "--port", "0", "--traces", str(tmp_path),
        "--unknown-agents", "base",  # 'planner' has no adapter: the base model answers
    ]  # fmt: skip
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert server.stdout is not None
        # The start-up lines (loading, warmed ...) come first, then the banner's URL line.
        seen = []
        for line in server.stdout:
            seen.append(line)
            if " at http://" in line:
                break
        first = seen[-1] if seen else ""
        assert "(vllm) at http://" in first, "".join(seen)
        url = first[first.index("http://") :].split()[0]
        api = openai.OpenAI(base_url=url, api_key="-", max_retries=0)
        answer = api.chat.completions.create(model="planner", messages=HELLO, max_tokens=4)
    finally:
        server.terminate()
        server.wait(30)
    (record,) = TraceStore(tmp_path).calls()
    assert record.id == answer.id and record.backend == "vllm"


def fake_vllm_executable(directory: Path, body: str | None = None) -> Path:
    script = directory / "vllm"
    fake = Path(__file__).with_name("fake_vllm.py")
    script.write_text(body or f'#!/bin/sh\nexec "{sys.executable}" "{fake}" "$@"\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def test_launch_vllm_starts_waits_for_health_and_stops(tmp_path, adapter_dirs, monkeypatch) -> None:
    monkeypatch.delenv("MASENVS_VLLM_PYTHON", raising=False)  # it would win over the BIN
    monkeypatch.setenv("MASENVS_VLLM_BIN", str(fake_vllm_executable(tmp_path)))
    with launch_vllm(
        "tiny", lora_modules={"static": str(adapter_dirs[0])}, max_lora_rank=12, timeout=120
    ) as server:
        backend = VLLMBackend(server.url)
        assert set(backend.model_names()) == {model_dir("tiny"), "static"}
        assert "--enable-lora" in server.command
        rank = server.command.index("--max-lora-rank")
        assert server.command[rank + 1] == "16"  # the smallest rank vLLM accepts that fits
        assert run(backend.generate(chat("static", max_tokens=3))).completions[0].token_ids
        run(backend.load_adapter("runtime", str(adapter_dirs[1])))  # runtime updates are on
        assert "runtime" in backend.model_names()
    assert server.process.poll() is not None


def test_launch_vllm_explains_a_missing_or_dying_vllm(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("MASENVS_VLLM_BIN", raising=False)
    monkeypatch.delenv("MASENVS_VLLM_PYTHON", raising=False)
    monkeypatch.setenv("MASENVS_VLLM_ENV", str(tmp_path / "no-cpu-build"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(VLLMLaunchError, match="scripts/vllm_cpu_env.sh") as caught:
        launch_vllm("tiny")
    assert "MASENVS_VLLM_PYTHON" in str(caught.value)
    monkeypatch.setenv("MASENVS_VLLM_PYTHON", str(tmp_path / "missing" / "python"))
    with pytest.raises(VLLMLaunchError, match="does not exist"):
        launch_vllm("tiny")
    monkeypatch.delenv("MASENVS_VLLM_PYTHON")
    monkeypatch.setenv("MASENVS_VLLM_BIN", str(tmp_path / "missing" / "vllm"))
    with pytest.raises(VLLMLaunchError, match="does not exist"):
        launch_vllm("tiny")
    dying = fake_vllm_executable(
        tmp_path, "#!/bin/sh\necho 'RuntimeError: No CUDA GPUs are available' >&2\nexit 3\n"
    )
    monkeypatch.setenv("MASENVS_VLLM_BIN", str(dying))
    with pytest.raises(VLLMLaunchError, match="No CUDA GPUs") as caught:
        launch_vllm("tiny", timeout=30)
    assert "status 3" in str(caught.value)
    assert os.environ["MASENVS_VLLM_BIN"] == str(dying)


def executable(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def test_find_vllm_looks_where_the_config_says_in_order(tmp_path, monkeypatch) -> None:
    env_python = executable(tmp_path / "envpy" / "bin" / "python")
    env_bin = executable(tmp_path / "envbin" / "bin" / "vllm")
    cpu_python = executable(tmp_path / "cpu" / "bin" / "python")
    on_path = executable(tmp_path / "path" / "vllm")
    monkeypatch.setenv("PATH", str(on_path.parent))
    monkeypatch.setenv("MASENVS_VLLM_ENV", str(tmp_path / "cpu"))
    monkeypatch.setenv("MASENVS_VLLM_PYTHON", str(env_python))
    monkeypatch.setenv("MASENVS_VLLM_BIN", str(env_bin))
    api_server = ["-m", "vllm.entrypoints.openai.api_server", "--model", "M"]
    assert find_vllm().command("M") == [str(env_python), *api_server]
    monkeypatch.delenv("MASENVS_VLLM_PYTHON")
    assert find_vllm().command("M") == [str(env_bin), "serve", "M"]
    monkeypatch.delenv("MASENVS_VLLM_BIN")
    assert find_vllm().command("M")[0] == str(on_path)  # the CPU env is not complete yet
    (tmp_path / "cpu" / ".complete").touch()  # scripts/vllm_cpu_env.sh finished building it
    assert find_vllm().command("M") == [str(cpu_python), *api_server]
    explicit = find_vllm(python=str(env_python))
    assert explicit.prefix[0] == str(env_python) and explicit.origin == "python="


def test_launch_on_a_cpu_machine_adds_what_the_cpu_build_needs(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("MASENVS_VLLM_PYTHON", raising=False)
    monkeypatch.setenv("MASENVS_VLLM_BIN", str(fake_vllm_executable(tmp_path)))
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    with launch_vllm("tiny", cpu=True, timeout=120) as server:
        flags = server.command
        assert flags[flags.index("--dtype") + 1] == "bfloat16"
        assert flags[flags.index("--max-model-len") + 1] == "2048"
        environ = Path(f"/proc/{server.process.pid}/environ").read_bytes().split(b"\0")
        assert b"VLLM_CPU_KVCACHE_SPACE=2" in environ
    mine = ["--dtype=float32", "--max-model-len", "4096"]
    with launch_vllm("tiny", cpu=True, extra_args=mine, timeout=120) as server:
        assert server.command.count("--max-model-len") == 1 and "bfloat16" not in server.command
        assert server.command[-3:] == mine
    with launch_vllm("tiny", cpu=False, timeout=120) as server:
        assert "--dtype" not in server.command


def test_a_server_that_never_answers_times_out_with_a_clear_error() -> None:
    import socket

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()  # accepts connections, never answers
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        with pytest.raises(BackendError, match=r"did not answer within 1 s") as caught:
            VLLMBackend(url, timeout=1)
    assert "backend.request_timeout" in str(caught.value) and caught.value.status == 504


def test_a_model_the_cpu_build_cannot_run_fails_before_launch() -> None:
    # vLLM's CPU attention has no kernel for head_dim 16; the server would die at its first
    # request, after a minute of starting up.
    with pytest.raises(VLLMLaunchError, match="head_dim 16"):
        check_cpu_model(model_dir("tiny"))


def test_masenvs_train_names_an_unreachable_vllm_in_one_line(tmp_path, capsys) -> None:
    from masenvs.trainer.commands.train import main

    config = tmp_path / "run.yaml"
    config.write_text(f"run_dir: {tmp_path / 'run'}\nsteps: 1\nmodel: {{name: tiny}}\n")
    code = main(
        [str(config), "--set", "backend.kind=vllm", "--set", "backend.vllm_url=http://127.0.0.1:9"]
    )
    out = capsys.readouterr().out
    assert code == 2 and "Cannot reach vLLM at http://127.0.0.1:9" in out
    assert "Traceback" not in out


def test_a_vllm_url_mapping_serves_each_policy_from_its_own_server(tmp_path) -> None:
    from masenvs.adapters.stack import StackError
    from masenvs.trainer.config import load_config
    from masenvs.trainer.run.train import train

    overrides = [
        f"run_dir={tmp_path / 'run'}",
        "model.name=tiny",
        "model.device=cpu",
        "lora.rank=4",
        "steps=1",
        "env.name=plan_path",
        "env.options={size: 4}",
        "rollout.branches=2",
        "rollout.tasks_per_step=1",
        "rollout.max_rounds=1",
        "rollout.max_tokens=6",
        "validation.every=0",
        "logging.tensorboard=false",
        "backend.kind=vllm",
        "policy.mode=separate",
    ]
    path = model_dir("tiny")
    engines = [EmbeddedBackend.from_spec("tiny", max_model_len=512, dtype="float32") for _ in "ab"]
    apps = [FakeVLLM(engine, served_model=path, root=path) for engine in engines]
    try:
        with EndpointServer(apps[0]) as tool_server, EndpointServer(apps[1]) as plan_server:
            cfg = load_config(None, overrides)
            cfg.backend.vllm_url = {"tool": tool_server.url}
            with pytest.raises(StackError, match=r"no server for policy 'plan'.*add `plan: <url>`"):
                train(cfg)
            cfg.backend.vllm_url = {"tool": tool_server.url, "plan": plan_server.url}
            train(cfg)
    finally:
        for engine in engines:
            engine.shutdown()
    # Each policy's adapter was pushed to, and its requests answered by, its own server.
    for app, policy in zip(apps, ("tool", "plan"), strict=True):
        assert set(app.lora_paths) == {policy}
        assert app.requests and {r["model"] for r in app.requests} == {policy}
    calls = list(TraceStore(tmp_path / "run" / "traces").calls())
    assert {c.agent for c in calls} == {"tool", "plan"} and {c.backend for c in calls} == {"vllm"}


def test_the_servers_a_run_needs_and_a_vllm_url_that_does_not_cover_them() -> None:
    from masenvs.adapters.stack import StackError
    from masenvs.trainer.config import TrainConfig
    from masenvs.trainer.inference.plan import inference_plan

    agents = ["plan", "tool", "critic"]

    def plan(**sections):
        cfg = TrainConfig(model={"name": "tiny"}, agents={"critic": {"freeze": True}}, **sections)
        return inference_plan(cfg, agents, "cpu")

    # LoRA: every adapter on its base's one server. Full: one per trained policy, and the
    # frozen one keeps the base's weights on a server of its own.
    lora = plan(backend={"kind": "vllm"})
    assert [s.policies for s in lora.served] == [["plan", "tool", "critic"]]
    full = plan(policy={"finetune": "full"}, backend={"kind": "vllm"})
    assert [s.policies for s in full.served] == [["plan"], ["tool"], ["critic"]]

    with pytest.raises(StackError, match=r"need 3 .*give a mapping"):
        plan(policy={"finetune": "full"}, backend={"kind": "vllm", "vllm_url": "http://h:9"})
    urls = {"plan": "http://127.0.0.1:9", "tiny": "http://127.0.0.1:10"}
    with pytest.raises(StackError, match=r"\['tool'\] and 'critic' .* its own URL"):
        plan(policy={"finetune": "full"}, backend={"kind": "vllm", "vllm_url": urls})


def test_when_one_of_several_servers_cannot_start_the_others_stop(tmp_path, monkeypatch) -> None:
    from masenvs.adapters.stack import StackError
    from masenvs.trainer.config import TrainConfig
    from masenvs.trainer.inference import engines
    from masenvs.trainer.inference.plan import inference_plan

    broken = tmp_path / "broken-base"
    broken.mkdir()
    fake = Path(__file__).with_name("fake_vllm.py")
    body = (  # `vllm serve MODEL ...`: the broken base dies the way vLLM does, the other serves
        f'#!/bin/sh\ncase "$2" in *broken*) echo "ValueError: no config.json in $2" >&2; '
        f'exit 1;; esac\nexec "{sys.executable}" "{fake}" "$@"\n'
    )
    monkeypatch.delenv("MASENVS_VLLM_PYTHON", raising=False)
    monkeypatch.setenv("MASENVS_VLLM_BIN", str(fake_vllm_executable(tmp_path, body)))
    monkeypatch.setattr(engines, "cpu_only", lambda: False)  # the stand-in serves "tiny" anyway
    monkeypatch.setattr(engines, "_gpu_count", lambda: 0)  # two servers share one GPU
    launched: list[VLLMBackend] = []
    launch = engines.VLLMBackend.launch

    def spy(*args: Any, **kwargs: Any) -> VLLMBackend:
        launched.append(launch(*args, **kwargs))
        return launched[-1]

    monkeypatch.setattr(engines.VLLMBackend, "launch", spy)
    cfg = TrainConfig(
        model={"name": "tiny"},
        policy={"mode": "separate", "models": {"tool": str(broken)}},
        backend={"kind": "vllm", "request_timeout": 60},
    )
    plan = inference_plan(cfg, ["plan", "tool"], "cpu")
    with pytest.raises(StackError, match=r"(?s)broken-base \(policies tool\).*no config.json"):
        engines.open_inference(plan, tmp_path)
    (started,) = launched  # the healthy server came up, and was stopped again
    assert started.process is not None and started.process.process.poll() is not None
    assert "--gpu-memory-utilization" in started.process.command  # 0.45 each, on a GPU
    assert sorted(p.name for p in tmp_path.glob("vllm-*.log")) == ["vllm-plan.log", "vllm-tool.log"]


def test_a_server_that_dies_or_never_answers_is_a_clear_error_and_is_stopped(
    tmp_path: Path,
) -> None:
    log = tmp_path / "server.log"
    dies = [sys.executable, "-c", "print('bad flag --foo'); raise SystemExit(3)"]
    with pytest.raises(VLLMLaunchError, match=r"(?s)Engine X exited with status 3.*bad flag"):
        launch_server(dies, dict(os.environ), log, "http://127.0.0.1:9", 30, "Engine X")
    silent = [sys.executable, "-c", "import time; time.sleep(60)"]
    started = time.monotonic()
    with pytest.raises(VLLMLaunchError, match="Engine Y was not healthy after 1 s"):
        launch_server(silent, dict(os.environ), log, "http://127.0.0.1:9", 1, "Engine Y")
    assert time.monotonic() - started < 20
    survivors = subprocess.run(["pgrep", "-f", "time.sleep\\(60\\)"], capture_output=True)
    assert survivors.stdout.strip() == b""  # the half-started server was stopped
