"""Update-step time of the learner: one process against 2 torch.distributed ranks (FSDP2, DDP).

Same config, same batch (GRPO-like: prompts x completions, 128 + 128 tokens), LoRA on every
linear layer; `steps` updates each, the first one not timed. Ranks run on gloo on this
machine's CPU cores (cores / 2 threads each; the one-process learner runs with all cores' threads
and with one thread, since on a loaded machine spinning OpenMP threads can cost more than they
give), so the figures show the cost of the split and the collectives, not a GPU's speedup.

    python bench/dist_learner.py                       # SmolLM2-135M, 3 steps
    python bench/dist_learner.py --model tiny --steps 2
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from masenvs.cache import DEFAULT_MODEL
from masenvs.trainer.atgrpo import group_advantages
from masenvs.trainer.config import TrainConfig, load_config
from masenvs.trainer.learner.dist_learner import DistributedLearner
from masenvs.trainer.learner.learner import Learner
from masenvs.trainer.samples import Sample, tree_group


def make_batch(cfg: TrainConfig, prompts: int, branches: int, seed: int) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for task in range(prompts):
        prompt = [rng.randrange(1000, 40000) for _ in range(128)]
        for k in range(branches):
            completion = [rng.randrange(1000, 40000) for _ in range(128)]
            group = tree_group(task, 0, "agent")
            out.append(Sample(prompt, completion, [], "agent", "shared", group, float(k % 2)))
    return group_advantages(out, cfg.algorithm)[0]


def time_steps(learner: Learner | DistributedLearner, batches: list[list[Sample]]) -> list[float]:
    times = []
    for batch in batches:
        start = time.perf_counter()
        learner.step(batch)
        times.append(time.perf_counter() - start)
    return times[1:]  # the first step warms up


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--branches", type=int, default=4)
    args = parser.parse_args()
    rows = {}
    threads = torch.get_num_threads()
    runs = [(f"1 process, {threads} threads", 1, "fsdp", threads),
            ("1 process, 1 thread", 1, "fsdp", 1),
            ("2 ranks fsdp", 2, "fsdp", threads), ("2 ranks ddp", 2, "ddp", threads)]  # fmt: skip
    for name, world, sharding, n in runs:
        torch.set_num_threads(n)  # ranks take cores / world_size threads each
        cfg = load_config(
            None,
            [
                f"model.name={args.model}",
                "model.device=cpu",
                "model.dtype=float32",
                "policy.mode=shared",
                "optim.max_tokens_per_microbatch=2048",
                f"distributed.learner.world_size={world}",
                f"distributed.learner.sharding={sharding}",
            ],
        )
        batches = [make_batch(cfg, args.prompts, args.branches, s) for s in range(args.steps)]
        learner = Learner(cfg, ["agent"]) if world == 1 else DistributedLearner(cfg, ["agent"])
        try:
            times = time_steps(learner, batches)
        finally:
            getattr(learner, "close", lambda: None)()
        rows[name] = statistics.median(times)
        print(f"{name:22s} update {rows[name]:.2f} s (median of {len(times)})", flush=True)
    print(json.dumps({"model": args.model, "tokens": args.prompts * args.branches * 256, **rows}))


if __name__ == "__main__":
    main()
