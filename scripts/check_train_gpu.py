"""A paper config for a few AT-GRPO steps on one GPU: step time, tokens/s, MFU, peak memory.

    python scripts/check_train_gpu.py --model /models/Qwen3-1.7B     # plan-path, Qwen3-1.7B
    python scripts/check_train_gpu.py --config examples/paper/math_qwen3_8b.yaml --model /models/Qwen3-8B
    python scripts/check_train_gpu.py --model /models/Qwen3-1.7B --backend embedded   # no vLLM here
    python scripts/check_train_gpu.py --model DIR --set rollout.branches=4 --steps 4
    python scripts/check_train_gpu.py --random-init qwen3-1.7b --backend embedded  # no weights
    python scripts/check_train_gpu.py --config all --steps 1 --offline-tasks   # every paper config

`--config all` is the rehearsal of the paper's runs: every examples/paper/*.yaml for --steps
steps (1 is enough to see that it runs and what a step costs), each with its own model (the
config's hub id from the HF cache; --model for all of them; --random-init auto: Qwen3's
shape of the config's size) and its own backend, one after another; a table of what ran and
what failed goes to $OUT/check_train_gpu_all.json beside each config's own results.
--offline-tasks gives math, code and auto-MAS their built-in tasks (no dataset download);
tests/test_paper_configs.py runs this (for 2 steps) on CPU with the tiny model.

A lent GPU machine cannot reach the model hub, so --model names a local model directory
(config.json + safetensors). Without --model the config's hub id is looked up in the local
Hugging Face cache only; if it is not there the script stops and says so. With no weights
at all, --random-init qwen3-1.7b (or qwen3-8b) draws a model of that shape at random: right
for step time, tokens/s, MFU and memory (every answer runs to --max-tokens), not for rewards.
docs/paper.md gives the one command for a machine with only PyTorch on it (wheels carried).

It trains the config as written (policy mode, full or LoRA, K, learning rate, vLLM sizing)
with shorter episodes so it ends within about 8 minutes on one H200 with Qwen3-1.7B: 3 steps
of 8 tasks, answers of at most 512 tokens, 2 rounds, no validation. The first step warms up
(CUDA graphs, allocator), so the summary is the median of the later ones. Results print as a
table and go to $OUT/check_train_gpu.json with the run's metrics.jsonl ($OUT, or a temp dir).

MFU = learner model FLOPs per update / update seconds / bf16 peak, the peak being a bf16
torch.mm timed on this GPU. Model FLOPs of an update, per policy (N_body: weights of the
linear layers of the transformer blocks; N_head = hidden x vocab; T_body: tokens fed, a
shared prompt once plus every completion; T_head: completion tokens, the only ones that go
through the LM head):

    forward = 2 * N_body * T_body + 2 * N_head * T_head
    update  = 3 * forward * ppo_epochs    full fine-tuning (forward, input grads, weight grads)
              2 * forward * ppo_epochs    LoRA (frozen weights get no weight gradient; LoRA's
                                          own r/d share is left out)
            + 1 * forward                 when pi_old needs its own pass (more than one
                                          optimizer step per batch), + 1 more with a KL term

Attention scores (4 * layers * hidden * context per token) and the recomputation of gradient
checkpointing are not counted, so the MFU is a lower bound (model FLOPs, not hardware FLOPs).
A float32 learner (the full fine-tuning configs) runs far below the bf16 peak unless float32
matmuls may use TF32 (`TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1`); the header line says which.
Peak memory: torch's peak allocation in this process (the learner, and the embedded engine
if used) and the device-wide peak in use (every process, vLLM included), sampled every 0.2 s.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PAPER = ROOT / "examples" / "paper"
DEFAULT_CONFIG = PAPER / "plan_path_qwen3_1.7b.yaml"
# --offline-tasks: tasks a machine without internet has (the configs' datasets need the hub).
OFFLINE_TASKS: dict[str, list[str]] = {
    "math": ["env.options.source=generated"],
    "code": ["env.options.source=builtin", "env.options.split=null"],
    "auto_mas": [
        "env.options.math_source=generated",
        "env.options.code_sources={builtin: 1}",
        "env.options.split=null",
    ],
}


class CheckError(Exception):
    """Stops the check before any GPU time is spent; the message says what to do."""


HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")

# Qwen3's published shapes, for --random-init on a machine that has no weights.
QWEN3_SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-1.7b": dict(
        hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
    ),
    "qwen3-8b": dict(
        hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False,
    ),
}  # fmt: skip


def random_model(name: str, out: Path, device: str) -> Path:
    """A Qwen3-shaped model with random bf16 weights and masenvs's SmolLM2 tokenizer in `out`.

    For speed and memory only: such a model never stops early (answers run to max_tokens,
    the slow case) and learns nothing useful. Its vocabulary is the tokenizer's (49152), so
    every sampled id decodes; the LM head is a third of Qwen3's (151936), which the FLOPs
    count (read from the written config.json) accounts for.
    """
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    from masenvs.engine.loading import load_tokenizer

    tokenizer = load_tokenizer("tiny")
    config = Qwen3Config(
        **{**QWEN3_SHAPES[name], "vocab_size": len(tokenizer)},
        max_position_embeddings=40960,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def resolve_model(spec: str) -> Path:
    """A local model directory for `spec`: the directory itself, or a hub id's cached copy."""
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise CheckError(f"{path} has no config.json; pass a Hugging Face model directory.")
        return path
    from masenvs.cache import BUILT_IN_MODELS

    if spec in BUILT_IN_MODELS:  # masenvs's own models, built into its cache
        from masenvs.engine.loading import cache_dir, load_tokenizer

        load_tokenizer(spec)
        return cache_dir() / spec
    if path.exists() or not HUB_ID.match(spec):
        raise CheckError(f"model directory {path} does not exist; pass --model DIR.")
    try:  # a hub id: usable only if it already is in the local Hugging Face cache
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(spec, local_files_only=True))
    except Exception as exc:
        raise CheckError(
            f"no local copy of {spec}: it is not in the Hugging Face cache "
            f"({type(exc).__name__}), and this machine cannot reach the hub. Pass a model "
            f"directory: --model /path/to/{spec.split('/')[-1]} (download it on a connected "
            f"machine with `huggingface-cli download {spec} --local-dir DIR`)."
        ) from None


