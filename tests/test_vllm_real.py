"""The vLLM backend, weight sync and training against a real vLLM server.

On a machine without a GPU this is vLLM's CPU build (`scripts/vllm_cpu_env.sh` builds its
env; `find_vllm` finds it). One server serves the whole module, so the order of the tests
below matters only in that each leaves the server as it found it. Locally the module skips
when no vLLM is installed; in CI (`CI=true`) a missing vLLM is a failure.

The model is a tiny random Llama like `"tiny"` but with head_dim 32: vLLM's CPU attention
has no kernel for the 16 of `"tiny"`. References are transformers (and peft) in float32;
vLLM serves bfloat16, hence the tolerance.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from masenvs.adapters.backends.launch import (
    VLLMInstall,
    VLLMLaunchError,
    VLLMProcess,
    find_vllm,
    launch_vllm,
)
from masenvs.adapters.backends.vllm import VLLMBackend
from masenvs.engine.protocol import GenerateRequest, SamplingParams
from masenvs.env import EpisodeState, MASEnv, RewardParts
from masenvs.registry import register
from masenvs.traces import TraceStore
from masenvs.trainer.learner.learner import Learner

pytestmark = pytest.mark.vllm

TOLERANCE = 0.05  # nats between vLLM's bfloat16 and the float32 reference
HELLO = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="session")
def install() -> VLLMInstall:
    try:
        return find_vllm()
    except VLLMLaunchError as exc:
        if os.environ.get("CI", "").lower() in ("true", "1"):
            pytest.fail(f"CI runs the vllm tests against a real vLLM and found none: {exc}")
        pytest.skip(f"no vLLM here ({exc})")


def tiny_llama(out: Path, seed: int) -> Path:
    """A tiny random Llama with SmolLM2's tokenizer that vLLM's CPU build can serve."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from masenvs.engine.loading import TINY_CONFIG, load_tokenizer

    tokenizer = load_tokenizer("tiny")
    shape = {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32}
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **{**TINY_CONFIG, **shape},
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def model(tmp_path_factory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("tiny-vllm"), seed=0)


@pytest.fixture(scope="session")
def server(install: VLLMInstall, model: Path, tmp_path_factory) -> Iterator[VLLMProcess]:
    log = tmp_path_factory.mktemp("vllm-log") / "vllm.log"
    python = install.prefix[0] if install.model_flag else None
    vllm_bin = None if install.model_flag else install.prefix[0]
    process = launch_vllm(
        str(model),
        python=python,
        vllm_bin=vllm_bin,
        max_loras=4,
        max_lora_rank=16,
        weight_updates=True,
        timeout=600,
        log_path=log,
    )
    with process:
        yield process


@pytest.fixture(scope="session")
def backend(server: VLLMProcess) -> VLLMBackend:
    return VLLMBackend(server.url, timeout=300)


def run(coro):
    return asyncio.run(coro)


def chat(model: str = "", **params: Any) -> GenerateRequest:
    return GenerateRequest(model=model, params=SamplingParams(**params), messages=HELLO)


def reference(
    model_dir: Path, prompt: list[int], ids: list[int], adapter: Path | None = None
) -> list[float]:
    """Log-probabilities of `ids` after `prompt` under transformers (+ peft) in float32."""
    from transformers import AutoModelForCausalLM

    net = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        net = PeftModel.from_pretrained(net, adapter)
    with torch.no_grad():
        logits = net(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1]
    logprobs = torch.log_softmax(logits.float(), -1)
    return logprobs.gather(-1, torch.tensor(ids)[:, None])[:, 0].tolist()


def served(backend: VLLMBackend, name: str = "", max_tokens: int = 10):
    """Greedy tokens, their logprobs and the prompt ids from the server."""
    generation = run(backend.generate(chat(name, max_tokens=max_tokens, temperature=0)))
    (completion,) = generation.completions
    return generation.prompt_token_ids, completion.token_ids, completion.logprobs


