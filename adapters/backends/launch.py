"""Starting servers: `launch_vllm` finds a vLLM install and starts its OpenAI server;
`launch_engine_server` starts `masenvs serve --engine` (an embedded engine in vLLM's dialect).

vLLM pins its own torch and transformers, so it runs in its own environment: `find_vllm`
looks for it (an explicit python or executable, then the CPU build that
scripts/vllm_cpu_env.sh makes, then `vllm` on PATH). `launch_server` starts any server
process (vLLM, or `masenvs serve --engine` through `launch_engine_server`), waits until its
`/health` answers and returns a `VLLMProcess` whose `stop()` ends it and every process it
started. The HTTP client that talks to a running server is `VLLMBackend` (backends/vllm.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from masenvs.cache import BUILT_IN_MODELS, DEFAULT_MODEL
from masenvs.engine.args import EngineArgs
from masenvs.listeners import API_KEY_ENV, listener_key

VLLM_BIN_ENV = "MASENVS_VLLM_BIN"
VLLM_PYTHON_ENV = "MASENVS_VLLM_PYTHON"
VLLM_CPU_VERSION = "0.32.0"  # what scripts/vllm_cpu_env.sh installs
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's allowed --max-lora-rank
# What the CPU build needs that vLLM's GPU defaults do not give (backend.vllm_args overrides).
CPU_ARGS = {"--dtype": "bfloat16", "--max-model-len": "2048"}
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2"}  # GiB of KV cache
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # its attention kernels
# The worker extension that takes full weights (`update_weights`); it goes on vLLM's path.
EXTENSION_DIR = Path(__file__).with_name("vllm_ext")
EXTENSION_CLASS = "masenvs_vllm_ext.WeightUpdateExtension"


class VLLMLaunchError(RuntimeError):
    """`vllm serve` could not be started; the message names the cause and the fix."""


@dataclass
class VLLMProcess:
    """A `vllm serve` that masenvs started; `stop()` ends it."""

    process: subprocess.Popen
    url: str
    log_path: Path
    command: list[str] = field(default_factory=list)
    cpu: bool | None = None  # started for vLLM's CPU build; None: not known

    def stop(self, timeout: float = 30.0) -> None:
        """End the server and every process it started; return once they are all gone.

        The server runs in its own process group; engine and worker processes that left
        the group are found as descendants, so none outlives `stop()`."""
        family = _descendants(self.process.pid)
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout)
        family |= _group_members(self.process.pid)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        for pid in family:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        self.process.wait()
        # SIGKILL is delivered asynchronously: wait until the kernel has ended each one.
        deadline = time.monotonic() + 10.0
        while any(_alive(pid) for pid in family) and time.monotonic() < deadline:
            time.sleep(0.05)

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def __enter__(self) -> VLLMProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _proc_stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name, or None if it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None


def _alive(pid: int) -> bool:
    """Whether `pid` still runs (a zombie waiting to be reaped has ended)."""
    stat = _proc_stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")


def _all_pids() -> list[int]:
    try:
        return [int(name) for name in os.listdir("/proc") if name.isdigit()]
    except OSError:  # no /proc (macOS): killpg alone has to do
        return []


def _group_members(pgid: int) -> set[int]:
    return {pid for pid in _all_pids() if (stat := _proc_stat(pid)) and stat[2] == str(pgid)}


def _descendants(root: int) -> set[int]:
    """`root`'s living descendants, by parent pid in /proc."""
    children: dict[int, list[int]] = {}
    for pid in _all_pids():
        if stat := _proc_stat(pid):
            children.setdefault(int(stat[1]), []).append(pid)
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


@dataclass(frozen=True)
class VLLMInstall:
    """How to start one vLLM install: `python -m ...api_server --model M` or `vllm serve M`."""

    prefix: tuple[str, ...]
    model_flag: bool  # the api_server module takes --model; `vllm serve` takes it positionally
    origin: str  # where it was found, for messages

    def command(self, model: str) -> list[str]:
        return [*self.prefix, "--model", model] if self.model_flag else [*self.prefix, model]


def cpu_env_python() -> Path | None:
    """The python of the env `scripts/vllm_cpu_env.sh` builds (the CPU build), if it exists."""
    version = os.environ.get("VLLM_CPU_VERSION", VLLM_CPU_VERSION)
    cache = Path(os.environ.get("MASENVS_CACHE") or "~/.cache/masenvs").expanduser()
    env_dir = Path(os.environ.get("MASENVS_VLLM_ENV") or cache / f"vllm-cpu-{version}")
    python = env_dir.expanduser() / "bin" / "python"
    # The script marks an env complete only once `import vllm` worked in it.
    return python if python.is_file() and (env_dir.expanduser() / ".complete").exists() else None