def short_run(args: argparse.Namespace, model_dir: Path, run_dir: Path, env: str = "") -> list[str]:
    """Overrides that keep the config's method and shorten the episodes (of `env`)."""
    overrides = [
        f"model.name={model_dir}",
        f"model.device={args.device}",
        *(["model.dtype=auto"] if args.device == "cpu" else []),
        f"steps={args.steps}",
        f"rollout.tasks_per_step={args.tasks}",
        f"rollout.max_tokens={args.max_tokens}",
        f"rollout.max_rounds={args.rounds}",
        "validation.every=0",
        f"checkpoint.every={args.steps}",  # the end-of-run checkpoint is always written
        "checkpoint.keep_last=1",
        "checkpoint.resume=false",
        "logging.tensorboard=false",
        "logging.plot_every=0",
        f"run_dir={run_dir}",
    ]
    if args.backend:
        overrides.append(f"backend.kind={args.backend}")
    if env == "auto_mas":  # its executions' answers are capped by the env, not the rollout
        overrides.append(f"env.options.max_tokens={args.max_tokens}")
    if args.offline_tasks:
        overrides += OFFLINE_TASKS.get(env, [])
    return overrides + args.set


def random_init_for(choice: str | None, config: str) -> str | None:
    """--random-init's shape for `config`; 'auto' reads the size from the config's name."""
    if choice != "auto":
        return choice
    return "qwen3-8b" if "8b" in Path(config).stem else "qwen3-1.7b"