def running(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie waiting to be reaped."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def differs(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


# -- parity --------------------------------------------------------------------------------


def test_chat_ids_and_logprobs_match_transformers(backend, model) -> None:
    generation = run(backend.generate(chat(max_tokens=12, temperature=0, top_logprobs=3)))
    (completion,) = generation.completions
    expected_prompt = backend.tokenizer.apply_chat_template(
        HELLO, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert generation.prompt_token_ids == list(expected_prompt)
    assert len(completion.token_ids) == len(completion.logprobs) > 0
    ref = reference(model, generation.prompt_token_ids, completion.token_ids)
    assert completion.logprobs == pytest.approx(ref, abs=TOLERANCE)
    for token, top in zip(completion.token_ids, completion.top_logprobs or [], strict=True):
        assert len(top) == 3 and token in top  # greedy: the chosen token is among the top
    visible = (
        completion.token_ids[:-1] if completion.stop_reason is not None else completion.token_ids
    )
    assert completion.text == backend.decode(visible)


def test_token_prompts_and_streaming_agree_with_the_same_request(backend, model) -> None:
    prompt = [1, 504, 3303, 282, 253, 655]
    request = GenerateRequest(
        model="", params=SamplingParams(max_tokens=8, temperature=0), prompt=prompt
    )
    generation = run(backend.generate(request))
    (completion,) = generation.completions
    assert generation.prompt_token_ids == prompt
    assert completion.logprobs == pytest.approx(
        reference(model, prompt, completion.token_ids), abs=TOLERANCE
    )

    async def stream():
        return [event async for event in backend.stream(request)]

    final = run(stream())[-1]
    assert final.completions[0].token_ids == completion.token_ids


# -- LoRA ------------------------------------------------------------------------------------


def make_adapter(model_dir: Path, out: Path, seed: int) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    net = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"])
    peft_model = get_peft_model(net, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    peft_model.save_pretrained(out)
    return out


def test_lora_is_loaded_and_replaced_in_place_as_peft_predicts(backend, model, tmp_path) -> None:
    first, second = (make_adapter(model, tmp_path / f"a{s}", s) for s in (1, 2))
    prompt, base_ids, base_lp = served(backend)
    run(backend.load_adapter("agent", str(first)))
    try:
        assert "agent" in backend.model_names()
        _, ids_a, lp_a = served(backend, "agent")
        assert lp_a == pytest.approx(reference(model, prompt, ids_a, first), abs=TOLERANCE)
        assert ids_a != base_ids  # the adapter changes the answer
        run(backend.load_adapter("agent", str(second)))  # same name: load_inplace
        _, ids_b, lp_b = served(backend, "agent")
        assert lp_b == pytest.approx(reference(model, prompt, ids_b, second), abs=TOLERANCE)
        stale = reference(model, prompt, ids_b, first)
        assert differs(lp_b, stale) > 5 * TOLERANCE  # not the first adapter any more
    finally:
        run(backend.unload_adapter("agent"))
    assert served(backend)[2] == pytest.approx(base_lp, abs=1e-3)  # the base is untouched


# -- full weights --------------------------------------------------------------------------


def perturbed_copy(model_dir: Path, out: Path) -> Path:
    from transformers import AutoModelForCausalLM

    net = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(7)
    with torch.no_grad():
        for param in net.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    net.save_pretrained(out)
    return out


class _FullLearner:
    """What `WeightSync` reads of a full fine-tuning learner: `Learner.full_state_dict` and
    `Learner.trains` (the learner helper's interface, on its own branch)."""

    def __init__(self, weights: dict[str, torch.Tensor]) -> None:
        from masenvs.trainer.config import TrainConfig

        self.cfg = TrainConfig(policy={"finetune": "full", "mode": "shared"})
        self.policies = {"shared": None}
        self.weights = weights

    def trains(self, policy: str) -> bool:
        return True

    def full_state_dict(self, policy: str) -> dict[str, torch.Tensor]:
        return self.weights


def test_full_weights_reach_the_running_server(backend, model, tmp_path) -> None:
    from safetensors.torch import load_file

    from masenvs.trainer.inference.sync import WeightSync

    prompt, ids, before = served(backend)
    changed = perturbed_copy(model, tmp_path / "changed")
    try:
        run(backend.update_weights(changed))  # a directory of safetensors
        after = served(backend)
        assert after[2] == pytest.approx(reference(changed, prompt, after[1]), abs=TOLERANCE)
        assert differs(reference(changed, prompt, ids), before) > 5 * TOLERANCE
        run(backend.update_weights(model / "model.safetensors"))  # one file: the original
        assert served(backend)[2] == pytest.approx(before, abs=1e-3)

        # The trainer's path: the learner's full state dict, saved and pushed by WeightSync.
        learner = _FullLearner(load_file(str(changed / "model.safetensors")))
        sync = WeightSync(learner, backend, tmp_path / "sync")  # type: ignore[arg-type]
        run(sync.push(1))
        synced = served(backend)
        assert synced[1] == after[1] and synced[2] == pytest.approx(after[2], abs=1e-3)
        assert (tmp_path / "sync" / "full" / "shared" / "v000001" / "model.safetensors").is_file()
    finally:
        run(backend.update_weights(model))
    assert served(backend)[2] == pytest.approx(before, abs=1e-3)


def test_update_weights_explains_a_missing_or_empty_source(backend, tmp_path) -> None:
    from masenvs.engine.protocol import BackendError

    with pytest.raises(BackendError, match="no safetensors|No weights"):
        run(backend.update_weights(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(BackendError, match="safetensors"):
        run(backend.update_weights(tmp_path / "empty"))


# -- training ------------------------------------------------------------------------------


class ToyEnv(MASEnv):
    """Two agents answer the same prompt in turn; each is rewarded for distinct characters, so even
    a random model's K candidates get different rewards and the adapters learn."""

    name = "vllm_toy"
    roles = ("writer", "editor")
    solo_role = "writer"

    def generate_task(self, rng) -> int:
        return int(rng.integers(1000))

    def initial_state(self, task: Any) -> EpisodeState:
        return EpisodeState()

    def prompt(self, agent: str) -> list[dict[str, str]]:
        return [{"role": "user", "content": f"Task {self.task}: say something, {agent}."}]

    def play_turn(self, agent: str, action: str) -> RewardParts:
        self.last_feedback[agent] = ""
        return RewardParts(agent=len(set(action)) / 10)


register("vllm_toy", f"{__name__}:ToyEnv")


def toy_config(run_dir: Path, model: Path, steps: int, **backend: Any):
    from masenvs.trainer.config import TrainConfig

    return TrainConfig(
        run_dir=str(run_dir),
        steps=steps,
        model={"name": str(model), "device": "cpu", "dtype": "float32"},
        env={"name": "vllm_toy", "options": {"max_rounds": 1}},
        rollout={"branches": 4, "tasks_per_step": 2, "max_tokens": 8, "concurrency": 2},
        optim={"lr": 2e-2, "warmup_steps": 0},
        lora={"rank": 8, "alpha": 16},
        validation={"every": 0},
        checkpoint={"every": 100},
        logging={"tensorboard": False, "plot_every": 0, "entropy": False},
        backend={"kind": "vllm", "request_timeout": 300, **backend},
    )


def test_three_steps_of_training_against_the_server(backend, server, model, tmp_path) -> None:
    from masenvs.trainer.run.metrics import read_metrics
    from masenvs.trainer.run.train import train

    prompt_messages = [{"role": "user", "content": "Task 3: say something, writer."}]
    request = GenerateRequest(
        model="writer",
        params=SamplingParams(max_tokens=10, temperature=0),
        messages=prompt_messages,
    )
    base = run(backend.generate(GenerateRequest("", request.params, messages=prompt_messages)))
    result = train(toy_config(tmp_path, model, 3, vllm_url=server.url))
    assert result.steps == 3

    # Rollouts of step k were sampled by the weights of step k - 1, and vLLM said so.
    calls = list(TraceStore(tmp_path / "traces").calls())
    steps = {int(re.match(r"s(\d+)", c.rollout_id).group(1)) for c in calls}
    assert steps == {1, 2, 3}
    for call in calls:
        step = int(re.match(r"s(\d+)", call.rollout_id).group(1))
        assert (call.backend, call.policy_version) == ("vllm", step - 1), call.rollout_id
    # The learner's recomputed log-probs agree with the server's (same weights, T=1).
    rows = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "learner/writer/loss" in r]
    assert len(rows) == 3 and not any(r["train/failed_tasks"] for r in rows)
    for row in rows:
        for agent in ("writer", "editor"):
            assert row[f"learner/{agent}/logprob_diff_mean"] < TOLERANCE
            assert row[f"learner/{agent}/grad_norm"] > 0  # the toy rewards differ: it learns

    # The server now answers with the trained adapter, exactly as peft does with it.
    backend_now = VLLMBackend(server.url)
    assert {"writer", "editor"} <= set(backend_now.model_names())
    trained = run(backend_now.generate(request))
    (completion,) = trained.completions
    adapter = tmp_path / "sync" / "writer" / "v000003"
    ref = reference(model, trained.prompt_token_ids, completion.token_ids, adapter)
    assert completion.logprobs == pytest.approx(ref, abs=TOLERANCE)
    untrained = reference(model, trained.prompt_token_ids, completion.token_ids)
    assert differs(untrained, completion.logprobs) > 2 * TOLERANCE
    assert base.completions[0].logprobs != completion.logprobs
    for name in ("writer", "editor"):  # leave the shared server as the other tests expect
        run(backend_now.unload_adapter(name))


class LongToyEnv(ToyEnv):
    """ToyEnv with a long prompt of its own per task: eight tasks in flight ask for more
    prefill than the CPU build's 2048-token step, so vLLM splits prefills over steps."""

    name = "vllm_toy_long"

    def prompt(self, agent: str) -> list[dict[str, str]]:
        words = " ".join(f"w{(self.task * 31 + i) % 9973}" for i in range(250))
        return [{"role": "user", "content": f"Task {self.task}: {words}. Say something, {agent}."}]


register("vllm_toy_long", f"{__name__}:LongToyEnv")


def test_default_rollout_settings_train_against_the_cpu_server(
    server, model, tmp_path, caplog
) -> None:
    """The default config (rollout.seeded on, 8 tasks of 4 candidates) trains against the
    CPU build: seeded requests with chunked prefills kill its engine ("CPU Generator does
    not use offset"), so the trainer learns from /server_info that seeds are not honoured
    there, says so once and sends none."""
    from masenvs.trainer.config import RolloutConfig, TrainConfig
    from masenvs.trainer.run.metrics import read_metrics
    from masenvs.trainer.run.train import train

    cfg = TrainConfig(
        run_dir=str(tmp_path),
        steps=1,
        model={"name": str(model), "device": "cpu", "dtype": "float32"},
        env={"name": "vllm_toy_long", "options": {"max_rounds": 1}},
        rollout={"max_tokens": 16},  # the random model never stops: keep CPU decoding short
        validation={"every": 0},
        logging={"tensorboard": False, "plot_every": 0, "entropy": False},
        backend={"kind": "vllm", "vllm_url": server.url, "request_timeout": 300},
    )
    # Every other rollout setting as shipped: seeded, 8 tasks in flight, 4 candidates each.
    assert cfg.rollout.model_copy(update={"max_tokens": 512}) == RolloutConfig()
    assert cfg.rollout.seeded
    with caplog.at_level("WARNING"):
        assert train(cfg).steps == 1
    (row,) = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r.get("step") == 1]
    assert row["train/failed_tasks"] == 0
    assert row["learner/writer/grad_norm"] > 0
    said = [r.getMessage() for r in caplog.records if "rollout.seeded" in r.getMessage()]
    assert len(said) == 1 and "docs/vllm.md" in said[0]
    calls = list(TraceStore(tmp_path / "traces").calls())
    assert len(calls) == 2 * cfg.rollout.tasks_per_step  # writer and editor, every task
    assert min(len(c.prompt_token_ids) for c in calls) > 2048 / cfg.rollout.tasks_per_step
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200  # still alive
    backend_now = VLLMBackend(server.url)
    assert backend_now.honours_seed is False and "cpu" in backend_now.seed_note
    for name in ("writer", "editor"):  # leave the shared server as the other tests expect
        run(backend_now.unload_adapter(name))


def test_the_trainer_starts_vllm_and_stops_it_even_when_interrupted(
    install, model, tmp_path, monkeypatch
) -> None:
    from masenvs.trainer.rollout.sources import TreeSource
    from masenvs.trainer.run import train as train_module
    from masenvs.trainer.run.metrics import read_metrics

    collect = TreeSource.collect

    async def interrupted(self, step: int, seeds: list[int]):
        if step == 2:
            raise KeyboardInterrupt  # Ctrl-C in the middle of the run
        return await collect(self, step, seeds)

    monkeypatch.setattr(TreeSource, "collect", interrupted)
    python = install.prefix[0] if install.model_flag else None
    cfg = toy_config(tmp_path, model, 2, vllm_python=python)
    with pytest.raises(KeyboardInterrupt):
        train_module.train(cfg)

    log = (tmp_path / "vllm.log").read_text()
    assert "--enable-lora" in log or "enable_lora" in log
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows if "learner/writer/loss" in r] == [1]
    assert {c.backend for c in TraceStore(tmp_path / "traces").calls()} == {"vllm"}
    pids = {int(p) for p in re.findall(r"pid=(\d+)", log)}
    assert pids
    assert not [pid for pid in pids if running(pid)]  # the API server, engine and workers
    port = re.search(r"http://127\.0\.0\.1:(\d+)", log) or re.search(r"'port': (\d+)", log)
    assert port is not None
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port.group(1)}/health", timeout=5)


@pytest.mark.skipif(
    not hasattr(Learner, "full_state_dict"),
    reason="full fine-tuning in the learner comes with the `learner` branch of issue #12",
)
def test_full_fine_tuning_trains_against_a_vllm_it_starts(install, model, tmp_path) -> None:
    from safetensors.torch import load_file

    from masenvs.trainer.run.metrics import read_metrics
    from masenvs.trainer.run.train import train

    python = install.prefix[0] if install.model_flag else None
    cfg = toy_config(tmp_path, model, 2, vllm_python=python)
    cfg.policy.finetune, cfg.policy.mode = "full", "shared"
    cfg.optim.lr = 1e-3
    train(cfg)

    rows = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "learner/shared/loss" in r]
    assert len(rows) == 2 and not any(r["train/failed_tasks"] for r in rows)
    assert all(r["learner/shared/logprob_diff_mean"] < TOLERANCE for r in rows)
    calls = list(TraceStore(tmp_path / "traces").calls())
    for call in calls:
        step = int(re.match(r"s(\d+)", call.rollout_id).group(1))
        assert (call.backend, call.policy_version) == ("vllm", step - 1)
    # Step 2's rollouts came from the weights of step 1, pushed as one safetensors file:
    # the server's log-probs are that model's, not the base's.
    pushed = tmp_path / "sync" / "full" / "shared" / "v000001" / "model.safetensors"
    weights = load_file(str(pushed))
    base = load_file(str(model / "model.safetensors"))
    assert any(not torch.equal(weights[k], base[k]) for k in base)
    changed = tmp_path / "step1"
    changed.mkdir()
    (changed / "model.safetensors").symlink_to(pushed)
    (changed / "config.json").symlink_to(model / "config.json")
    late = next(c for c in calls if c.rollout_id.startswith("s2"))
    choice = late.choices[0]
    ref = reference(changed, late.prompt_token_ids, choice.token_ids)
    assert choice.logprobs == pytest.approx(ref, abs=TOLERANCE)
    assert differs(reference(model, late.prompt_token_ids, choice.token_ids), ref) > TOLERANCE


