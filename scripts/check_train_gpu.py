"""A few AT-GRPO steps on CUDA: step time, tokens/s and model FLOPs utilisation.

For a GPU machine (a few minutes with SmolLM2-135M). It runs the quickstart config with the
learner and the embedded engine on CUDA, then prints one row per step from metrics.jsonl:

    python scripts/check_train_gpu.py                      # 4 steps, results in $OUT or /tmp
    python scripts/check_train_gpu.py --steps 6 --model /models/Qwen2.5-0.5B-Instruct

MFU = learner tokens/s x model FLOPs per token / a bf16 torch.mm peak timed in this run.
FLOPs per token of a LoRA update = 2 x forward (frozen weights get no weight gradient), with
forward = 2 x linear parameters (attention scores and the LM head left out, so it is a
lower bound).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def bf16_peak(n: int = 8192, repeats: int = 10) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    torch.mm(a, b)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        torch.mm(a, b)
    torch.cuda.synchronize()
    return 2 * n**3 * repeats / (time.perf_counter() - start)


def linear_params(model_spec: str) -> int:
    from masenvs.adapters.models import load_model

    model = load_model(model_spec, device="cpu").model
    layers = model.model.layers
    return sum(m.weight.numel() for m in layers.modules() if isinstance(m, torch.nn.Linear))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--config", default="examples/quickstart.yaml")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("check_train_gpu: no CUDA device visible to torch; run it on a GPU machine.")
        return 2
    out = Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="masenvs-gpu-"))
    run_dir = out / "gpu-train"
    overrides = {
        "steps": args.steps,
        "run_dir": str(run_dir),
        "model.name": args.model,
        "model.device": "cuda",
        "validation.every": 0,
        "checkpoint.every": args.steps,
        "logging.tensorboard": "false",
    }
    command = [sys.executable, "-m", "masenvs.cli", "train", args.config]
    for key, value in overrides.items():
        command += ["--set", f"{key}={value}"]
    print(" ".join(command), flush=True)
    started = time.perf_counter()
    subprocess.run(command, check=True)
    total = time.perf_counter() - started

    peak = bf16_peak()
    per_token = 2 * 2 * linear_params(args.model)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "time/update_s" in r]
    print(f"\n{torch.cuda.get_device_name()}: bf16 mm peak {peak / 1e12:.1f} TFLOP/s")
    print(
        f"{'step':>4} {'rollout s':>10} {'update s':>9} {'rollout tok/s':>14} {'learner tok/s':>14} {'MFU':>7}"
    )
    for r in rows:
        learner = r.get("learner/tokens_per_s", 0.0)
        print(
            f"{r.get('step', '?'):>4} {r['time/rollout_s']:>10.2f} {r['time/update_s']:>9.2f} "
            f"{r['throughput/rollout_tokens_per_s']:>14.0f} {learner:>14.0f} "
            f"{learner * per_token / peak:>7.2%}"
        )
    print(f"wall time, start-up included: {total:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