def synchronize(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def matmul_peak(device: str) -> float:
    """FLOP/s of a large matmul here, the denominator of the MFU: bf16 on a GPU; on a CPU
    (a rehearsal) fp32, the learner's precision there."""
    import torch

    n, repeats, dtype = (8192, 20, torch.bfloat16) if device == "cuda" else (1024, 5, torch.float32)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        torch.mm(a, b)
    synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        torch.mm(a, b)
    synchronize(device)
    return 2 * n**3 * repeats / (time.perf_counter() - start)


@dataclass
class ModelShape:
    body_params: int  # weights of the linear layers in the transformer blocks
    head_params: int  # hidden x vocab

    @classmethod
    def of(cls, config: dict[str, Any]) -> ModelShape:
        """From a config.json's fields, for dense Llama-family models (Qwen3, Llama, SmolLM2)."""
        d, heads = config["hidden_size"], config["num_attention_heads"]
        kv = config.get("num_key_value_heads") or heads
        head_dim = config.get("head_dim") or d // heads
        attention = d * head_dim * (2 * heads + 2 * kv)  # q and o, k and v
        mlp = 3 * d * config["intermediate_size"]  # gate, up, down
        return cls(config["num_hidden_layers"] * (attention + mlp), d * config["vocab_size"])


@dataclass
class Update:
    """One Learner.step: how long it took and what it fed through the model."""

    seconds: float
    body_tokens: int
    head_tokens: int
    flops: float


def update_flops(shape: ModelShape, body: int, head: int, cfg: Any) -> float:
    forward = 2 * shape.body_params * body + 2 * shape.head_params * head
    passes = (3 if cfg.policy.finetune == "full" else 2) * cfg.algorithm.ppo_epochs
    if cfg.algorithm.ppo_epochs * cfg.algorithm.mini_batches > 1 or cfg.lora.dropout > 0:
        passes += 1  # pi_old's own no-grad pass
    if cfg.algorithm.kl_coef > 0:
        passes += 1  # the reference model's pass
    return passes * forward


def measured_learner(cfg: Any, shape: ModelShape, updates: list[Update]) -> type:
    """The trainer's Learner class, also recording the tokens and time of each update."""
    from masenvs.trainer.learner.learner import Learner

    class MeasuredLearner(Learner):
        def step(self, samples: list, **options: Any) -> dict[str, float]:
            synchronize(cfg.model.device)
            started = time.perf_counter()
            metrics = super().step(samples, **options)
            synchronize(cfg.model.device)
            ended = time.perf_counter()
            fed = [s for s in samples if s.completion_token_ids]
            head = sum(len(s.completion_token_ids) for s in fed)
            prompts = {(s.policy, tuple(s.prompt_token_ids)) for s in fed}
            if cfg.optim.share_prompts:
                body = head + sum(len(p) for _, p in prompts)
            else:
                body = sum(s.num_tokens for s in fed)
            flops = update_flops(shape, body, head, cfg)
            updates.append(Update(ended - started, body, head, flops))
            return metrics

    return MeasuredLearner


def step_table(rows: list[dict], updates: list[Update], peak: float) -> list[dict[str, float]]:
    """One entry per training step; a step without trainable samples ran no update."""
    nan = float("nan")
    pending = iter(updates)
    table = []
    for i, row in enumerate(rows):
        upd = next(pending) if "learner/lr" in row else None
        table.append(
            {
                "step": row["step"],
                "step_s": row["time"] - rows[i - 1]["time"] if i else nan,
                "rollout_s": row["time/rollout_s"],
                "update_s": upd.seconds if upd else nan,
                "rollout_tokens_per_s": row["throughput/rollout_tokens_per_s"],
                "learner_tokens_per_s": upd.body_tokens / upd.seconds if upd else nan,
                "mfu": upd.flops / upd.seconds / peak if upd else nan,
                "success": row.get("train/success", nan),
            }
        )
    return table


class MemorySampler(threading.Thread):
    """Device-wide memory in use (all processes), sampled until stopped."""

    def __init__(self, enabled: bool, every: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.every, self.peak, self._stop_event = every, 0, threading.Event()
        self.enabled = enabled

    def run(self) -> None:
        import torch

        while self.enabled and not self._stop_event.is_set():
            free, total = torch.cuda.mem_get_info()
            self.peak = max(self.peak, total - free)
            self._stop_event.wait(self.every)

    def stop(self) -> int:
        self._stop_event.set()
        self.join()
        return self.peak


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--config", default=str(DEFAULT_CONFIG), help="a paper config, or 'all' (every one)"
    )
    model = parser.add_mutually_exclusive_group()
    model.add_argument(
        "--model", help="local model directory (default: the config's model, from the HF cache)"
    )
    model.add_argument(
        "--random-init",
        choices=[*sorted(QWEN3_SHAPES), "auto"],
        help="no weights at hand: a model of this shape with random weights (speed and memory "
        "only; answers run to --max-tokens); auto: the config's size",
    )
    parser.add_argument("--backend", choices=["vllm", "embedded"], help="default: the config's")
    parser.add_argument("--steps", type=int, default=3, help="training steps (the first warms up)")
    parser.add_argument("--tasks", type=int, default=8, help="tasks per step (B)")
    parser.add_argument("--max-tokens", type=int, default=512, help="answer length limit")
    parser.add_argument("--rounds", type=int, default=2, help="rounds per episode")
    parser.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default="cuda",
        help="cpu: a rehearsal of the whole check with a small model (e.g. --model tiny "
        "--backend embedded), to test the script where no GPU is",
    )
    parser.add_argument(
        "--offline-tasks",
        action="store_true",
        help="math, code and auto-MAS draw built-in tasks instead of their hub datasets",
    )
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="more config overrides"
    )
    args = parser.parse_args(argv)
    out = Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="masenvs-gpu-"))
    if args.config == "all":
        return rehearse_all(args, out)
    args.random_init = random_init_for(args.random_init, args.config)
    return check(args, out)