def weights_dir(pushed: Path, model: Path, out: Path) -> Path:
    """A model directory of `pushed` (a synced model.safetensors) with `model`'s config."""
    out.mkdir()
    (out / "model.safetensors").symlink_to(pushed)
    (out / "config.json").symlink_to(model / "config.json")
    return out


@pytest.mark.skipif(
    not hasattr(Learner, "full_state_dict"),
    reason="full fine-tuning in the learner comes with the `learner` branch of issue #12",
)
def test_separate_bases_fully_fine_tuned_each_on_its_own_vllm(install, model, tmp_path) -> None:
    from masenvs.trainer.run.metrics import read_metrics
    from masenvs.trainer.run.train import train

    other = tiny_llama(tmp_path / "other-base", seed=1)  # same tokenizer, other weights
    python = install.prefix[0] if install.model_flag else None
    run_dir = tmp_path / "run"
    cfg = toy_config(run_dir, model, 2, vllm_python=python)
    cfg.policy.finetune, cfg.policy.mode = "full", "separate"
    cfg.policy.models = {"editor": str(other)}
    cfg.optim.lr = 1e-3
    train(cfg)

    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "learner/writer/loss" in r]
    assert len(rows) == 2 and not any(r["train/failed_tasks"] for r in rows)
    for agent in ("writer", "editor"):
        assert all(r[f"learner/{agent}/logprob_diff_mean"] < TOLERANCE for r in rows)
    calls = list(TraceStore(run_dir / "traces").calls())
    assert {c.backend for c in calls} == {"vllm"}
    # Step 1 was sampled by each agent's own base; step 2 by the weights its own learner
    # model pushed to its own server after step 1.
    bases = {"writer": model, "editor": other}
    served_by: dict[str, tuple[list[int], list[int], list[float]]] = {}
    for agent, base in bases.items():
        pushed = run_dir / "sync" / "full" / agent / "v000001" / "model.safetensors"
        trained = weights_dir(pushed, base, tmp_path / f"{agent}-step1")
        for step, weights in ((1, base), (2, trained)):
            call = next(
                c for c in calls if c.agent == agent and c.rollout_id.startswith(f"s{step}")
            )
            assert call.policy_version == step - 1
            choice = call.choices[0]
            ref = reference(weights, call.prompt_token_ids, choice.token_ids)
            assert choice.logprobs == pytest.approx(ref, abs=TOLERANCE), (agent, step)
            served_by[f"{agent}{step}"] = (call.prompt_token_ids, choice.token_ids, ref)
        prompt, ids, ref = served_by[f"{agent}2"]
        assert differs(reference(base, prompt, ids), ref) > TOLERANCE  # the push changed it
    # And the two servers differ: the writer's tokens are not scored alike by the editor's.
    prompt, ids, ref = served_by["writer1"]
    assert differs(reference(other, prompt, ids), ref) > 2 * TOLERANCE

    # Two servers, one per policy, each with its own log, and none left running.
    logs = sorted(p.name for p in run_dir.glob("vllm*.log"))
    assert logs == ["vllm-editor.log", "vllm-writer.log"]
    for log in logs:
        pids = {int(p) for p in re.findall(r"pid=(\d+)", (run_dir / log).read_text())}
        assert pids and not [pid for pid in pids if running(pid)]