def find_vllm(vllm_bin: str | None = None, python: str | None = None) -> VLLMInstall:
    """The vLLM to start, in this order: `python=` or `vllm_bin=`, $MASENVS_VLLM_PYTHON,
    $MASENVS_VLLM_BIN, the CPU-build env of scripts/vllm_cpu_env.sh, `vllm` on PATH.

    A python runs `-m vllm.entrypoints.openai.api_server`, which works for every build; the
    CPU build's `vllm` console script does not (its distribution is named `vllm-cpu`).
    """
    candidates: list[tuple[str, str | None, str]] = [
        ("python", python, "python="),
        ("bin", vllm_bin, "vllm_bin="),
        ("python", os.environ.get(VLLM_PYTHON_ENV), f"${VLLM_PYTHON_ENV}"),
        ("bin", os.environ.get(VLLM_BIN_ENV), f"${VLLM_BIN_ENV}"),
    ]
    for kind, value, origin in candidates:
        if not value:
            continue
        path = shutil.which(os.path.expanduser(value))
        if path is None:
            raise VLLMLaunchError(
                f"The vLLM {'python' if kind == 'python' else 'executable'} {value!r} (from "
                f"{origin}) does not exist or is not executable; point it at "
                f"<vllm env>/bin/{'python' if kind == 'python' else 'vllm'}."
            )
        return _install(kind, path, origin)
    cached = cpu_env_python()
    if cached is not None:
        return _install("python", str(cached), "scripts/vllm_cpu_env.sh's env")
    on_path = shutil.which("vllm")
    if on_path is not None:
        return _install("bin", on_path, "PATH")
    raise VLLMLaunchError(
        "vLLM was not found. It runs in its own environment: on a GPU machine "
        "`python -m venv ~/vllm-env && ~/vllm-env/bin/pip install vllm`, then "
        f"`export {VLLM_PYTHON_ENV}=~/vllm-env/bin/python`; on a CPU-only machine "
        "`scripts/vllm_cpu_env.sh` builds the CPU build where masenvs finds it. "
        f"${VLLM_BIN_ENV} (a `vllm` executable) and `vllm` on PATH work too."
    )


def _install(kind: str, path: str, origin: str) -> VLLMInstall:
    if kind == "python":
        return VLLMInstall((path, "-m", "vllm.entrypoints.openai.api_server"), True, origin)
    return VLLMInstall((path, "serve"), False, origin)


def cpu_only() -> bool:
    """True when this machine has no CUDA GPU, so vLLM must be its CPU build."""
    try:
        import torch
    except ImportError:
        return not Path("/dev/nvidiactl").exists()
    return not torch.cuda.is_available()