def rehearse_all(args: argparse.Namespace, out: Path) -> int:
    """Every paper config in turn (`check` each, results in $OUT/<config>/); a table of which
    ran, their step times and what failed, in $OUT/check_train_gpu_all.json."""
    rows = []
    for path in sorted(PAPER.glob("*.yaml")):
        one = argparse.Namespace(**vars(args))
        one.config = str(path)
        one.random_init = random_init_for(args.random_init, one.config)
        print(f"\n== {path.name} ==", flush=True)
        started = time.perf_counter()
        try:
            code, error = check(one, out / path.stem), None
        except Exception as exc:  # one config failing does not stop the others
            code, error = 1, f"{type(exc).__name__}: {exc}"
        summary = None
        if code == 0:
            summary = json.loads((out / path.stem / "check_train_gpu.json").read_text())
        elif error is None:
            error = f"stopped before training (exit {code})"
        rows.append(
            {
                "config": path.name,
                "ok": code == 0,
                "error": error,
                "wall_s": time.perf_counter() - started,
                # The last step's (the first has no step before it to time from).
                "rollout_s": summary["steps"][-1]["rollout_s"] if summary else None,
                "update_s": summary["steps"][-1]["update_s"] if summary else None,
                "device": summary["device"] if summary else None,
            }
        )
    print(f"\n{'config':<28} {'ok':>3} {'rollout s':>9} {'update s':>8} {'wall s':>7}  error")
    for r in rows:
        rollout, update = (
            (f"{r['rollout_s']:.1f}", f"{r['update_s']:.1f}") if r["ok"] else ("-", "-")
        )
        print(
            f"{r['config']:<28} {'yes' if r['ok'] else 'NO':>3} {rollout:>9} {update:>8} "
            f"{r['wall_s']:>7.0f}  {r['error'] or ''}"
        )
    out.mkdir(parents=True, exist_ok=True)
    (out / "check_train_gpu_all.json").write_text(json.dumps(rows, indent=2))
    print(f"results: {out / 'check_train_gpu_all.json'}")
    return 0 if all(r["ok"] for r in rows) else 1


