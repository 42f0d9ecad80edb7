"""The same plan-path task trained two ways, side by side: `masenvs train` (AT-GRPO, tree
sampling, one LoRA per agent) on `examples/quickstart.yaml`, and TRL's `GRPOTrainer` through
`masenvs.integrations.trl` with the same model, env options and settings, for the same number
of env steps. Both are scored greedily on the same held-out seeds (the quickstart's
validation: 32 tasks from seed 1000000, success = the plan's moves reach G) every
`validation.every` steps, and each run's wall time and peak RSS are measured.

    python bench/trl_vs_masenvs.py                  # both runs, then the table and the figure
    python bench/trl_vs_masenvs.py --steps 6        # shorter, both sides equal
    python bench/trl_vs_masenvs.py --only trl       # one side; --only report redraws

The TRL side trains the `plan` role (`role="plan"`); `tool` is played by the base model behind
`masenvs serve --route tool=base` (greedy, the same `rollout.max_tokens`), which this script
starts on a free loopback port. Why that mode and what else differs: docs/integrations.md
("masenvs train and TRL on the same task"). Env steps per training step are equal: masenvs
plays 8 tasks x 2 agents x K=4 candidates (64 env steps); TRL plays 8 tasks x 4 episodes of 2
turns (64 env steps).

Writes under --out (default runs/trl-vs-masenvs): masenvs/ (the run dir), masenvs.time and
trl.time (`/usr/bin/time -v`), trl/metrics.jsonl, trl/log_history.json, trl/adapter/,
results.json and curves.png (also copied to --figure).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)  # bench/ would shadow installed packages

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "quickstart.yaml"
TIME = "/usr/bin/time"
MICRO_BATCH = 4  # TRL completions per forward/backward


@dataclass
class RunResult:
    """One side's numbers, as the report and docs show them."""

    name: str
    wall_s: float  # the whole process, validation included
    cpu_s: float  # user + system CPU seconds of the process (less noisy than wall_s when shared)
    peak_rss_mb: float  # the process's peak RSS (`/usr/bin/time -v`)
    helper_cpu_s: float  # TRL: the `masenvs serve` that plays `tool`; masenvs: 0
    helper_peak_rss_mb: float  # TRL: the `masenvs serve` that plays `tool`; masenvs: 0
    val_steps: list[int]
    val_success: list[float]  # greedy success on the held-out seeds at val_steps
    train_steps: list[int]
    train_success: list[float]  # masenvs: tasks whose committed (best-of-K) path reached G;
    # TRL: sampled episodes that did, per step
    val_s: float  # seconds spent validating, inside wall_s


def quickstart(steps: int, model: str | None = None) -> Any:
    from masenvs.trainer.config import load_config

    cfg = load_config(str(CONFIG))
    cfg.steps = steps
    if model is not None:
        cfg.model.name = model
    return cfg


def time_v(path: Path) -> tuple[float, float, float]:
    """Wall seconds, CPU seconds and peak RSS (MB) from a `/usr/bin/time -v` report."""
    text = path.read_text()
    cpu = sum(float(x) for x in re.findall(r"(?:User|System) time \(seconds\): ([\d.]+)", text))
    clock = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)", text)
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
    if clock is None or rss is None:
        raise RuntimeError(f"{path}: no /usr/bin/time -v report (did the run start?)")
    seconds = 0.0
    for part in clock.group(1).split(":"):
        seconds = seconds * 60 + float(part)
    return seconds, cpu, int(rss.group(1)) / 1024


def timed(command: list[str], time_file: Path, log: Path) -> None:
    print("$", " ".join(command), flush=True)
    with log.open("w") as out:
        done = subprocess.run(
            [TIME, "-v", "-o", str(time_file), *command], stdout=out, stderr=subprocess.STDOUT
        )
    if done.returncode != 0:
        raise SystemExit(f"{command[2:4]} failed ({done.returncode}); see {log}")


# --- masenvs train ---------------------------------------------------------------------------


def run_masenvs(out: Path, steps: int, model: str | None) -> None:
    command = [sys.executable, "-m", "masenvs.cli", "train", str(CONFIG.relative_to(ROOT))]
    command += ["--set", f"run_dir={out / 'masenvs'}", "--set", f"steps={steps}"]
    command += ["--set", f"model.name={model}"] if model else []
    timed(command, out / "masenvs.time", out / "masenvs.log")


