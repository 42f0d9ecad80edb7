"""Hub ids (`Qwen/Qwen3-1.7B`) resolve as transformers and vLLM resolve them: from the
Hugging Face cache (`$HF_HUB_CACHE`, `$HF_HOME/hub`), else downloaded, else one line that
names the id and how to fetch it. The cache here is a fake one holding the tiny model under
a hub-style name, laid out as huggingface_hub lays it out."""

from __future__ import annotations

import shutil
import socket
from pathlib import Path

import pytest
import torch

from masenvs.adapters.backends.launch import VLLMLaunchError, model_dir
from masenvs.engine.engine import EmbeddedBackend
from masenvs.engine.loading import ModelLoadError, cache_dir, load_model, load_tokenizer
from masenvs.engine.protocol import GenerateRequest, SamplingParams

REPO = "masenvs-test/Tiny-Llama"
REVISION = "0123456789abcdef0123456789abcdef01234567"


def fake_hub_cache(root: Path) -> Path:
    """`root` laid out as a hub cache holding the tiny model as REPO; returns the snapshot."""
    load_tokenizer("tiny")  # builds the tiny model's cache directory once
    repo = root / f"models--{REPO.replace('/', '--')}"
    snapshot = repo / "snapshots" / REVISION
    shutil.copytree(cache_dir() / "tiny", snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    return snapshot


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """HF_HOME points at a fake home whose hub cache holds REPO; the network is off."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed_port()}")
    return fake_hub_cache(tmp_path / "hf" / "hub")


def closed_port() -> int:
    """A loopback port nothing listens on: a download attempt fails at once."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_hub_id_loads_from_the_cache_under_hf_home(hub: Path) -> None:
    loaded = load_model(REPO)
    assert loaded.path == hub and loaded.name == "Tiny-Llama"
    for a, b in zip(loaded.model.parameters(), load_model("tiny").model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert load_tokenizer(REPO).eos_token == "<|im_end|>"


def test_hf_hub_cache_wins_over_hf_home(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "elsewhere"))  # holds nothing
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    snapshot = fake_hub_cache(tmp_path / "cache")
    assert load_model(REPO).path == snapshot


def test_the_embedded_engine_serves_a_hub_id(hub: Path) -> None:
    import asyncio

    engine = EmbeddedBackend.from_spec(REPO, max_model_len=256, dtype="float32")
    try:
        request = GenerateRequest(
            "",
            SamplingParams(max_tokens=5, temperature=0),
            messages=[{"role": "user", "content": "hi"}],
        )
        ours = asyncio.run(engine.generate(request))
    finally:
        engine.shutdown()
    tiny = EmbeddedBackend.from_spec("tiny", max_model_len=256, dtype="float32")
    try:
        theirs = asyncio.run(tiny.generate(request))
    finally:
        tiny.shutdown()
    assert ours.completions[0].token_ids == theirs.completions[0].token_ids


def test_vllm_is_given_the_snapshot_the_learner_loads(hub: Path) -> None:
    assert model_dir(REPO) == str(hub)  # vLLM reads the same files and needs no network


@pytest.mark.parametrize("offline", [True, False])
def test_a_hub_id_with_no_cached_copy_is_one_line_naming_the_fetch(
    hub: Path, monkeypatch, offline: bool
) -> None:
    if offline:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # else: online, but the hub (HF_ENDPOINT) refuses connections
    with pytest.raises(ModelLoadError) as error:
        load_model("Qwen/Qwen3-1.7B")
    message = str(error.value)
    assert "\n" not in message
    assert "Qwen/Qwen3-1.7B" in message and "hf download Qwen/Qwen3-1.7B" in message
    assert str(hub.parents[2]) in message  # where it looked (the hub cache)
    with pytest.raises(VLLMLaunchError, match="hf download Qwen/Qwen3-1.7B"):
        model_dir("Qwen/Qwen3-1.7B")


def test_a_local_directory_named_like_a_hub_id_wins(hub: Path, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    shutil.copytree(hub, tmp_path / "masenvs-test" / "Tiny-Llama")
    assert load_model(REPO).path == Path("masenvs-test/Tiny-Llama")


def test_a_training_config_names_a_hub_id(hub: Path, tmp_path: Path) -> None:
    from tiny_runs import plan_path_run

    from masenvs.trainer.config import load_config
    from masenvs.trainer.run.train import train

    cfg = load_config(None, plan_path_run(tmp_path / "run", f"model.name={REPO}", "steps=1"))
    assert train(cfg).steps == 1
    adapter = next((tmp_path / "run" / "checkpoints").glob("step_*/adapters/*/adapter_config.json"))
    assert REPO in adapter.read_text()  # adapters name their base as the hub does


def test_masenvs_train_names_a_missing_hub_model_in_one_message(hub: Path, tmp_path, capsys):
    from masenvs.trainer.commands.train import main

    code = main(
        [
            "examples/paper/plan_path_qwen3_1.7b.yaml",
            f"--set=run_dir={tmp_path / 'run'}",
            "--set=model.device=cpu",
        ]
    )
    out = " ".join(capsys.readouterr().out.split())  # the console wraps long lines
    assert code == 2 and "Traceback" not in out
    assert "Qwen/Qwen3-1.7B is not in the Hugging Face cache" in out
    assert "hf download Qwen/Qwen3-1.7B" in out