def lora_rank_for(rank: int) -> int:
    """The smallest --max-lora-rank vLLM accepts that fits adapters of rank `rank`."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise VLLMLaunchError(f"vLLM serves LoRA ranks up to {VLLM_LORA_RANKS[-1]}, not {rank}.")


def model_dir(model: str) -> str:
    """What vLLM loads for a masenvs model name: its converted directory; for a hub id the
    snapshot the learner loads too (from the HF cache, or downloaded once, `hub_snapshot`),
    so both read the same revision and vLLM needs no network; else `model` as is."""
    from masenvs.engine.loading import ModelLoadError, hub_snapshot, is_hub_id

    if model in BUILT_IN_MODELS:
        from masenvs.engine.loading import cache_dir, load_tokenizer

        load_tokenizer(model)  # builds (converts) the cached model directory once
        return str(cache_dir() / model)
    if is_hub_id(model) and not Path(model).expanduser().exists():
        try:
            return str(hub_snapshot(model))
        except ModelLoadError as exc:
            raise VLLMLaunchError(str(exc)) from None
    return model


def launch_vllm(
    model_path: str,
    *,
    port: int = 0,
    host: str = "127.0.0.1",
    lora_modules: Mapping[str, str] | None = None,
    max_loras: int = 4,
    max_lora_rank: int = 64,
    served_model_name: str | None = None,
    vllm_bin: str | None = None,
    python: str | None = None,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    timeout: float = 900.0,
    log_path: str | os.PathLike[str] | None = None,
    weight_updates: bool = False,
    cpu: bool | None = None,
) -> VLLMProcess:
    """Start a vLLM OpenAI server with LoRA enabled and wait until `/health` answers.

    `find_vllm` picks the install (see its order). On a CPU-only machine (`cpu=None` asks
    `cpu_only()`) it adds what the CPU build needs, `--dtype bfloat16 --max-model-len 2048`
    and `VLLM_CPU_KVCACHE_SPACE=2`, unless `extra_args` or `env` set them. `weight_updates`
    loads masenvs' worker extension and turns on vLLM's development endpoints
    (`/collective_rpc`, `/reset_prefix_cache`) that `VLLMBackend.update_weights` uses; keep
    such a server on loopback. The server's output goes to `log_path` (a temp file by
    default); if it exits or is not healthy within `timeout` seconds, the error shows the
    end of that log.
    """
    install = find_vllm(vllm_bin, python)
    cpu = cpu_only() if cpu is None else cpu
    if port == 0:
        port = free_port(host)
    args = [
        *install.command(model_dir(model_path)),
        "--host",
        host,
        "--port",
        str(port),
        "--enable-lora",
        "--max-loras",
        str(max_loras),
        "--max-lora-rank",
        str(lora_rank_for(max_lora_rank)),
    ]
    if served_model_name:
        args += ["--served-model-name", served_model_name]
    if lora_modules:
        args += ["--lora-modules", *(f"{name}={path}" for name, path in lora_modules.items())]
    child_env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    if cpu:
        given = {arg.split("=", 1)[0] for arg in extra_args}
        for flag, value in CPU_ARGS.items():
            if flag not in given:
                args += [flag, value]
        child_env = {**CPU_ENV, **child_env}
    if weight_updates:
        args += ["--worker-extension-cls", EXTENSION_CLASS]
        paths = [str(EXTENSION_DIR), child_env.get("PYTHONPATH", "")]
        child_env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
        child_env["VLLM_SERVER_DEV_MODE"] = "1"
    args += list(extra_args)
    child_env.update(env or {})
    log_file = (
        Path(log_path) if log_path else Path(tempfile.mkstemp(prefix="vllm-", suffix=".log")[1])
    )
    server = launch_server(
        args, child_env, log_file, f"http://{host}:{port}", timeout, f"vLLM ({install.origin})"
    )
    server.cpu = cpu
    return server


def launch_engine_server(
    model: str,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    engine: EngineArgs | None = None,
    env: Mapping[str, str] | None = None,
    log_path: str | os.PathLike[str] | None = None,
    timeout: float = 300.0,
    api_key: str | None = None,
    **options: Any,
) -> VLLMProcess:
    """Start `masenvs serve --engine` on `model` and wait until `/health` answers.

    The engine runs as `engine` says, with `options` (EngineArgs fields: dtype="float32",
    threads=1, ...) on top. Beyond loopback it needs `api_key` (clients send it as a Bearer
    token); the key reaches the server in its environment, never on its command line."""
    engine = dataclasses.replace(engine or EngineArgs(), **options)
    key = listener_key(host, api_key, what="an engine server", key_flag="api_key=")
    port = port or free_port(host)
    args = [
        sys.executable,
        "-m",
        "masenvs.cli",
        "serve",
        "--engine",
        "--model",
        model,
        "--host",
        host,
        "--port",
        str(port),
        *engine.to_cli_args(),
    ]
    log_file = (
        Path(log_path) if log_path else Path(tempfile.mkstemp(prefix="engine-", suffix=".log")[1])
    )
    env = {**os.environ, **(env or {})}
    env.pop(API_KEY_ENV, None)  # a key the user set for something else must not lock it
    if key:
        env[API_KEY_ENV] = key
    url = f"http://{host}:{port}"
    return launch_server(args, env, log_file, url, timeout, f"The engine server for {model}")


def launch_server(
    args: list[str], env: dict[str, str], log_file: Path, url: str, timeout: float, what: str
) -> VLLMProcess:
    """Start a server process and wait until its /health answers; stop it on any failure.

    `what` names it in errors ("vLLM (...)", "The engine server for ...").
    """
    with open(log_file, "ab") as log:
        process = subprocess.Popen(
            args,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # so stop() ends the server's worker processes too
        )
    handle = VLLMProcess(process, url, log_file, args)
    deadline = time.monotonic() + timeout
    try:
        while True:
            if process.poll() is not None:
                raise VLLMLaunchError(
                    f"{what} exited with status {process.returncode} before it was ready. "
                    f"The end of its log ({log_file}):\n{handle.log_tail()}"
                )
            try:
                if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                    return handle
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise VLLMLaunchError(
                    f"{what} was not healthy after {timeout:.0f} s; raise the launch timeout "
                    f"if the machine is slow. The end of its log ({log_file}):\n"
                    f"{handle.log_tail()}"
                )
            time.sleep(0.2)
    except BaseException:
        handle.stop()  # also on Ctrl-C while waiting: never leave a half-started server
        raise


def check_cpu_model(model: str) -> None:
    """Fail now, not at vLLM's first request, on a model its CPU build cannot run."""
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return  # a hub id or an odd directory: vLLM will say
    config = config.get("text_config", config)
    heads = config.get("num_attention_heads")
    head_dim = config.get("head_dim") or (config.get("hidden_size", 0) // heads if heads else 0)
    if head_dim and head_dim not in CPU_HEAD_SIZES:
        raise VLLMLaunchError(
            f"vLLM's CPU build has no attention kernel for head_dim {head_dim} ({model}); "
            f"it supports {', '.join(map(str, CPU_HEAD_SIZES))}. The 'tiny' test model is such "
            f"a model: use {DEFAULT_MODEL} (or a GPU) with vLLM."
        )


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now, for a server about to start there."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