def masenvs_result(out: Path) -> RunResult:
    rows = [json.loads(line) for line in (out / "masenvs" / "metrics.jsonl").open()]
    wall, cpu_s, rss = time_v(out / "masenvs.time")
    val = [r for r in rows if "val/success" in r]
    train = [r for r in rows if "train/plan_success" in r or "train/success" in r]
    return RunResult(
        name="masenvs train (AT-GRPO, tree, per-agent LoRA)",
        wall_s=wall,
        cpu_s=cpu_s,
        peak_rss_mb=rss,
        helper_cpu_s=0.0,
        helper_peak_rss_mb=0.0,
        val_steps=[int(r["step"]) for r in val],
        val_success=[float(r["val/success"]) for r in val],
        train_steps=[int(r["step"]) for r in train],
        train_success=[float(r.get("train/plan_success", r.get("train/success"))) for r in train],
        val_s=float("nan"),  # masenvs logs no validation time
    )


# --- TRL's GRPOTrainer through the integration -----------------------------------------------


def start_serve(model: str, log: Path) -> tuple[subprocess.Popen[str], str]:
    """`masenvs serve --route tool=base` on a free loopback port: the fixed `tool` player."""
    command = [sys.executable, "-m", "masenvs.cli", "serve", "--model", model]
    command += ["--route", "tool=base", "--port", "0", "--batch-invariant", "auto"]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert server.stdout is not None
    lines: list[str] = []
    for line in server.stdout:
        lines.append(line)
        found = re.search(r"listening: (http://[\d.]+:\d+)", line)
        if found:
            break
    else:
        raise SystemExit("masenvs serve exited before listening:\n" + "".join(lines[-20:]))

    def drain() -> None:
        with log.open("w") as sink:
            sink.writelines(lines)
            for rest in server.stdout:  # type: ignore[union-attr]
                sink.write(rest)

    threading.Thread(target=drain, daemon=True).start()
    return server, found.group(1) + "/v1"