def test_auto_mas_executor_calls_train_against_the_server(
    backend, server, model, tmp_path, monkeypatch
) -> None:
    """Designs run in the sandbox call the vLLM-served executor through the gate; those calls
    are traced with vLLM's version and train the executor's adapter."""
    import masenvs.envs.auto_mas as auto_mas
    from masenvs.trainer.config import TrainConfig
    from masenvs.trainer.run.metrics import read_metrics
    from masenvs.trainer.run.train import train

    monkeypatch.setattr(auto_mas, "extract_design", lambda text: 'system = Agent("solo")')
    cfg = TrainConfig(
        run_dir=str(tmp_path),
        steps=2,
        model={"name": str(model), "device": "cpu", "dtype": "float32"},
        env={"name": "auto_mas", "options": {"max_rounds": 1, "executions": 2, "max_tokens": 6}},
        rollout={"branches": 2, "tasks_per_step": 1, "max_tokens": 8, "concurrency": 1},
        optim={"lr": 2e-2, "warmup_steps": 0},
        lora={"rank": 8, "alpha": 16},
        validation={"every": 0},
        checkpoint={"every": 100},
        logging={"tensorboard": False, "plot_every": 0, "entropy": False},
        backend={"kind": "vllm", "request_timeout": 300, "vllm_url": server.url},
    )
    assert train(cfg).steps == 2
    calls = [c for c in TraceStore(tmp_path / "traces").calls() if c.agent == "executor"]
    assert len(calls) == 2 * 2 * 2  # 2 steps x 2 designs x 2 executions, one node each
    for call in calls:
        assert call.backend == "vllm" and call.step == "solo"
        assert call.rollout_id.startswith("mas-")
    assert sorted({c.policy_version for c in calls}) == [0, 1]
    rows = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "time/update_s" in r]
    assert [r["train/captured_runs"] for r in rows] == [4.0, 4.0]
    for row in rows:
        if "learner/executor/logprob_diff_mean" in row:
            assert row["learner/executor/logprob_diff_mean"] < TOLERANCE
    assert any("learner/executor/samples" in r for r in rows)
    for name in ("designer", "executor"):  # leave the shared server as the other tests expect
        run(VLLMBackend(server.url).unload_adapter(name))