def check(args: argparse.Namespace, out: Path) -> int:
    """One config's check (main's, after parsing): 2 when it cannot start, else 0."""
    from masenvs.trainer.config import ConfigError, load_config

    # The run (with its full-model checkpoint, tens of GB) stays out of $OUT, which is copied
    # back from a lent machine; only the metrics go there.
    run_dir = Path(tempfile.gettempdir()) / f"check-train-gpu-{os.getpid()}"
    try:
        written = load_config(args.config)
        if args.random_init:  # built once the GPU is known to be there
            model_dir = run_dir.with_name(f"{run_dir.name}-{args.random_init}")
        else:
            model_dir = resolve_model(args.model or written.model.name)
        overrides = short_run(args, model_dir, run_dir, written.env.name)
        cfg = load_config(args.config, overrides)
    except (CheckError, ConfigError, KeyError, ValueError) as exc:
        print(f"check_train_gpu: {exc}", file=sys.stderr)
        return 2

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "check_train_gpu: no CUDA device is visible to torch; run it on a GPU machine "
            "(and a CUDA build of torch: `pip install -e '.[all]'` without the CPU constraints).",
            file=sys.stderr,
        )
        return 2

    import masenvs.trainer.run.train as train_module

    if args.random_init:
        print(f"random {args.random_init} weights in {model_dir}", flush=True)
        try:
            random_model(args.random_init, model_dir, args.device)
        except BaseException:
            shutil.rmtree(model_dir, ignore_errors=True)
            raise
    shape = ModelShape.of(json.loads((model_dir / "config.json").read_text()))

    tf32 = torch.backends.cuda.matmul.allow_tf32 or bool(
        os.environ.get("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE")
    )
    print(
        f"{args.config}: {cfg.model.name}, {cfg.policy.mode} {cfg.policy.finetune}, "
        f"backend {cfg.backend.kind}, K={cfg.rollout.branches}, B={cfg.rollout.tasks_per_step}, "
        f"{cfg.rollout.max_tokens} tokens, {cfg.rollout.max_rounds} rounds, {cfg.steps} steps, "
        f"learner {cfg.model.dtype}, TF32 matmuls {'on' if tf32 else 'off'}",
        flush=True,
    )
    peak = matmul_peak(args.device)
    on_gpu = args.device == "cuda"
    if on_gpu:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    updates: list[Update] = []
    make_learner = train_module.make_learner  # one process here: the check times its updates
    measured = measured_learner(cfg, shape, updates)
    train_module.make_learner = lambda cfg, agents: measured(cfg, agents)
    sampler = MemorySampler(enabled=on_gpu)
    sampler.start()
    started = time.perf_counter()
    try:
        train_module.train(cfg)
    except Exception as exc:
        hint = (
            " If vLLM is not installed on this machine, rerun with --backend embedded."
            if cfg.backend.kind == "vllm"
            else ""
        )
        print(
            f"check_train_gpu: training failed: {type(exc).__name__}: {exc}.{hint}", file=sys.stderr
        )
        raise
    finally:
        train_module.make_learner = make_learner
        device_peak = sampler.stop()
        if (run_dir / "metrics.jsonl").is_file():
            out.mkdir(parents=True, exist_ok=True)
            shutil.copy(run_dir / "metrics.jsonl", out / "metrics.jsonl")
        shutil.rmtree(run_dir, ignore_errors=True)
        if args.random_init:
            shutil.rmtree(model_dir, ignore_errors=True)
    wall = time.perf_counter() - started
    if on_gpu:
        process_peak = torch.cuda.max_memory_allocated()
        device_name = torch.cuda.get_device_name()
        total_memory = torch.cuda.get_device_properties(0).total_memory
    else:  # the process's peak resident set (Linux reports KiB)
        process_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        device_name, total_memory = (
            "CPU (rehearsal)",
            os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"),
        )

    rows = [
        json.loads(line)
        for line in (out / "metrics.jsonl").read_text().splitlines()
        if "time/update_s" in line
    ]
    steps = step_table(rows, updates, peak)
    later = steps[1:] or steps  # the first step warms up
    summary = {
        k: statistics.median(s[k] for s in later if not math.isnan(s[k]))
        if any(not math.isnan(s[k]) for s in later)
        else float("nan")
        for k in steps[0]
        if k != "step"
    }

    print(f"\n{device_name}: torch.mm peak {peak / 1e12:.2f} TFLOP/s")
    print(
        f"{'step':>4} {'step s':>7} {'rollout s':>9} {'update s':>8} "
        f"{'rollout tok/s':>13} {'learner tok/s':>13} {'MFU':>6}"
    )
    for s in steps:
        print(
            f"{s['step']:>4} {s['step_s']:>7.1f} {s['rollout_s']:>9.1f} {s['update_s']:>8.1f} "
            f"{s['rollout_tokens_per_s']:>13.0f} {s['learner_tokens_per_s']:>13.0f} "
            f"{s['mfu']:>6.1%}"
        )
    print(
        f"median of steps 2+: step {summary['step_s']:.1f} s, rollout "
        f"{summary['rollout_tokens_per_s']:.0f} tok/s, learner "
        f"{summary['learner_tokens_per_s']:.0f} tok/s, MFU {summary['mfu']:.1%}"
    )
    if on_gpu:
        print(
            f"peak memory: {process_peak / 2**30:.1f} GiB allocated by this process, "
            f"{device_peak / 2**30:.1f} of {total_memory / 2**30:.0f} GiB in use on the device"
        )
    else:
        print(f"peak memory: {process_peak / 2**30:.1f} GiB resident (CPU rehearsal)")
    print(f"wall time of the run, start-up included: {wall:.0f} s")

    result = {
        "config": args.config,
        "device": device_name,
        "matmul_peak_flops": peak,
        "settings": {
            "model": f"{args.random_init} (random weights)" if args.random_init else cfg.model.name,
            "learner_dtype": cfg.model.dtype,
            "tf32": tf32,
            "mode": cfg.policy.mode,
            "finetune": cfg.policy.finetune,
            "backend": cfg.backend.kind,
            "branches": cfg.rollout.branches,
            "tasks_per_step": cfg.rollout.tasks_per_step,
            "max_tokens": cfg.rollout.max_tokens,
            "max_rounds": cfg.rollout.max_rounds,
        },
        "steps": steps,
        "median_after_first": summary,
        "updates": [asdict(u) for u in updates],
        "peak_allocated_bytes": process_peak,
        "peak_device_used_bytes": device_peak,
        "wall_s": wall,
    }
    (out / "check_train_gpu.json").write_text(json.dumps(result, indent=2))
    print(f"results: {out / 'check_train_gpu.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
