"""Peak memory of one learner step against K and completion length, measured.

One batch = one prompt of 128 tokens with K completions of L tokens (a tree node's K
branches), advantages from rewards 0..K-1. Each (K, L) runs in a fresh process, every
option with a learner of its own: a small warm-up step, then the measured steps. Options compared:

  whole      logprob_chunk_tokens huge: fp32 logits for a whole micro-batch at once
  chunked    logprob_chunk_tokens 1024 (the default until 2026-12-07, now 256): log-probs chunk by chunk
  chunked+gc chunked, and optim.gradient_checkpointing on
  defaults   TrainConfig's defaults (256-token chunks)

Memory on CPU is the process's peak resident set during the measured step (VmHWM, reset
through /proc/self/clear_refs just before it) minus its resident set then; glibc is told
to return large blocks to the OS at once (MALLOC_MMAP_THRESHOLD_), so freed memory is not
counted twice or hidden. On CUDA: torch.cuda.max_memory_allocated minus memory_allocated
before the step. Time is the median over the measured steps.

    python bench/memory.py                          # tiny model, K 4 16 x L 64 256, ~2 minutes on 2 idle cores
    python bench/memory.py --model smollm2-135m --ks 4 8 --lengths 256 --repeats 2
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)  # bench/kernels.py would shadow the `kernels` package transformers imports

import torch  # noqa: E402

from masenvs.trainer.atgrpo import group_advantages  # noqa: E402
from masenvs.trainer.config import load_config  # noqa: E402
from masenvs.trainer.learner.learner import Learner  # noqa: E402
from masenvs.trainer.samples import Sample, tree_group  # noqa: E402

MODES = {
    "whole": ["optim.logprob_chunk_tokens=100000000"],
    "chunked": ["optim.logprob_chunk_tokens=1024"],
    "chunked+gc": ["optim.logprob_chunk_tokens=1024", "optim.gradient_checkpointing=true"],
    "defaults": [],  # TrainConfig's own chunk size and options
}
PROMPT_TOKENS = 128


def _status_kib(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.M).group(1))


def batch(k: int, length: int, vocab: int, cfg: Any) -> list[Sample]:
    rng = random.Random(0)
    prompt = [rng.randrange(vocab) for _ in range(PROMPT_TOKENS)]
    samples = [
        Sample(prompt, [rng.randrange(vocab) for _ in range(length)], [], "agent", "agent",
               tree_group(0, 0, "agent"), float(i))
        for i in range(k)
    ]  # fmt: skip
    return group_advantages(samples, cfg.algorithm)[0]


def measure(model: str, mode: str, k: int, length: int, repeats: int, budget: int) -> dict:
    """One configuration, in this process: peak memory above the pre-step level, step time."""
    cfg = load_config(
        None,
        [f"model.name={model}", "optim.warmup_steps=0", "logging.entropy=true", *MODES[mode]]
        + [f"optim.max_tokens_per_microbatch={budget}", f"steps={repeats + 1}"],
    )
    learner = Learner(cfg, ["agent"])
    vocab = learner.policies["agent"].model.get_base_model().config.vocab_size
    samples = batch(k, length, vocab, cfg)
    cuda = learner.device.type == "cuda"
    learner.step(batch(2, 8, vocab, cfg))  # warm-up: optimizer state and buffers exist after it
    peaks, times = [], []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        else:
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
            before = _status_kib("VmRSS") * 1024
        start = time.perf_counter()
        learner.step(samples)
        if cuda:
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
        else:
            peak = _status_kib("VmHWM") * 1024
        times.append(time.perf_counter() - start)
        peaks.append(peak - before)
    return {
        "mode": mode,
        "k": k,
        "length": length,
        "tokens": k * length,
        "peak_mib": max(peaks) / 2**20,
        "step_s": statistics.median(times),
        "device": learner.device.type,
    }


def run_child(args: argparse.Namespace, k: int, length: int) -> list[dict]:
    """Every mode of one (K, L) in a fresh process, one after the other (see the docstring)."""
    cmd = [sys.executable, __file__, "--child", json.dumps([k, length]), "--modes", *args.modes]
    cmd += ["--model", args.model, "--repeats", str(args.repeats), "--budget", str(args.budget)]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if out.returncode != 0:
        raise SystemExit(f"K={k} L={length} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--ks", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--repeats", type=int, default=2, help="measured steps per configuration")
    parser.add_argument("--budget", type=int, default=4096, help="max_tokens_per_microbatch")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(min(torch.get_num_threads(), os.cpu_count() or 1))
    if args.child:
        k, length = json.loads(args.child)
        rows = []
        for mode in args.modes:
            rows.append(measure(args.model, mode, k, length, args.repeats, args.budget))
            gc.collect()  # the learner is gone: its memory goes back to the OS before the next
        print(json.dumps(rows))
        return

    device = "cuda" if torch.cuda.is_available() else cpu_name()
    print(f"{args.model}, LoRA, prompt {PROMPT_TOKENS} tokens, micro-batch budget "
          f"{args.budget} tokens, {device}, {torch.get_num_threads()} threads")  # fmt: skip
    print(f"{'K':>3} {'L':>5} {'tokens':>7} " + "".join(f"{m:>22}" for m in args.modes))
    rows = []
    for k in args.ks:
        for length in args.lengths:
            done = run_child(args, k, length)
            rows += done
            cells = [f"{row['peak_mib']:8.0f} MiB {row['step_s']:6.2f} s" for row in done]
            print(f"{k:>3} {length:>5} {k * length:>7} " + "".join(f"{c:>22}" for c in cells))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