def usage(pid: int) -> dict[str, float]:
    """A live process's CPU seconds so far and peak RSS (MB), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu_s = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
    rss = 0.0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            rss = int(line.split()[1]) / 1024
    return {"cpu_s": cpu_s, "peak_rss_mb": rss}


def run_trl(out: Path, steps: int, model: str | None) -> None:
    cfg = quickstart(steps, model)
    server, url = start_serve(cfg.model.name, out / "serve.log")
    try:
        command = [sys.executable, str(Path(__file__).resolve()), "--trl-worker", url]
        command += ["--out", str(out), "--steps", str(steps), "--model", cfg.model.name]
        timed(command, out / "trl.time", out / "trl.log")
        (out / "serve.json").write_text(json.dumps(usage(server.pid)))
    finally:
        server.terminate()
        server.wait(timeout=60)


def held_out(model: Any, tokenizer: Any, game: Any, seeds: list[int], max_tokens: int) -> float:
    """Greedy success on `seeds`, each episode played as TRL trains it: the integration's
    prompt and tool schema; the reply's `answer(text)` call, else the reply itself, is the
    plan's move."""
    import torch

    games = [game.factory() for _ in seeds]
    with ThreadPoolExecutor(len(seeds)) as pool:  # the served tool answers them in one batch
        observations = list(pool.map(lambda g, seed: g.reset(seed=seed), games, seeds))
    texts = []
    for g, observation in zip(games, observations, strict=True):
        prompt = game.dataset(1)[0]["prompt"]
        prompt[-1]["content"] += observation
        texts.append(
            tokenizer.apply_chat_template(
                prompt, tools=[g.answer], add_generation_prompt=True, tokenize=False
            )
        )
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        ids = model.generate(
            **batch, do_sample=False, max_new_tokens=max_tokens, pad_token_id=tokenizer.pad_token_id
        )
    model.train(was_training)
    replies = tokenizer.batch_decode(
        ids[:, batch["input_ids"].shape[1] :], skip_special_tokens=True
    )
    for g, reply in zip(games, replies, strict=True):
        call = re.search(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", reply, re.S)
        text = None
        if call:
            try:
                parsed = json.loads(call.group(1))
                if parsed.get("name") == "answer":
                    text = str(parsed["arguments"]["text"])
            except (ValueError, KeyError, TypeError):
                text = None
        if text is not None:
            g.answer(text)
        else:
            g._score([{"role": "assistant", "content": reply}])
    return sum(g.success for g in games) / len(games)


def trl_worker(url: str, out: Path, steps: int, model_name: str | None) -> None:
    import torch
    from peft import LoraConfig
    from torch.optim.lr_scheduler import LambdaLR
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from masenvs.engine.loading import load_model
    from masenvs.integrations.episode import openai_player
    from masenvs.integrations.trl import environment, tool_tokenizer

    cfg = quickstart(steps, model_name)
    torch.manual_seed(cfg.seed)
    model = str(load_model(cfg.model.name).path)
    tokenizer = tool_tokenizer(model)
    tool = openai_player(url, max_tokens=cfg.rollout.max_tokens)  # greedy base model
    # masenvs train plays rollout.max_rounds rounds (the prompt says "Round 1 of 1"): the same.
    options = {**cfg.env.options, "max_rounds": cfg.rollout.max_rounds}
    game = environment(cfg.env.name, role="plan", others=tool, **options)
    k, tasks = cfg.rollout.branches, cfg.rollout.tasks_per_step
    seeds = list(
        range(cfg.validation.seed_start, cfg.validation.seed_start + cfg.validation.episodes)
    )
    every = cfg.validation.every
    (out / "trl").mkdir(parents=True, exist_ok=True)
    metrics = (out / "trl" / "metrics.jsonl").open("w")

    class Validate(TrainerCallback):
        """Greedy held-out success at step 0, every `validation.every` steps and at the end,
        inside the run as masenvs validates."""

        val_s = 0.0
        started = 0.0

        def _validate(self, step: int, model: Any) -> None:
            start = time.perf_counter()
            success = held_out(model, tokenizer, game, seeds, cfg.rollout.max_tokens)
            seconds = time.perf_counter() - start
            self.val_s += seconds
            row = {"step": step, "val/success": success, "time/validation": seconds}
            metrics.write(json.dumps(row) + "\n")
            metrics.flush()
            print(
                f"step {step}: held-out greedy success {success:.0%} ({seconds:.0f}s)", flush=True
            )

        def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any):
            self._validate(0, model)

        def on_log(self, args: Any, state: Any, control: Any, **kw: Any):
            history = json.dumps(state.log_history, indent=1)
            (out / "trl" / "log_history.json").write_text(history)

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any):
            self.started = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any):
            row = {"step": state.global_step, "time/step": time.perf_counter() - self.started}
            metrics.write(json.dumps(row) + "\n")
            if state.global_step % every == 0 or state.global_step == state.max_steps:
                self._validate(state.global_step, model)

    class Trainer(GRPOTrainer):
        """GRPOTrainer with masenvs' learning-rate schedule (`OptimConfig.lr_at`: warmup from lr/warmup at
        the first step, then cosine to the floor); HF's starts at 0, losing a step of 10."""

        def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
            if self.lr_scheduler is None:
                self.lr_scheduler = LambdaLR(
                    optimizer or self.optimizer,
                    lambda i: cfg.optim.lr_at(i, steps) / cfg.optim.lr,
                )
            return self.lr_scheduler

    trainer = Trainer(
        model=model,
        processing_class=tokenizer,
        reward_funcs=game.reward,
        train_dataset=game.dataset(steps * tasks, seed_start=cfg.env.seed_start),
        environment_factory=game.factory,
        peft_config=LoraConfig(
            r=cfg.lora.rank,
            lora_alpha=cfg.lora.alpha,
            lora_dropout=cfg.lora.dropout,
            target_modules=cfg.lora.target_modules,
            task_type="CAUSAL_LM",
        ),
        callbacks=[Validate()],
        args=GRPOConfig(
            output_dir=str(out / "trl" / "out"),
            max_steps=steps,
            # 8 tasks x 4 episodes per optimizer step, fed 4 completions at a time (32 at once
            # took 19.7 GB and was OOM-killed; masenvs feeds 512-token micro-batches).
            per_device_train_batch_size=MICRO_BATCH,
            gradient_accumulation_steps=tasks * k // MICRO_BATCH,
            num_generations=k,
            max_completion_length=cfg.rollout.max_tokens,
            temperature=cfg.rollout.temperature,
            learning_rate=cfg.optim.lr,
            weight_decay=cfg.optim.weight_decay,
            max_grad_norm=cfg.optim.grad_clip,
            beta=cfg.algorithm.kl_coef,
            epsilon=cfg.algorithm.clip_low,
            epsilon_high=cfg.algorithm.clip_high,
            num_iterations=cfg.algorithm.ppo_epochs,
            use_cpu=True,
            bf16=False,
            logging_steps=1,
            report_to="none",
            save_strategy="no",
            seed=cfg.seed,
            gradient_checkpointing=False,
        ),
    )
    trainer.train()
    trainer.save_model(str(out / "trl" / "adapter"))
    (out / "trl" / "log_history.json").write_text(json.dumps(trainer.state.log_history, indent=1))
    metrics.close()