def test_the_masenvs_command_trains_against_the_server(server, model, tmp_path) -> None:
    # As a user runs it: the `masenvs` command (restarted with jemalloc where it is installed,
    # the default) trains plan-path's two agents against the running vLLM.
    import ctypes.util

    config = {
        "run_dir": str(tmp_path / "run"),
        "steps": 1,
        "model": {"name": str(model), "device": "cpu", "dtype": "float32"},
        "env": {"name": "plan_path", "options": {"size": 4, "tool_task": "propose"}},
        "rollout": {"branches": 2, "tasks_per_step": 2, "max_tokens": 8, "max_rounds": 1},
        "algorithm": {"drop_zero_std_groups": False},
        "optim": {"warmup_steps": 0},
        "lora": {"rank": 8, "alpha": 16},
        "validation": {"every": 0},
        "logging": {"tensorboard": False, "plot_every": 0},
        "backend": {"kind": "vllm", "vllm_url": server.url, "request_timeout": 300},
    }
    (tmp_path / "train.yaml").write_text(json.dumps(config))  # JSON is YAML
    env = {k: v for k, v in os.environ.items() if not k.startswith("MASENVS_MALLOC")}
    done = subprocess.run(
        [str(Path(sys.executable).parent / "masenvs"), "train", str(tmp_path / "train.yaml")],
        capture_output=True,
        text=True,
        timeout=600,
        env={**env, "COLUMNS": "400"},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    expected = "jemalloc" if ctypes.util.find_library("jemalloc") else "lean"
    assert f"(allocator: {expected}" in done.stdout
    calls = list(TraceStore(tmp_path / "run" / "traces").calls())
    assert {c.agent for c in calls} == {"tool", "plan"}
    assert all(c.backend == "vllm" for c in calls)
    backend_now = VLLMBackend(server.url)
    for name in ("tool", "plan"):  # leave the shared server as the other tests expect
        if name in backend_now.model_names():
            run(backend_now.unload_adapter(name))