def trl_result(out: Path) -> RunResult:
    rows = [json.loads(line) for line in (out / "trl" / "metrics.jsonl").open()]
    history = json.loads((out / "trl" / "log_history.json").read_text())
    finished = (out / "trl.time").exists() and (out / "serve.json").exists()
    wall, cpu_s, rss = time_v(out / "trl.time") if finished else (float("nan"),) * 3
    serve = json.loads((out / "serve.json").read_text()) if finished else {}
    val = [r for r in rows if "val/success" in r]
    train = [h for h in history if "plan_path/success" in h]
    return RunResult(
        name="TRL GRPOTrainer (plan trained, tool = base model)",
        wall_s=wall,
        cpu_s=cpu_s,
        peak_rss_mb=rss,
        helper_cpu_s=serve.get("cpu_s", float("nan")),
        helper_peak_rss_mb=serve.get("peak_rss_mb", float("nan")),
        val_steps=[int(r["step"]) for r in val],
        val_success=[float(r["val/success"]) for r in val],
        train_steps=[int(h["step"]) for h in train],
        train_success=[float(h["plan_path/success"]) for h in train],
        val_s=sum(r["time/validation"] for r in val),
    )


# --- the report ------------------------------------------------------------------------------


def cpu() -> dict[str, Any]:
    info = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = re.search(r"Model name:\s*(.+)", info)
    flags = re.search(r"Flags:\s*(.+)", info)
    avx = sorted({f for f in (flags.group(1).split() if flags else []) if f.startswith("avx")})
    return {
        "model": model.group(1).strip() if model else "?",
        "cores": os.cpu_count(),
        "avx512": any(f.startswith("avx512") for f in avx),
        "avx_flags": avx,
    }


def span(r: RunResult, steps: int) -> str:
    """`12.3 min`, or how far an unfinished run got."""
    done = max(r.train_steps, default=0)
    if r.wall_s == r.wall_s and done >= steps:  # not NaN: the run finished
        return f"{r.wall_s / 60:.1f} min"
    return f"unfinished ({done} of {steps} steps)"


def plot(results: list[RunResult], path: Path, steps: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = ["tab:blue", "tab:orange"]
    for r, color in zip(results, colors, strict=True):
        left.plot(r.val_steps, [100 * s for s in r.val_success], "o-", color=color, label=r.name)
        right.plot(
            r.train_steps, [100 * s for s in r.train_success], ".-", color=color, label=r.name
        )
    left.set_title("held-out greedy success (32 tasks, seeds 1000000+)")
    right.set_title(
        "training episodes that reach G\n(masenvs: each task's committed best-of-K path; TRL: every episode)",
        fontsize=9,
    )
    for ax in (left, right):
        ax.set_xlabel("training step (64 env steps each)")
        ax.set_ylabel("%")
        ax.set_ylim(-3, 103)
        ax.set_xlim(-0.3, steps + 0.3)
        ax.grid(alpha=0.3)
    left.legend(loc="upper left", fontsize=8)
    fig.suptitle(
        "plan_path 4x4, SmolLM2-135M, LoRA r=8, lr 1e-3, K=4, T=0.7, 8 tasks/step: "
        + ", ".join(f"{r.name.split(' (')[0]} {span(r, steps)}" for r in results),
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def report(out: Path, steps: int, figure: Path | None) -> None:
    results = [masenvs_result(out), trl_result(out)]
    machine = cpu()
    (out / "results.json").write_text(
        json.dumps({"cpu": machine, "steps": steps, "runs": [asdict(r) for r in results]}, indent=1)
    )
    plot(results, out / "curves.png", steps)
    if figure is not None:
        shutil.copyfile(out / "curves.png", figure)
    print(f"cpu: {machine['model']}, {machine['cores']} cores, AVX-512: {machine['avx512']}")
    for r in results:
        val = ", ".join(f"{s}: {v:.0%}" for s, v in zip(r.val_steps, r.val_success, strict=True))
        cpu_helper = f" + serve {r.helper_cpu_s / 60:.1f}" if r.helper_cpu_s else ""
        rss_helper = f" + serve {r.helper_peak_rss_mb:.0f} MB" if r.helper_peak_rss_mb else ""
        print(
            f"{r.name}: {span(r, steps)}, wall {r.wall_s / 60:.1f} min, "
            f"CPU {r.cpu_s / 60:.1f}{cpu_helper} min, peak RSS {r.peak_rss_mb:.0f} MB"
            f"{rss_helper}; held-out success {val}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="training steps, both sides")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "trl-vs-masenvs")
    parser.add_argument("--only", choices=["masenvs", "trl", "report"], help="one part")
    parser.add_argument("--model", help="the model of both runs (default: the config's)")
    parser.add_argument("--figure", type=Path, help="also copy curves.png here")
    parser.add_argument("--trl-worker", metavar="URL", help=argparse.SUPPRESS)
    args = parser.parse_args()
    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.trl_worker:
        trl_worker(args.trl_worker, out, args.steps, args.model)
        return
    if args.only in (None, "masenvs"):
        run_masenvs(out, args.steps, args.model)
    if args.only in (None, "trl"):
        run_trl(out, args.steps, args.model)
    if args.only in (None, "report"):
        report(out, args.steps, args.figure)


if __name__ == "__main__":
    main()
